"""``pagectl daemon``'s life cycle: runtime dir and token, API server, engine process, drain."""
