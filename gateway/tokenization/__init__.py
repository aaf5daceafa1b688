"""Token ids of a request's prompt, computed as the engine computes them: chat template rendering
(vLLM's rules), the tokenizer and its checked fast path, and the model hub check.

May import ``config``, ``http.errors`` and the parsed body (``request.protocol``), nothing else.
"""
