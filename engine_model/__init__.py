"""The engine model: what the gateway and the simulator both need to know about a vLLM engine.

It holds the step-time model of a vLLM engine (continuous batching, chunked prefill, prefix cache,
KV pulls: ``engine``, ``prefix``, ``kv``, ``kv_events``), the engine profiles that set it from a model
and a GPU node (``profile``, ``profiles/*.yaml``, ``calibration``), the fleet simulation in virtual
time and the capacity planner built on it (``fleet``, ``virtual``, ``planner``, ``workload``,
``plan_cli``), vLLM-compatible chat rendering (``chat``), and the project's tiny test tokenizer
(``tinymodel``). ``gateway`` (the live planner, config checks, tokenization) and ``sim`` (which serves
this model over vLLM's HTTP API) both import it; it imports neither, so the top-level packages have
no cycle (tests/test_architecture.py checks it on the import graph).

Importing the package runs nothing: ``python -m engine_model.tinymodel`` runs in vLLM's own venv.
"""
