"""LoRA adapters (engine_model.adapters, sim.lora_routes) as vLLM 0.32 serves them: flags, the
models list, unknown names, runtime load/unload, per-adapter prefix caches and KV events, the
max_loras cap, the adapter cache's load time, vllm:lora_requests_info and P/D legs.

In-process (httpx's ASGI transport; P/D pairs talk over the real TCP side channel), with adapter
folders made in tmp_path (no weights: the simulator needs only the folder, and reads
adapter_config.json's rank when there is one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_model.adapters import LoRAModule, LoRARequest, parse_lora_module
from engine_model.config import SimConfig
from engine_model.kv_events import BlockStored
from policies.beliefs.blockhash import HashSpec, block_hashes
from sim.app import create_app
from sim.cli import build_parser, config_from_args
from sim.state import SimState
from tests.engine_model.helpers import make_seq, run
from tests.sim.conftest import metric
from tests.waiting import until

PROMPT = "LoRA adapters change the weights, so they change the KV cache of every block too. " * 2
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}


def adapter(tmp_path: Path, name: str, rank: int | None = None) -> str:
    folder = tmp_path / name
    folder.mkdir()
    if rank is not None:
        (folder / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]})
        )
    return str(folder)


@contextlib.asynccontextmanager
async def client(**kw):
    app = create_app(SimConfig(**kw))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
            c.sim = app.state.sim
            yield c


def lora_kw(tmp_path: Path, *names: str, **kw) -> dict:
    mods = [LoRAModule(n, adapter(tmp_path, n)) for n in names]
    return {"model": "base", "enable_lora": True, "lora_modules": mods, "enable_prompt_tokens_details": True, **kw}


async def complete(c: httpx.AsyncClient, model: str | None, **body) -> httpx.Response:
    payload = {"prompt": PROMPT, "max_tokens": 3, **body}
    if model is not None:
        payload["model"] = model
    return await c.post("/v1/completions", json=payload)


def lora_info(text: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:lora_requests_info"]


# ---------------------------------------------------------------------- flags


def parse(argv: list[str]) -> SimConfig:
    return config_from_args(build_parser().parse_args(argv), argv)


def test_flags_parse_like_vllm(tmp_path, monkeypatch):
    a, b = adapter(tmp_path, "a"), adapter(tmp_path, "b", rank=8)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    cfg = parse(["--enable-lora", "--max-loras", "2", "--lora-modules", f"a={a}",
                 json.dumps({"name": "b", "path": b, "base_model_name": "sim"})])  # fmt: skip
    assert cfg.lora_modules == [LoRAModule("a", a), LoRAModule("b", b, "sim")]
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank, cfg.lora_load_time) == (2, 2, 16, 0.05)
    assert not cfg.allow_runtime_lora_updating and not cfg.instant
    for value, on in (("1", True), ("true", True), ("TRUE", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert parse([]).allow_runtime_lora_updating is on
    assert parse(["--max-loras", "2", "--max-cpu-loras", "5"]).max_cpu_loras == 5
    assert parse_lora_module("x=/p=q") == LoRAModule("x", "/p=q")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-loras", "3", "--max-cpu-loras", "2"], "max_cpu_loras (2) must be >= max_loras (3)."),
        (["--max-loras", "0"], "max_loras must be at least 1"),
        (["--lora-modules", "a=/tmp"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "{bad"], "Invalid JSON format for --lora-modules: {bad"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "pth": "/x"}'], "Invalid fields for --lora-modules"),
        (["--enable-lora", "--lora-modules", "a=/no/such/dir"],
         "Loading lora a failed: No adapter found for /no/such/dir"),
        (["--enable-lora", "--lora-modules", "sim=/tmp"], "conflicts with a served base model"),
        (["--enable-lora", "--lora-modules", "a=/tmp", "a=/tmp"], "is given twice"),
    ],
)  # fmt: skip
def test_bad_lora_flags_are_refused(argv, message):
    with pytest.raises(ValueError) as e:
        parse(argv)
    assert message in str(e.value)


def test_rank_above_max_lora_rank_is_refused_at_start(tmp_path):
    big = adapter(tmp_path, "big", rank=32)
    with pytest.raises(ValueError) as e:
        parse(["--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"big={big}"])
    assert "LoRA rank 32 is greater than max_lora_rank 16." in str(e.value)
    assert parse(["--enable-lora", "--max-lora-rank", "32", "--lora-modules", f"big={big}"]).lora_modules
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-lora-rank", "7"])  # vLLM's Literal: 1, 8, 16, ..., 512


# ---------------------------------------------------------------------- models and names


async def test_models_list_adapters_after_the_base_card(tmp_path):
    mods = [LoRAModule("adpA", adapter(tmp_path, "adpA")), LoRAModule("adpJ", str(tmp_path / "adpA"), "base"),
            LoRAModule("adpX", adapter(tmp_path, "adpX"), "not-served")]  # fmt: skip
    async with client(model="base", enable_lora=True, lora_modules=mods, max_cpu_loras=3) as c:
        base, a, j, x = (await c.get("/v1/models")).json()["data"]
        assert base["id"] == "base" and base["parent"] is None and base["max_model_len"] == 8192
        assert a == {**a, "id": "adpA", "object": "model", "owned_by": "vllm", "root": mods[0].path,
                     "parent": "base", "max_model_len": None}  # fmt: skip
        assert set(a) == set(base) and a["permission"][0]["object"] == "model_permission"
        assert (j["root"], j["parent"]) == (mods[0].path, "base")
        assert x["parent"] == "base"  # a base_model_name that is not served is dropped (vLLM)
        lora = (await c.get("/sim/state")).json()["lora"]
        assert lora["adapters"] == {"adpA": {"id": 1, "path": mods[0].path}, "adpJ": {"id": 2, "path": mods[0].path},
                                    "adpX": {"id": 3, "path": mods[2].path}}  # fmt: skip
        assert [m["id"] for m in lora["loaded"]] == [1, 2, 3] and lora["max_loras"] == 1


async def test_a_request_names_its_adapter_and_unknown_names_are_vllms_404(tmp_path):
    async with client(**lora_kw(tmp_path, "adpA")) as c:
        for model in ("adpA", "base", None):
            r = await complete(c, model)
            assert r.status_code == 200 and r.json()["model"] == (model or "base")
        r = await c.post("/v1/chat/completions", json={"model": "adpA", "messages": [{"role": "user", "content": "hi"}],
                                                       "stream": True, "max_tokens": 2})  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert chunks and all(ch["model"] == "adpA" for ch in chunks)
        base_text = (await complete(c, "base")).json()["choices"][0]["text"]
        assert (await complete(c, "adpA")).json()["choices"][0]["text"] != base_text  # other weights
        r = await complete(c, "nope")
        assert r.status_code == 404 and r.json() == {"error": {
            "message": "The model `nope` does not exist. Valid aliases: base.", "type": "NotFoundError",
            "param": "model", "code": 404}}  # fmt: skip
        r = await c.post("/v1/completions/render", json={"model": "adpA", "prompt": "x"})
        assert r.status_code == 200 and r.json()[0]["model"] == "adpA"
    async with client(model="base") as c:  # no --enable-lora: an adapter name is an unknown model
        r = await complete(c, "adpA")
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("The model `adpA` does not exist.")
        assert "vllm:lora_requests_info" not in (await c.get("/metrics")).text


# ---------------------------------------------------------------------- runtime loading


async def test_load_and_unload_routes_need_the_env_var(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    async with client(**parse(["--enable-lora"]).__dict__) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 404


async def test_runtime_load_and_unload_answer_like_vllm(tmp_path):
    a, b, big = adapter(tmp_path, "a", rank=16), adapter(tmp_path, "b"), adapter(tmp_path, "big", rank=64)
    async with client(model="base", enable_lora=True, allow_runtime_lora_updating=True, max_cpu_loras=4,
                      lora_load_time=0.0) as c:  # fmt: skip
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "adpA", "lora_path": a})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'adpA' added successfully."
        assert "content-type" not in r.headers  # vLLM: Response(content=str), no media type
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["base", "adpA"]
        assert (await complete(c, "adpA")).status_code == 200

        async def load(body: dict, status: int, err_type: str, message: str) -> None:
            r = await c.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == status, r.text
            assert r.json()["error"] == {"message": message, "type": err_type, "param": None, "code": status}

        await load({"lora_name": "adpA", "lora_path": b}, 400, "InvalidUserInput",
                   "The lora adapter 'adpA' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.")  # fmt: skip
        await load({"lora_name": "base", "lora_path": b}, 400, "InvalidUserInput",
                   "The lora adapter 'base' conflicts with a served base model.")  # fmt: skip
        await load({"lora_name": "", "lora_path": b}, 400, "InvalidUserInput",
                   "Both 'lora_name' and 'lora_path' must be provided.")  # fmt: skip
        await load({"lora_name": "ghost", "lora_path": "/tmp/lora-nothere"}, 404, "NotFoundError",
                   "Loading lora ghost failed: No adapter found for <path>")  # fmt: skip
        await load({"lora_name": "big", "lora_path": big}, 500, "InternalServerError",
                   "Call to add_lora method failed: Worker failed with error 'LoRA rank 64 is greater than "
                   "max_lora_rank 16.', please check the stack trace above for the root cause")  # fmt: skip
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
        assert r.json()["error"]["param"] == "body.lora_path"
        r = await c.post("/v1/load_lora_adapter", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"]
        # The failed loads used ids up (vLLM's counter is bumped before the engine's add_lora).
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "adpB", "lora_path": b})
        assert r.status_code == 200
        assert (await c.get("/sim/state")).json()["lora"]["adapters"]["adpB"]["id"] == 4
        # In place: same name and id, a new path (new hashes), the adapter loaded again.
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "adpA", "lora_path": b, "load_inplace": True})
        assert r.status_code == 200
        lora = (await c.get("/sim/state")).json()["lora"]
        assert lora["adapters"]["adpA"] == {"id": 1, "path": b}

        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "adpB"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'adpB' removed successfully."
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "adpB", "lora_int_id": 4})
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "The lora adapter 'adpB' cannot be found.", "type": "NotFoundError", "param": None,
            "code": 404}  # fmt: skip
        assert (await complete(c, "adpB")).status_code == 404
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["base", "adpA"]
        # Unloading only forgets the name: the engine keeps it loaded (vLLM never calls remove_lora).
        assert 4 in [m["id"] for m in (await c.get("/sim/state")).json()["lora"]["loaded"]]


async def test_a_runtime_load_without_enable_lora_fails_in_the_engine():
    async with client(model="base", allow_runtime_lora_updating=True) as c:
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})
        assert r.status_code == 500 and r.json()["error"]["message"] == (
            "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use --enable-lora "
            "to enable LoRA.', please check the stack trace above for the root cause"
        )
        assert (await c.get("/sim/state")).json()["lora"] is None


# ---------------------------------------------------------------------- prefix cache and KV events


async def test_each_adapter_has_its_own_prefix_cache(tmp_path):
    async with client(**lora_kw(tmp_path, "adpA", "adpB", max_cpu_loras=2)) as c:

        async def cached(model: str) -> int:
            r = await complete(c, model)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached("adpA") == 0
        assert await cached("adpA") > 0  # the same prompt under the same adapter hits
        assert await cached("adpB") == 0  # another adapter never does
        assert await cached("base") == 0  # nor does the base model
        assert await cached("base") > 0 and await cached("adpB") > 0


@contextlib.asynccontextmanager
async def engine(tmp_path: Path, *names: str, **kw):
    """A started engine whose KV events go to a list (``st.events``)."""
    events: list = []

    class Sink:
        def publish(self, batch: list) -> None:
            events.extend(batch)

    state = SimState(SimConfig(**lora_kw(tmp_path, *names, **kw)), event_sink=Sink())
    await state.start()
    state.events = events  # type: ignore[attr-defined]
    try:
        yield state
    finally:
        await state.stop()


async def test_block_stored_events_carry_the_adapter_and_its_hashes(tmp_path):
    async with engine(tmp_path, "adpA", "adpJ", block_size=4, num_gpu_blocks=65, max_model_len=128,
                      max_cpu_loras=2) as st:  # fmt: skip
        prompt = list(range(100, 118))  # 4 full blocks
        a, j = st.loras.requests["adpA"], st.loras.requests["adpJ"]
        spec = HashSpec(block_size=4)
        for i, lora in enumerate((a, j, None)):
            st.events.clear()
            await run(st, make_seq(f"r{i}", prompt, 1, lora=lora))
            [ev] = [e for e in st.events if isinstance(e, BlockStored)]
            pair = (lora.name, lora.path) if lora else None
            assert ev.block_hashes == block_hashes(prompt, spec, lora=pair)
            assert (ev.lora_id, ev.lora_name) == ((lora.int_id, lora.name) if lora else (None, None))
            assert ev.extra_keys == [(lora.name,) if lora else None] * 4  # untagged, no path (vLLM)
        assert (a.int_id, j.int_id) == (1, 2)
        assert block_hashes(prompt, spec, lora=("adpA", a.path)) != block_hashes(prompt, spec, lora=("adpA", ""))


# ---------------------------------------------------------------------- scheduling


async def test_max_loras_skips_a_request_for_another_adapter_until_a_slot_frees(tmp_path):
    kw = {"max_loras": 1, "max_cpu_loras": 3, "lora_load_time": 0.0, "decode_time_per_token": 0.01}
    async with engine(tmp_path, "adpA", "adpB", **kw) as st:
        e = st.engine
        a, b = st.loras.requests["adpA"], st.loras.requests["adpB"]
        first = make_seq("a1", list(range(40)), 50, lora=a)
        other = make_seq("b1", list(range(50, 90)), 2, lora=b)
        same = make_seq("a2", list(range(100, 140)), 2, lora=a)
        base = make_seq("x1", list(range(200, 240)), 2)
        e.submit(first)
        await until(lambda: first.first_token_t is not None, timeout=5)
        for seq in (other, same, base):
            e.submit(seq)
        await until(lambda: same.first_token_t is not None and base.first_token_t is not None, timeout=5)
        assert other.scheduled_t is None and list(e.waiting) == [other]  # skipped, kept, not rejected
        e.update_gauges()
        assert st.metrics.waiting_deferred._value.get() == 1 and st.metrics.waiting_capacity._value.get() == 0
        for seq in (first, same, base, other):
            await asyncio.wait_for(seq.collector.done, 5)
        assert other.scheduled_t >= max(first.finished_t, same.finished_t)
        assert all(s.finish_reason == "length" for s in (first, same, base, other))
        assert not e.lora_deferred and e.lora_snapshot()["in_flight"] == {}


async def test_loading_an_adapter_not_in_the_cache_costs_the_load_time(tmp_path):
    kw = {"max_loras": 1, "max_cpu_loras": 1, "lora_load_time": 0.3}
    async with engine(tmp_path, "adpA", "adpB", **kw) as st:  # adpB loaded last: adpA was evicted
        a, b = st.loras.requests["adpA"], st.loras.requests["adpB"]
        assert [m["name"] for m in st.engine.lora_snapshot()["loaded"]] == ["adpB"]

        async def ttft(rid: str, lora: LoRARequest | None) -> float:
            seq = await run(st, make_seq(rid, list(range(30)), 1, lora=lora))
            return seq.first_token_t - seq.arrival

        assert await ttft("b", b) < 0.2  # loaded: no cost
        assert await ttft("a", a) >= 0.3  # not loaded: loaded in its first step, evicting adpB
        assert await ttft("a2", a) < 0.2
        assert await ttft("x", None) < 0.2  # the base model needs no adapter
        assert await ttft("b2", b) >= 0.3
        snap = st.engine.lora_snapshot()
        assert (snap["loads"], snap["evictions"]) == (4, 3)  # 2 at start-up, then adpA, adpB again


# ---------------------------------------------------------------------- metrics


async def test_lora_requests_info_is_vllms_gauge(tmp_path):
    async with client(**lora_kw(tmp_path, "adpA", "adpB", max_loras=2, lora_load_time=0.0,
                                decode_time_per_token=0.01)) as c:  # fmt: skip
        assert lora_info((await c.get("/metrics")).text) == []  # no step yet
        task = asyncio.create_task(complete(c, "adpB", max_tokens=60))
        await asyncio.sleep(0.05)
        task2 = asyncio.create_task(complete(c, "adpA", max_tokens=40))

        async def both() -> bool:
            return any(
                s.labels["running_lora_adapters"] == "adpB,adpA" for s in lora_info((await c.get("/metrics")).text)
            )

        await until(both, timeout=5)
        await task
        await task2
        await complete(c, "base")
        samples = lora_info((await c.get("/metrics")).text)
        for s in samples:
            assert set(s.labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
            assert s.labels["max_lora"] == "2"
            assert s.labels["waiting_lora_adapters"] == s.labels["running_lora_adapters"]
        by_label = {s.labels["running_lora_adapters"]: s.value for s in samples}
        assert {"adpB", "adpB,adpA", ""} <= set(by_label)  # old series are kept
        assert max(by_label, key=by_label.get) == ""  # the latest one: nothing in flight
        assert by_label[""] > 1.7e9  # a Unix timestamp
        text = (await c.get("/metrics")).text
        assert metric(text, "vllm:num_requests_running") == 0  # the other metrics are unchanged


# ---------------------------------------------------------------------- P/D


async def test_pd_legs_with_the_same_adapter_give_the_single_engine_answer(tmp_path):
    path = adapter(tmp_path, "adpA")
    kw = {"model": "base", "enable_lora": True, "lora_modules": [LoRAModule("adpA", path)], "lora_load_time": 0.0}
    async with (
        client(role="prefill", engine_id="P", **kw) as p,
        client(role="decode", **kw) as d,
        client(**kw) as ref,
    ):
        body = {"prompt": PROMPT, "max_tokens": 5}
        expected = (await complete(ref, "adpA", **body)).json()["choices"][0]["text"]
        base = (await complete(ref, "base", **body)).json()["choices"][0]["text"]
        assert expected != base
        r = await complete(p, "adpA", **{**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
        kv = r.json()["kv_transfer_params"]
        r = await complete(d, "adpA", **{**body, "kv_transfer_params": kv})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected and r.json()["model"] == "adpA"
        # A mismatch is silent, as in vLLM: the decode leg runs on KV computed with other weights.
        r = await complete(p, "adpA", **{**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
        r = await complete(d, "base", **{**body, "kv_transfer_params": r.json()["kv_transfer_params"]})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] not in (expected, base)
