"""How much the gateway takes on and in what order: the admission gate, tenants and priorities,
each tenant's use of each pool, and the fair queue of requests waiting for capacity.

May import ``config`` and ``http.errors`` only; the request path calls it, it never calls back.
"""
