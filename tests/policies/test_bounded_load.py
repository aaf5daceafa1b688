from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.request.router import build_pipeline
from policies.base import PoolSnapshot
from policies.bounded_load import BoundedLoad
from policies.prefix_affinity import PrefixAffinity

from .helpers import ctx, ep


def test_an_engine_far_above_the_mean_load_is_left_out():
    # mean 4, bound 1.25 * 4 + 2 = 7: the engine with 10 in flight is over it.
    kept = BoundedLoad().filter(ctx(1), [ep("a", in_flight=1), ep("b", in_flight=1), ep("c", in_flight=10)])
    assert [e.url for e in kept] == ["a", "b"]


def test_the_engines_own_queue_counts():
    kept = BoundedLoad().filter(ctx(1), [ep("a", in_flight=1), ep("b", in_flight=1, waiting=12)])
    assert [e.url for e in kept] == ["a"]


def test_small_differences_and_single_candidates_pass():
    many = [ep("a", in_flight=3), ep("b", in_flight=1), ep("c", in_flight=2)]
    assert BoundedLoad().filter(ctx(1), many) == many
    assert BoundedLoad(load_factor=1, slack=0).filter(ctx(1), [ep("a", in_flight=50)])[0].url == "a"


def test_never_leaves_no_candidate():
    views = [ep(u, in_flight=n) for u, n in (("a", 0), ("b", 7), ("c", 100))]
    assert [e.url for e in BoundedLoad(load_factor=1, slack=0).filter(ctx(1), views)] == ["a", "b"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"load_factor": 0.5}, "load_factor: Input should be greater than or equal to 1"),
        ({"slack": -1}, "slack: Input should be greater than or equal to 0"),
        ({"load_factor": "x"}, "load_factor: Input should be a valid number"),
        ({"slack": True}, "slack: Input should be a valid number"),
    ],
)
def test_rejects_bad_params(bad, message):
    with pytest.raises(ValueError, match=message):
        BoundedLoad(**bad)


def test_a_hot_prefix_spreads_once_its_engine_is_overloaded(tokenizer_dir):
    """In the default decode pipeline the cache-holding engine keeps winning until it is busier
    than the bound; then the others take the prefix (and prefill it)."""
    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": ["http://a", "http://b", "http://c"]}},
        }
    )
    pipe = build_pipeline(cfg.routing)
    request = ctx(64, cached_tokens={"http://a": 64})
    assert PrefixAffinity().score(request, [ep("http://a"), ep("http://b")])[0] > 0

    def pick(load_a: int) -> str:
        views = (ep("http://a", in_flight=load_a), ep("http://b", in_flight=1), ep("http://c", in_flight=1))
        return pipe.route(request, PoolSnapshot((), views)).decision.decode.url

    assert pick(3) == "http://a"  # busier, but within 1.25 x mean + 2: the cache wins
    assert pick(8) != "http://a"  # mean 3.3, bound 6.2: the burst goes elsewhere
