"""The engine: KV cache, scheduler, model runner. Imports no aiohttp, zmq or textual."""
