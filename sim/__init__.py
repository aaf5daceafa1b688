"""The engine simulator: the engine model (``engine_model``) served over vLLM's HTTP API.

``app`` is the Starlette app of one simulated engine (OpenAI endpoints, ``/metrics`` with vLLM's
names, the NIXL-style KV side channel, ``/sim/*`` controls), ``protocol`` its request and response
shapes, ``cli`` the ``pdgate sim`` command. It imports ``engine_model`` and never ``gateway``: the
gateway reaches it only over HTTP, as it reaches a real engine.
"""
