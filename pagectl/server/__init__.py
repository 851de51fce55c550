"""The daemon's API-server process: the OpenAI-compatible aiohttp HTTP API.

Runs in the daemon's main process and reaches the engine only through an engine client
(``pagectl.engine_process.client.EngineClient`` in the daemon, an in-process double in tests).
"""
