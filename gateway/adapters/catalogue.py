"""Which request model names are LoRA adapters, of which base model, and loaded from which path.

An adapter is served under its own name with its base model's tokenizer and chat template. Its KV
blocks are hashed by vLLM with the adapter's name *and the path the engine loaded it from*
(``_gen_lora_extra_hash_keys``, ``vllm/v1/core/kv_cache_utils.py`` lines 578-595), so the gateway
hashes a prompt with the same pair: an adapter's prompt never matches the base model's cache, nor
another adapter's. The path is what the engines report (their /v1/models cards' ``root``) when they
list the adapter, else the configured one (what dynamic loading will give them).

Configured adapters (``models[].adapters``) come with a config version; with ``lora.discover`` an
adapter the engines list whose ``parent`` is a configured model is served too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.engines.pools import Pools


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    base: str  # the configured model it adapts
    path: str  # as the engines load it (hashed into its KV blocks)
    configured: bool  # in the config (dynamic loading may load it); else only discovered on engines
    max_rank: int | None = None

    @property
    def lora(self) -> tuple[str, str]:
        """The (name, path) pair vLLM hashes into every block of the adapter's prompts."""
        return self.name, self.path


class Catalogue:
    """One config version's adapters, plus those the engines list (read live from the pools)."""

    def __init__(self, cfg: GatewayConfig, pools: Pools) -> None:
        self._configured = {
            a.name: Adapter(a.name, m.name, a.path, True, a.max_rank) for m in cfg.models for a in m.adapters
        }
        self._bases = frozenset(m.name for m in cfg.models)
        self._discover = cfg.lora.discover
        self._pools = pools
        self._seen_version = -1
        self._reported: dict[str, Adapter] = {}

    def resolve(self, name: str) -> Adapter | None:
        """The adapter ``name`` names (None: a base model or nothing known)."""
        if name in self._bases:
            return None
        reported = self._from_engines()
        configured = self._configured.get(name)
        if configured is not None:
            seen = reported.get(name)
            # the engines' path wins: it is the one their blocks are hashed with
            return configured if seen is None or seen.base != configured.base else _with_path(configured, seen.path)
        return reported.get(name) if self._discover else None

    def all(self) -> list[Adapter]:
        """Every adapter served (for /v1/models): configured ones first, then discovered ones."""
        reported = self._from_engines()
        names = list(self._configured) + sorted(n for n in reported if n not in self._configured)
        return [a for n in names if (a := self.resolve(n)) is not None]

    def _from_engines(self) -> Mapping[str, Adapter]:
        """The engines' adapter cards whose parent is a configured model; where engines disagree on
        an adapter's path, the one most of them report."""
        if self._seen_version == self._pools.served_version:
            return self._reported
        votes: dict[str, Counter[tuple[str, str]]] = {}
        for ep in self._pools.all():
            for name, (root, parent) in ep.adapters.items():
                if parent in self._bases and name not in self._bases:
                    votes.setdefault(name, Counter())[(root, parent)] += 1
        self._reported = {
            name: Adapter(name, parent, root, name in self._configured)
            for name, counts in votes.items()
            for (root, parent), _ in counts.most_common(1)
        }
        self._seen_version = self._pools.served_version
        return self._reported


def _with_path(a: Adapter, path: str) -> Adapter:
    return Adapter(a.name, a.base, path, a.configured, a.max_rank)
