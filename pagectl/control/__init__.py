"""The admin channel's client side, used by the console (``pagectl top``) and ``pagectl ctl``.

``protocol`` is the channel's wire contract (docs/ADMIN_PROTOCOL.md), ``runtime`` finds a
running daemon (runtime file, control token), ``client`` talks to it. Nothing here imports
the HTTP server.
"""
