"""What the HTTP tests of the simulator share: a POST to a running sim, and a stream's SSE events."""

from __future__ import annotations

import json

import httpx


def post(sim, path: str, body: dict, request_id: str | None = None, **kw) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return sim.http.post(sim.url + path, json=body, headers=headers, **kw)


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]
