"""Choosing an engine or backend per request: the policy (``policy.py``) and the prefix
index it reads, kept from KV-cache events (``prefix_index.py``). Stdlib only, so the router
and a data-parallel dispatcher can share it."""
