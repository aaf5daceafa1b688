"""A config, checked and applied: what can be validated without engines, the address the command
line gives, and a reload that changes nothing unless every step succeeds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.config import GatewayConfig, access_switched_off
from gateway.context import Runtime
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Tenancy, label_secret
from gateway.http.handlers import Gateway
from gateway.request.router import Router, build_pipeline
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers
from policies.beliefs.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


def validate(cfg: GatewayConfig) -> None:
    """Everything about a config that can be checked without engines or tokenizers (used by
    ``pdgate check-config``, at startup and before a reload takes effect)."""
    build_pipeline(cfg.routing)
    Router(cfg.routing, Pools([], []), PrefixIndex())  # the prefix hashing settings
    cfg.admin_token()
    Tenancy(cfg.fairness, cfg.key_entries(), label_secret(cfg.admin))  # the keys' tenants and classes
    if cfg.state.backend == "redis":
        cfg.state.redis_url()


def _shown(value: Any) -> str:
    """A config value for a log line: set or unset, never what it holds (file and variable names
    only)."""
    return "unset" if value in (None, "", [], {}) else repr(value)


def listening(cfg: GatewayConfig, host: str, port: int) -> GatewayConfig:
    """``cfg`` with the address the server listens on (``pdgate serve --host/--port`` win over the file)."""
    if (cfg.server.host, cfg.server.port) == (host, port):
        return cfg
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"host": host, "port": port})})


# Sections bound to the process (listening socket, shared-state connection): a reload keeps the
# running values and says so.
RESTART_ONLY = ("server", "state", "telemetry", "engines", "epp")


async def apply_config(
    gw: Gateway,
    new: GatewayConfig,
    version: str,
    applied: Callable[[GatewayConfig, str], None] | None = None,
) -> None:
    """Validate everything first, then swap: a reload that fails at any step changes nothing.
    ``applied`` hears of the swap at once (a worker's supervisor: a worker it starts from then on
    starts from this config)."""
    old = gw.runtime
    services = gw.services
    pools = services.pools
    validate(new)
    token = new.admin_token()
    switched_off = access_switched_off(old.cfg, new)  # raises for what an edit would switch off unsaid
    keys = tuple(k.key.encode() for k in new.key_entries())
    _say_access_changes(old, new, token, keys, switched_off)
    for section in RESTART_ONLY:
        if getattr(new, section) != getattr(old.cfg, section):
            log.warning("config reload: the %s section changed; it takes effect at the next restart", section)
            new = new.model_copy(update={section: getattr(old.cfg, section)})
    tokenizers = old.tokenizers
    if (
        new.models != old.cfg.models
        or new.tokenizer != old.cfg.tokenizer  # or a template file's text:
        or list(map(new.tokenizer_model, new.models)) != list(map(old.cfg.tokenizer_model, old.cfg.models))
    ):
        try:
            loaded = await asyncio.gather(
                *(
                    asyncio.to_thread(ModelTokenizer.load, m)
                    if (t := old.tokenizers.get(m.name)) is None or t.cfg != m
                    else asyncio.sleep(0, t)
                    for m in map(new.tokenizer_model, new.models)  # a template file's text
                )
            )
        except Exception as err:  # a missing or broken tokenizer: keep serving the old config
            raise ValueError(f"models: cannot load a tokenizer ({type(err).__name__}: {err})") from None
        tokenizers = Tokenizers(loaded, new.tokenizer)
    runtime = Runtime.build(new, version, services, tokenizers, token)
    # Nothing below can fail: the new config is applied whole.
    eff = services.discovery.effective(new) if services.discovery else new  # static + discovered endpoints
    removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls, eff.pools.topology)
    pools.configure(new.signals.max_age_s, new.health.outlier)
    for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
        services.forget(url)
    gw.runtime = runtime
    if applied is not None:
        applied(new, version)
    services.gate.limit = new.admission.max_in_flight
    services.configure(new.fairness, runtime.tenancy.names)
    if services.models:
        services.models.configure([m.name for m in new.models], new.health.timeout_s, new.lora.refresh_s)
    if services.subs:
        await services.subs.update(eff)
    if services.discovery:
        await services.discovery.configure(new)
    if tokenizers is not old.tokenizers:
        old.tokenizers.close(cancel=False)  # requests still tokenizing there finish first
    if services.models:
        await services.models.check_all()


def _say_access_changes(
    old: Runtime, new: GatewayConfig, token: str | None, keys: tuple[bytes, ...], switched_off: list[str]
) -> None:
    """Who may call the gateway never changes quietly: every change to ``auth`` and ``admin`` is
    logged (names and counts, never keys), and switching access off on purpose, loudly."""
    for section in ("auth", "admin"):  # who may call the gateway: never changed quietly
        before, after = getattr(old.cfg, section), getattr(new, section)
        changed = [
            f"{k}: {_shown(getattr(before, k))} -> {_shown(getattr(after, k))}"
            for k in type(after).model_fields
            if getattr(before, k) != getattr(after, k)
        ]
        if section == "auth" and keys != old.api_keys:  # the keys file's content too (names only, never keys)
            changed.append(
                f"API keys: {len(old.api_keys)} -> {len(keys)} ({len(set(old.api_keys) - set(keys))} "
                f"removed, {len(set(keys) - set(old.api_keys))} added)"
            )
        if section == "admin" and token != old.admin_token and not changed:
            changed.append("the admin token (its file's content)")
        if changed:
            log.warning("config reload changes %s: %s", section, ", ".join(changed))
    if switched_off:  # said on purpose (auth.disabled / admin.disabled); still, loudly
        log.error(
            "config reload switches authentication OFF on purpose: %s no longer apply%s",
            " and ".join(switched_off),
            " (access is now open: anyone who reaches the port may call the API)" if not keys else "",
        )
