"""The request context and endpoint views policies are handed (``policies/base.py``)."""

from __future__ import annotations

from .helpers import ctx


def test_fully_cached_prompt_still_computes_its_last_token():
    c = ctx(32, cached_tokens={"d0": 32})
    assert c.cached("d0") == 31 and c.uncached("d0") == 1
