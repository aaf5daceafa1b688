"""The gateway: the config version in use, the long-lived services, and what the status routes read.

Each inference request becomes an ``Exchange`` (gateway/request/exchange.py), built here with the runtime
current at its arrival; a reload swaps ``runtime`` between requests.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from gateway.context import Runtime, Services
from gateway.http.errors import APIError
from gateway.ops.metricsmerge import merge
from gateway.request.exchange import Exchange
from gateway.request.protocol import Kind


class Gateway:
    """The two context objects (gateway/context.py), handed in (tests build their own);
    ``runtime`` is the one attribute that changes, on reload."""

    def __init__(self, runtime: Runtime, services: Services) -> None:
        self.runtime = runtime
        self.services = services

    def exchange(self, request: Request, kind: Kind, path: str) -> Exchange:
        return Exchange(self.runtime, self.services, request, kind, path)

    async def metrics(self) -> bytes:
        """``GET /metrics``: this worker's metrics, merged with the other workers' when there are any."""
        own, bus = self.services.metrics.render(), self.services.bus
        if bus is None:
            return own
        others = await bus.others_metrics()
        # A worker that does not answer in time (busy, dead, restarting) counts with the newest
        # answer any scrape got from it (the bus keeps them, whichever worker asked): its counters,
        # not its gauges (gateway/ops/metricsmerge.py). (A restarted worker's counters do start
        # over.) Fewer reporting than configured: a worker is stuck or restarting.
        texts = [own, *(others[w] for w in sorted(others))]
        latest = bus.latest_metrics
        stale = [latest[w] for w in sorted(latest) if w not in others and w != bus.worker]
        workers = (
            b"# HELP pdgate_workers Worker processes of this gateway: configured, and reporting in this scrape\n"
            b"# TYPE pdgate_workers gauge\n"
            b'pdgate_workers{state="configured"} %d\npdgate_workers{state="reporting"} %d\n'
            % (bus.workers, 1 + len(others))
        )
        return merge(texts, stale) + workers

    async def explain(self, request: Request) -> dict[str, Any]:
        """``POST /debug/route``: what the gateway would do with this body, without sending it."""
        kind = request.query_params.get("kind", "chat")  # without it, the body tells
        match kind:  # (a match narrows the str to a Kind)
            case "chat" | "completion":
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                return await self.exchange(request, kind, path).plan()
            case _:
                raise APIError(400, "kind must be 'chat' or 'completion'.", param="kind")

    async def ready_now(self) -> dict[str, Any]:
        """``GET /ready``: the decode pool probed afresh first when its last probe is not recent."""
        if self.services.health is not None:
            await self.services.health.fresh()
        return self.ready()

    def ready(self) -> dict[str, Any]:
        """The body of ``GET /ready``."""
        pools = self.services.pools
        feeds = self.services.subs.all() if self.services.subs else []
        body: dict[str, Any] = {
            "ready": pools.ready(),
            "pools": {
                name: {
                    "healthy": sum(e.healthy for e in eps),
                    "ejected": sum(e.ejected for e in eps),
                    "total": len(eps),
                }
                for name, eps in (("prefill", pools.prefill), ("decode", pools.decode))
            },
            "kv_event_feeds": {"connected": sum(f.counters.connected for f in feeds), "total": len(feeds)},
            # The error's kind only: its text names Redis's address, and /ready needs no credentials
            # (the whole text is in the log).
            "shared_state": (
                {
                    "backend": "redis",
                    "healthy": self.services.shared.status.healthy,
                    "error": self.services.shared.status.last_error.split(":", 1)[0] or None,
                }
                if self.services.shared
                else {"backend": "workers" if self.services.bus else "memory", "healthy": True}
            ),
        }
        if self.services.bus is not None:
            body["workers"] = {"count": self.services.bus.workers, "this": self.services.bus.worker}
        if self.services.models is not None:
            body["models"] = self.services.models.status()
        if self.services.discovery is not None and self.services.discovery.watchers:  # pools that follow EndpointSlices
            body["discovery"] = {
                w.pool: {
                    "synced": w.synced.is_set(),
                    "endpoints": len(w.endpoints),
                    "errors": w.errors,
                    "last_error": w.last_error or None,
                }
                for w in self.services.discovery.watchers.values()
            }
        return body
