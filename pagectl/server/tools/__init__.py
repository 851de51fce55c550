"""Tool calling: the request surface (``request.py``), how required and named tool choices
become a structured-outputs constraint, the parsers that find tool calls in a model's text
(``parsers/``, one module per format, looked up by ``--tool-call-parser NAME``) and the
response shapes (``response.py``)."""
