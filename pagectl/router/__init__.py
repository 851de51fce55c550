"""``pagectl route``: a reverse proxy for the OpenAI endpoints in front of several daemons,
choosing a backend per request with ``pagectl.routing``: backends (``backends.py``: health,
/metrics scrape, KV-event subscription), the proxy app (``proxy.py``)."""
