"""One request's charges to its tenant (gateway/fairness/accounting.py), on a real ``Usage`` with
a clock the test moves: the slot while admitted, prefill tokens, each decode leg's occupancy, and
the decode use settled to the tokens the answer took."""

from __future__ import annotations

import pytest

from gateway.fairness.accounting import TenantAccount
from gateway.fairness.tenants import Usage


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def usage() -> Usage:
    return Usage(half_life_s=1e9, clock=Clock())  # no fading within a test


def test_the_request_holds_its_tenants_gateway_use_from_admission_to_its_end(usage):
    account = TenantAccount(usage, "acme", default_output_tokens=256)
    account.ended()  # never admitted: nothing to give back
    assert usage.local("gateway", "acme") == 0
    account.admitted()
    assert usage.local("gateway", "acme") == 1
    account.ended()
    account.ended()  # once only
    assert usage.local("gateway", "acme") == 0


def test_prefill_tokens_and_decode_occupancy_count_for_the_tenant(usage):
    account = TenantAccount(usage, "acme", default_output_tokens=256)
    account.prefill_sent(1000)
    assert usage.local("prefill", "acme") == pytest.approx(1000)
    leg = account.decode_started({"max_tokens": 40})
    assert leg == ("acme", 40) and usage.local("occupancy", "acme") == 40
    default = account.decode_started({})  # no max_tokens: the configured default
    assert default == ("acme", 256) and usage.local("occupancy", "acme") == 296
    account.decode_ended(leg)
    account.decode_ended(default)
    assert usage.local("occupancy", "acme") == 0


def test_the_decode_use_is_settled_to_the_tokens_the_answer_took(usage):
    account = TenantAccount(usage, "acme", default_output_tokens=256)
    account.decode_ended(account.decode_started({}))  # charged 256 up front
    assert usage.local("decode", "acme") == pytest.approx(256)
    account.settle(None)  # no count known: the charge stands
    assert usage.local("decode", "acme") == pytest.approx(256)
    account.settle(10)
    assert usage.local("decode", "acme") == pytest.approx(10)
