"""What an operator reads: the Prometheus metrics (and their merge across workers), OpenTelemetry
traces, the JSON access log, the live planner's engine recommendation, and the garbage collector
kept off the request path's tail.

The metrics registry watches every service it exports (pools, feeds, discovery, the gate, the
worker bus), so ``ops.metrics`` imports their types; the rest of ``ops`` imports ``config``,
``background`` and ``policies`` only. The live planner runs the simulator's model (``sim``): the
one import of ``sim`` left in the gateway besides the CLI and the config check.
"""
