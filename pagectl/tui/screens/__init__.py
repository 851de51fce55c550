"""Modal screens: confirmation, value prompt, help."""
