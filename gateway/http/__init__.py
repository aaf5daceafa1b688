"""The HTTP front: the server and its guard (bounds on what a client may send and hold), the
Starlette app whose lifespan builds and stops every service, the routes' handlers, who may call
(API keys, the admin token) and errors in the OpenAI shape.

The top of the house: it may import every other sub-package. Below it, only ``errors`` (the OpenAI
error shape every layer raises), ``auth`` (``request`` authorizes with it) and ``server`` (the
connection counts ``ops.metrics`` exports, the guard ``cluster.workers`` serves behind) are used.
"""
