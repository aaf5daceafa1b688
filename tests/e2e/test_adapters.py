"""End to end: LoRA adapters on simulated engines that have them as vLLM 0.32 does (sim/README.md,
"LoRA adapters"): adapter slots, loaded adapters listed in /v1/models, runtime loading, per-adapter
prefix caches.

One prefill and two decode engines, one adapter slot each (``--max-loras 1``). ``hot`` is loaded on
d1 and the prefill engine at start; ``cold`` and the rest are on disk only, for the gateway to load.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.procs import ProcGroup
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "adapters-admin"
NAMES = ("hot", "cold", "x1", "x2", "x3")


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    root = tmp_path_factory.mktemp("adapters")
    c.paths = {n: str(root / n) for n in NAMES}
    for path in c.paths.values():
        (root / path).mkdir()
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    lora = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "4", "--enable-prompt-tokens-details"]
    hot = ["--lora-modules", f"hot={c.paths['hot']}"]
    try:
        c.prefill.append(c.start_sim("prefill", *lora, *hot, env=env))
        paced = ["--step-base-time", "0.01"]  # 10 ms a step: a burst is in flight together
        c.decode.append(c.start_sim("decode", *lora, *paced, env=env))
        c.decode.append(c.start_sim("decode", *lora, *hot, *paced, env=env))
        model = {
            "name": c.model,
            "tokenizer": str(tokenizer_dir),
            "max_model_len": 4096,
            "adapters": [{"name": n, "path": c.paths[n]} for n in NAMES],
        }
        c.start_gateway(
            THRESHOLD,
            models=[model],
            admin={"token_file": str(token_file)},
            lora={"dynamic_loading": True, "refresh_s": 0.5, "max_adapters_per_engine": 1, "unload_idle_s": 0.5},
            signals={"scrape_interval_s": 0.3},
        )
        yield c
    finally:
        group.stop_all()


def body(model: str, content: str, max_tokens: int = 2) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def ask(cluster, model: str, content: str) -> httpx.Response:
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body(model, content), timeout=30)
    assert r.status_code == 200, r.text
    return r


def plan(cluster, model: str, content: str) -> dict:
    r = httpx.post(
        cluster.url + "/debug/route", json=body(model, content), headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 200, r.text
    return r.json()


def listed(engine) -> set[str]:
    return {m["id"] for m in httpx.get(engine.url + "/v1/models").json()["data"]}


def loads(cluster, result: str = "ok") -> float:
    return sample(httpx.get(cluster.url + "/metrics").text, "pdgate_adapter_loads_total", result=result)


def test_the_gateway_lists_the_adapters_and_refuses_an_unknown_one(cluster):
    models = {m["id"]: m for m in httpx.get(cluster.url + "/v1/models").json()["data"]}
    assert set(models) == {cluster.model, *NAMES}
    assert (models["hot"]["parent"], models["hot"]["root"]) == (cluster.model, cluster.paths["hot"])
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body("nope", "hi"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_an_adapter_goes_to_the_engine_that_holds_it_without_a_load(cluster):
    _, d1 = cluster.decode
    for i in range(4):
        r = ask(cluster, "hot", f"Short question {i} for the hot adapter.")
        assert (r.headers["x-pdgate-path"], r.json()["model"]) == ("direct", "hot")
        assert plan(cluster, "hot", "another short one")["decode"] == d1.url
    assert loads(cluster) == 0


def test_prefix_beliefs_are_per_adapter_and_the_engine_agrees(cluster):
    prompt = "A long shared document for one adapter. " * 40
    assert ask(cluster, "hot", prompt).headers["x-pdgate-path"] == "pd"
    p = plan(cluster, "hot", prompt)
    held = p["cached_tokens"].get(p["decode"], 0)
    assert held > THRESHOLD and p["path"] == "direct", p
    r = ask(cluster, "hot", prompt)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    assert plan(cluster, cluster.model, prompt)["cached_tokens"] == {}  # the base model's prompt: not cached
    assert plan(cluster, "cold", prompt)["cached_tokens"] == {}  # nor another adapter's


def test_concurrent_requests_for_a_new_adapter_wait_for_one_load_per_engine(cluster):
    before = loads(cluster)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *(client.post(cluster.url + "/v1/chat/completions", json=body("cold", f"Hi {i}.")) for i in range(6))
            )

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 6
    holders = [e for e in cluster.decode if "cold" in listed(e)]
    assert holders and loads(cluster) - before == len(holders)  # one load on each engine chosen
    assert "cold" not in listed(cluster.prefill[0])  # short prompts: direct, the prefill engine was not asked


def test_past_the_bound_the_least_recently_used_loaded_adapter_is_unloaded(cluster):
    """One adapter loaded by the gateway per engine (``max_adapters_per_engine: 1``): three more
    over two engines make at least one engine unload one (an adapter still running is kept, so
    each request is given a scrape's time to be seen done)."""
    for name in ("x1", "x2", "x3"):
        ask(cluster, name, f"Question for {name}.")
        time.sleep(0.7)
    unloads = sample(httpx.get(cluster.url + "/metrics").text, "pdgate_adapter_unloads_total", result="ok")
    assert unloads >= 1
    for e in cluster.decode:
        assert len(listed(e) & {"cold", "x1", "x2", "x3"}) <= 2, listed(e)


def test_a_hot_adapter_spreads_to_another_engine_under_load(cluster):
    """Bounded load: one engine holding the adapter does not take every request for it."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(cluster.url + "/v1/chat/completions", json=body("hot", f"Busy {i}.", max_tokens=64))
                    for i in range(12)
                )
            )

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 12
    assert "hot" in listed(cluster.decode[0])  # loaded where the load spread to
