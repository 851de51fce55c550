"""pagectl top: the live KV-cache operator console."""
