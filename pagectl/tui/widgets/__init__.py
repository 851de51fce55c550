"""The console's panels, one widget per module."""
