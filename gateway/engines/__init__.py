"""Everything about the engines: the HTTP transport to them (an interface, the aiohttp reference
and the lean HTTP/1.1 client), one leg at a time on that wire, the pools and their health, what the
engines say about themselves (load from /metrics, served models, KV cache events) and where they are
(Kubernetes discovery).

May import ``config``, ``background`` and ``policies`` (the views routing reads), and the OpenAI
error shape from ``http.errors``; never ``request``, ``cluster`` or the rest of ``http``.
"""
