"""Per-request data: typed keys, published by one policy and read by another, through the pipeline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.base import Path, PathChoice, PoolSnapshot, Publisher
from policies.data import Key, RequestData
from policies.max_score import MaxScore
from policies.pipeline import PoolPipeline, RoutingPipeline, Weighted
from policies.token_threshold import TokenThreshold

from .helpers import ctx, ep

PREFERRED = Key[str]("test.preferred", "the decode engine a publisher prefers for this request")
SCORED = Key[int]("test.scored")


def test_a_value_is_read_back_under_its_key():
    data = RequestData()
    assert data.get(PREFERRED) is None and data.get(PREFERRED, "none") == "none"
    assert PREFERRED not in data
    data.put(PREFERRED, "d1")
    data.put(SCORED, 3)
    data.put(SCORED, 4)  # a later value replaces the earlier one
    assert (data.get(PREFERRED), data.get(SCORED, 0)) == ("d1", 4)
    assert PREFERRED in data and "test.preferred" not in data
    assert data.names() == ["test.preferred", "test.scored"]
    assert repr(data) == "RequestData(test.preferred, test.scored)"


def test_keys_compare_by_identity_and_may_not_share_a_name():
    data = RequestData()
    data.put(SCORED, 1)
    twin = Key[int]("test.scored")
    assert twin != SCORED and twin not in data and data.get(twin) is None
    with pytest.raises(KeyError, match=r"another key is named 'test\.scored'"):
        data.put(twin, 2)
    with pytest.raises(ValueError):
        Key[int]("")
    assert repr(SCORED) == "Key('test.scored')"


def test_every_copy_of_a_request_context_shares_its_data():
    """The prefill pool sees a copy with ``paired`` set: what the decode pool published is there."""
    c = ctx(10)
    c.data.put(SCORED, 7)
    copy = replace(c, paired=ep("d0"))
    assert copy.data is c.data and copy.data.get(SCORED) == 7
    assert ctx(10).data.get(SCORED) is None  # one slot per request
    assert c == replace(c, data=RequestData())  # the data does not make two contexts differ


class Prefers:
    """Publishes, before the pools choose, the decode engine this request should go to."""

    def __init__(self, url: str) -> None:
        self.url = url

    def publish(self, ctx):
        ctx.data.put(PREFERRED, self.url)

    def score(self, ctx, candidates):
        return [0.0] * len(candidates)


class ReadsPreferred:
    """A scorer of what another policy published."""

    def score(self, ctx, candidates):
        want = ctx.data.get(PREFERRED)
        return [1.0 if e.url == want else 0.0 for e in candidates]


class CountsScored:
    """A decode scorer that publishes how many candidates it saw, for the decider."""

    def score(self, ctx, candidates):
        ctx.data.put(SCORED, len(candidates))
        return [0.0] * len(candidates)


class DecidesOnScored:
    def decide(self, ctx, decode, prefill):
        n = ctx.data.get(SCORED, 0)
        return PathChoice(Path.PD if n > 2 else Path.DIRECT, "scored", f"scored={n}")


POOLS = PoolSnapshot((ep("p0", "prefill"),), (ep("d0"), ep("d1"), ep("d2")))


def test_a_publisher_runs_once_before_the_pools_and_a_scorer_reads_it():
    prefers = Prefers("d2")
    assert isinstance(prefers, Publisher) and not isinstance(ReadsPreferred(), Publisher)
    picker = MaxScore()
    pipe = RoutingPipeline(
        TokenThreshold(threshold=1000),
        decode=PoolPipeline(picker, scorers=(Weighted("prefers", prefers, 1), Weighted("reads", ReadsPreferred(), 1))),
        prefill=PoolPipeline(picker, scorers=(Weighted("prefers", prefers, 1),)),
    )
    assert pipe.publishers == (prefers,)  # each object once, whatever places it holds
    c = ctx(10)
    pipe.publish(c)
    assert c.data.get(PREFERRED) == "d2"
    assert pipe.route(c, POOLS).decision.decode.url == "d2"


def test_what_a_decode_scorer_publishes_the_decider_reads():
    pipe = RoutingPipeline(
        DecidesOnScored(),
        decode=PoolPipeline(MaxScore(), scorers=(Weighted("counts", CountsScored(), 1),)),
        prefill=PoolPipeline(MaxScore()),
    )
    c = ctx(10)
    d = pipe.route(c, POOLS).decision
    assert (d.path, d.detail) == (Path.PD, "scored=3")
    assert c.data.get(SCORED) == 3  # and the lifecycle hooks, handed the same context, see it
    two = PoolSnapshot(POOLS.prefill, POOLS.decode[:2])
    assert pipe.route(ctx(10), two).decision.path is Path.DIRECT
