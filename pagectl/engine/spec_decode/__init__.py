"""Speculative decoding: configuration, proposers and the acceptance rule."""
