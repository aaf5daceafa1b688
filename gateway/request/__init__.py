"""One client request's journey: the OpenAI body read and checked, the wait for capacity on the
engines, the route, the prefill and decode legs, the answer relayed on the client's wire, and its
continuation on another engine when a decode leg breaks (migration, stitch).

``exchange`` tells the story top to bottom and drives the rest. May import ``engines``,
``tokenization``, ``fairness``, ``ops``, ``config``, ``context`` and ``policies``; from ``http``
only its errors and ``auth``; from ``cluster`` only the Redis state's type.
"""
