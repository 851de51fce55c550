"""The daemon: OpenAI-compatible HTTP server, engine-core process, admin channel."""
