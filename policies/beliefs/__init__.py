"""What the router believes about each engine, kept apart from the policies that read it: which
prompt blocks it holds (``blockhash``: vLLM's block hashes; ``prefix_index``: the index, confirmed
by the engine's KV events or learned from answers; ``prefix_learning``: what a request teaches, and
prompts in flight) and how fast it is (``estimates``: prefill speed and P/D hand-over times).

Pure: no I/O, no import of ``gateway`` or ``sim``; may import the contracts at ``policies``' top.
"""
