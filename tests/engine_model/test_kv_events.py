"""KV cache events end to end: real sim processes publish over ZMQ, a real SUB socket (and a replay
client) on loopback reads them, and the payloads decode into vLLM 0.32's shapes."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import zmq

from engine_model.kv_events import END_SEQ, KVEventBatch
from gateway.engines.legs import PREFILL_KV_PARAMS
from policies.beliefs.blockhash import HashSpec, block_hashes
from tests.procs import ProcGroup, free_port, wait_for
from tests.promtext import sample

pytestmark = pytest.mark.e2e

SEED = "4242"  # the engines' PYTHONHASHSEED: the NONE_HASH seed
TOPIC = b"kv@sim"
SPEC = HashSpec(block_size=16, seed=SEED)
BLOCK_STORED_KEYS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx",
]  # fmt: skip


@dataclass
class Engine:
    url: str
    kv_port: int
    sub: zmq.Socket  # bound on loopback; the engine's PUB connects to it (vLLM: no '*' = connect)
    replay_endpoint: str
    http: httpx.Client

    def post(self, path: str, body: dict, request_id: str | None = None) -> httpx.Response:
        headers = {"X-Request-Id": request_id} if request_id else {}
        return self.http.post(self.url + path, json=body, headers=headers)

    def metric(self, name: str, **labels: str) -> float:
        return sample(self.http.get(self.url + "/metrics").text, name, **labels)

    def recv(self, timeout: float = 5.0) -> list[tuple[bytes, int, bytes]]:
        """Every message that arrives within ``timeout`` (at least one), then whatever follows
        within 0.3 s."""
        out: list[tuple[bytes, int, bytes]] = []
        wait_ms = int(timeout * 1000)
        while self.sub.poll(wait_ms):
            topic, seq, payload = self.sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), payload))
            wait_ms = 300
        return out

    def drain(self) -> None:
        while self.sub.poll(100):
            self.sub.recv_multipart()


def events_of(messages: list[tuple[bytes, int, bytes]]) -> list[dict]:
    return [e for _, _, payload in messages for e in msgspec.msgpack.decode(payload)[1]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """prefill + decode with KV events on (decode: a small KV cache, for evictions)."""
    group = ProcGroup(tmp_path_factory.mktemp("kv-events-logs"))
    ctx = zmq.Context()
    http = httpx.Client(timeout=30)
    specs = {
        "prefill": "--role prefill --engine-id prefill-ev",
        "decode": "--role decode --engine-id decode-ev --num-gpu-blocks 24 --max-model-len 256 "
        "--enable-prompt-tokens-details",
    }
    out: dict[str, Engine] = {}
    try:
        for name, args in specs.items():
            port, kv_port, pub_port, replay_port = free_port(), free_port(), free_port(), free_port()
            sub = ctx.socket(zmq.SUB)
            sub.bind(f"tcp://127.0.0.1:{pub_port}")
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
            replay = f"tcp://127.0.0.1:{replay_port}"
            events_cfg = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": replay,
                "topic": TOPIC.decode(),
                "buffer_steps": 1000,
            }
            argv = [sys.executable, "-m", "sim", "--port", str(port), "--kv-port", str(kv_port)]
            argv += [*shlex.split(args), "--kv-events-config", json.dumps(events_cfg)]
            proc = group.start(name, argv, env={"PYTHONHASHSEED": SEED, "VLLM_SERVER_DEV_MODE": "1"})
            out[name] = Engine(f"http://127.0.0.1:{port}", kv_port, sub, replay, http)
            out[name].proc = proc  # type: ignore[attr-defined]
        for e in out.values():
            e.proc.wait_http(e.url + "/health", timeout=60)  # type: ignore[attr-defined]
        # PUB/SUB joins late: publish until the subscription is through, then start clean.
        for i, e in enumerate(out.values()):
            deadline = time.monotonic() + 10
            while not e.sub.poll(100):
                assert time.monotonic() < deadline, "no KV events arrived"
                prompt = list(range(90_000 + 100 * i, 90_000 + 100 * i + 20))
                e.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": None})
                e.post("/reset_prefix_cache", {})
            e.drain()
        yield out
    finally:
        http.close()
        group.stop_all()
        for e in out.values():
            e.sub.close(linger=0)
        ctx.term()


def replay_from(e: Engine, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: send the first wanted sequence number (8 bytes big-endian) to the
    ROUTER; each buffered batch from there comes back as (topic, seq, payload), then the end
    marker (b"", -1, b""). A DEALER adds the empty delimiter frame a REQ socket would."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(e.replay_endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def test_block_stored_wire_format_and_hashes(engines):
    d = engines["decode"]
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16
    r = d.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    msgs = d.recv()
    topic, _, payload = msgs[0]
    assert topic == TOPIC
    raw = msgspec.msgpack.decode(payload)
    # EventBatch is array-like: [ts, events, data_parallel_rank]; events are tagged maps.
    assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float) and raw[2] == 0
    assert abs(raw[0] - time.time()) < 60
    [ev] = raw[1]
    assert list(ev) == BLOCK_STORED_KEYS
    assert ev["type"] == "BlockStored" and ev["block_size"] == 16 and ev["medium"] == "GPU"
    assert ev["block_hashes"] == block_hashes(prompt, SPEC)  # the gateway's own hashes
    assert ev["parent_block_hash"] is None and ev["token_ids"] == prompt[:32]
    assert ev["lora_id"] is None and ev["lora_name"] is None and ev["extra_keys"] == [None, None]
    assert ev["group_idx"] == 0
    typed = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
    assert typed.events[0].block_hashes == ev["block_hashes"] and typed.data_parallel_rank == 0

    # The same prompt again: a local hit, visible in the metrics; nothing new to store.
    hits0 = d.metric("vllm:prefix_cache_hits_total")
    r = d.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 32,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }
    assert d.metric("vllm:prefix_cache_hits_total") - hits0 == 32
    assert d.recv(timeout=0.5) == []
    info = [s for s in httpx.get(d.url + "/metrics").text.splitlines() if s.startswith("vllm:cache_config_info{")]
    assert 'enable_prefix_caching="True"' in info[0] and 'block_size="16"' in info[0]


def test_eviction_sequence_numbers_and_replay(engines):
    d = engines["decode"]
    assert d.post("/reset_prefix_cache", {}).json() == {"success": True}
    d.drain()
    # 23 usable blocks; each 96-token prompt fills 6: the fourth prompt evicts the first's tail.
    prompts = [list(range(base, base + 96)) for base in (10_000, 20_000, 30_000, 40_000)]
    for p in prompts:
        assert d.post("/v1/completions", {"prompt": p, "max_tokens": 1}).status_code == 200
    msgs = d.recv()
    seqs = [s for _, s, _ in msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive, one per engine step
    events = events_of(msgs)
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    first = block_hashes(prompts[0], SPEC)
    assert removed and removed == first[::-1][: len(removed)]  # LRU: the oldest prompt, tail first
    shapes = {tuple(e) for e in events if e["type"] == "BlockRemoved"}
    assert shapes == {("type", "block_hashes", "medium", "group_idx")}
    # The engine's state agrees: the first prompt lost exactly those blocks.
    hits0 = d.metric("vllm:prefix_cache_hits_total")
    d.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 1})
    assert d.metric("vllm:prefix_cache_hits_total") - hits0 == 16 * (len(first) - len(removed))
    d.drain()

    # A subscriber that missed messages asks the replay socket for them.
    replayed = replay_from(d, seqs[0])
    assert [s for _, s, _ in replayed][: len(msgs)] == seqs
    assert [p for _, _, p in replayed][: len(msgs)] == [p for _, _, p in msgs]  # byte for byte
    assert all(t == TOPIC for t, _, _ in replayed)
    assert replay_from(d, 10**9) == []


def test_reset_prefix_cache_emits_all_blocks_cleared(engines):
    d = engines["decode"]
    d.drain()
    prompt = list(range(50_000, 50_040))
    d.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    d.drain()
    r = d.post("/reset_prefix_cache", {})
    assert r.status_code == 200 and r.json() == {"success": True}
    [(_, _, payload)] = d.recv()
    assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    hits0 = d.metric("vllm:prefix_cache_hits_total")
    d.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert d.metric("vllm:prefix_cache_hits_total") == hits0  # nothing left to hit


def test_pd_with_caching_and_events_on_both_sides(engines):
    p, d = engines["prefill"], engines["decode"]
    d.post("/reset_prefix_cache", {})
    p.drain()
    d.drain()
    prompt = list(range(60_000, 60_070))  # 70 tokens: 4 full blocks
    body = {"prompt": prompt, "max_tokens": 4}
    leg = {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV_PARAMS}
    kv1 = p.post("/v1/completions", leg, "ev-pd-1").json()["kv_transfer_params"]
    stored_p = [e for e in events_of(p.recv()) if e["type"] == "BlockStored"]
    assert [h for e in stored_p for h in e["block_hashes"]] == block_hashes(prompt, SPEC)
    assert kv1["remote_prefill_cached_tokens"] == 0
    out1 = d.post("/v1/completions", {**body, "kv_transfer_params": kv1}, "ev-pd-1").json()
    assert out1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P had no hit
    # The decode engine caches the pulled blocks and says so.
    stored_d = [e for e in events_of(d.recv()) if e["type"] == "BlockStored"]
    assert [h for e in stored_d for h in e["block_hashes"]][:4] == block_hashes(prompt, SPEC)

    # Round two: P hits its cache, D hits its own and pulls only the last block.
    bytes0 = d.metric("vllm:nixl_bytes_transferred_sum")
    kv2 = p.post("/v1/completions", leg, "ev-pd-2").json()["kv_transfer_params"]
    assert kv2["remote_prefill_cached_tokens"] == 64
    out2 = d.post("/v1/completions", {**body, "kv_transfer_params": kv2}, "ev-pd-2").json()
    assert out2["choices"][0]["text"] == out1["choices"][0]["text"]
    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # reported from P, as vLLM
    assert d.metric("vllm:nixl_bytes_transferred_sum") - bytes0 == 1 * 16 * 512  # one block of 16 x 512 B
    assert wait_for(lambda: p.metric("vllm:kv_cache_usage_perc") == 0)
