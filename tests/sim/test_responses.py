"""vLLM's response shapes (sim.responses) that the HTTP tests do not pin on their own."""

from __future__ import annotations

import pytest

from engine_model.seq import Seq
from sim.parsing import Job
from sim.responses import prompt_tokens_details


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_usage_details_shapes(endpoint):
    seq = Seq("x", list(range(10)), 1)
    seq.cached_tokens, seq.created_cache_tokens = 8, 0
    job = Job(
        endpoint=endpoint, kind="plain", base_id="x", response_id="x", prompts=[list(range(10))], n=1,
        stream=False, include_usage=True, continuous_usage=False, max_tokens=[1], min_tokens=0, stop=[],
        stop_token_ids=[], ignore_eos=False, return_token_ids=False, kv_in=None, seqs=[seq],
    )  # fmt: skip
    full = prompt_tokens_details(job, stream=False)
    streamed = prompt_tokens_details(job, stream=True)
    if endpoint == "chat":
        assert full == {"cached_tokens": 8, "created_cache_tokens": 0, "multimodal_tokens": None}
        assert streamed == {"cached_tokens": 8, "created_cache_tokens": 0}
    else:
        assert full == {"cached_tokens": 8, "created_cache_tokens": None, "multimodal_tokens": None}
        assert streamed == {"cached_tokens": 8}
