"""The daemon's engine-core process, and the API server's client of it.

``main`` is the process entry (``python -m pagectl.engine_process.main``) and its handshake,
``loop`` the one thread that owns the ``EngineCore`` and every socket, ``control_handler``
serves the admin channel's requests between steps, ``wire`` holds the messages between the two
processes, and ``client`` is the API server's side: spawn, handshake, route outputs, watch.
"""
