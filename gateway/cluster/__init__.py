"""One gateway as several processes and replicas: the worker supervisor (``workers``: it starts the
app in each process, so it sits above ``http``), the worker bus (a ZMQ hub) that keeps the
processes one view, and the routing state replicas share on Redis (``redis_state``).

``workerbus`` and ``redis_state`` may import ``engines``, ``fairness``, ``config``, ``background``
and ``policies``; only ``workers`` imports ``http`` and ``cli``.
"""
