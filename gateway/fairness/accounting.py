"""One request's charges to its tenant's use of each pool (gateway/fairness/tenants.py's
``Usage``), which orders the fair queues: the request while it holds a slot, the tokens it sends
the prefill pool, and each decode leg as one running sequence times its expected output, settled
to what it took once the answer is whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.fairness.tenants import Usage


class TenantAccount:
    """The exchange calls it at each step; it never calls back."""

    def __init__(self, usage: Usage, tenant: str, default_output_tokens: int) -> None:
        self._usage = usage
        self.tenant = tenant
        self._default_output = default_output_tokens
        self._request: str | None = None  # its request counted in the tenant's gateway use
        self._decode: tuple[str, float, float] | None = None  # key, expected output charged, since

    def admitted(self) -> None:
        self._request = self._usage.request_started(self.tenant)

    def ended(self) -> None:
        """Before the slot passes on: the next in line is chosen by use."""
        if self._request is not None:
            self._usage.request_ended(self._request)
            self._request = None

    def prefill_sent(self, tokens: int) -> None:
        self._usage.prefill_sent(self.tenant, tokens)

    def decode_started(self, body: Mapping[str, Any]) -> tuple[str, float]:
        """A decode leg begins: one running sequence x its expected output (the body's
        ``max_completion_tokens``/``max_tokens``, else the configured default)."""
        expected = body.get("max_completion_tokens") or body.get("max_tokens")
        if not isinstance(expected, int) or expected <= 0:
            expected = self._default_output
        key = self._usage.decode_started(self.tenant, expected)
        _, charged, since = self._decode or (key, 0.0, self._usage.now())
        self._decode = (key, charged + expected, since)  # a continuation's: from the first leg's start
        return key, expected

    def decode_ended(self, occupancy: tuple[str, float]) -> None:
        self._usage.decode_ended(*occupancy)

    def settle(self, output_tokens: int | None) -> None:
        """The decode use charged up front was the expected output: now the tenant pays what it took."""
        if self._decode is not None and output_tokens is not None:
            key, charged, since = self._decode
            self._usage.decode_settled(key, charged, output_tokens, since)
