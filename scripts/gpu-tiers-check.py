"""Check pdgate's KV tier beliefs against real engines: vLLM with LMCache on a GPU machine.

Not run by the test suite (its CPU engines have no GPU tier to offload from: docs/kv-tiers.md).
On a machine with 2 GPUs, vLLM 0.32, LMCache 0.5.x, redis-server and pdgate installed:

    python scripts/gpu-tiers-check.py --model /models/Llama-3.1-8B-Instruct [--out tiers-check.json]

It starts Redis (the L2), two vLLM engines (one GPU each) with LMCacheConnectorV1 (L1 in CPU RAM,
L2 on that Redis), their GPU caches shrunk so a few prompts evict a document, and pdgate in front
with routing.tiers on. Then, per phase, it compares the gateway's belief (``POST /debug/route``'s
``tiers``) with what the engine served (usage's ``cached_tokens``: GPU hits plus LMCache loads),
vLLM's ``vllm:prompt_tokens_cached_by_source`` (LMCache loads count as ``external_unspecified``) and
LMCache's ``lmcache:num_hit_tokens`` (with ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM's /metrics shows
it):

1. the document sent to engine A, then evicted from A's GPU by other prompts: believed in A's L1;
2. engine A stopped: the document on engine B, believed in L2 (written through by A);
3. the gateway's pdgate_tier_{believed,confirmed}_tokens_total per tier at the end.

Every process it starts is stopped at the end, also on failure. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ADMIN = "tiers-check"
DOC = "The quarterly capacity review covers prefill, decode and the KV cache tiers below the GPU. " * 200


def _wait(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"gpu-tiers-check: {url} did not answer in {timeout:.0f} s")


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a local model folder (the engines and the tokenizer)")
    ap.add_argument("--gpu-blocks", type=int, default=512, help="each engine's GPU KV blocks (small: evictions)")
    ap.add_argument("--l1-gb", type=float, default=20.0, help="LMCache max_local_cpu_size per engine")
    ap.add_argument("--out", default=None, help="also write the result here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdgate-tiers-check-"))
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - open for the process's life
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}))

    try:
        start("redis", ["redis-server", "--port", "6390", "--save", "", "--appendonly", "no"])
        lmcache = work / "lmcache.yaml"
        lmcache.write_text(
            yaml.safe_dump(
                {
                    "chunk_size": 256,
                    "local_cpu": True,
                    "max_local_cpu_size": args.l1_gb,
                    "remote_url": "redis://127.0.0.1:6390",
                    "remote_serde": "naive",
                }
            )
        )
        engines = []
        for i in range(2):
            port = 8100 + i
            env = {
                "CUDA_VISIBLE_DEVICES": str(i),
                "LMCACHE_CONFIG_FILE": str(lmcache),
                "LMCACHE_TRACK_USAGE": "false",
                "PYTHONHASHSEED": "0",
                "PROMETHEUS_MULTIPROC_DIR": str(work / f"prom-{i}"),
            }
            (work / f"prom-{i}").mkdir()
            kv = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
            events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{5570 + i}"})
            argv = ["vllm", "serve", args.model, "--port", str(port), "--served-model-name", "m"]
            argv += ["--kv-transfer-config", kv, "--kv-events-config", events, "--enable-prompt-tokens-details"]
            argv += ["--num-gpu-blocks-override", str(args.gpu_blocks), "--max-model-len", "8192"]
            start(f"vllm-{i}", argv, env)
            engines.append(f"http://127.0.0.1:{port}")
        for url in engines:
            _wait(url + "/health", 900)
        block_bytes = 2 * 32 * 8 * 128 * 2 * 16  # Llama-3.1-8B: 2 x layers x KV heads x dim x bf16 x 16 tokens
        cfg = {
            "server": {"host": "127.0.0.1", "port": 8000, "workers": 1},
            "models": [{"name": "m", "tokenizer": args.model, "max_model_len": 8192}],
            "pools": {
                "decode": {
                    "endpoints": [{"url": u, "kv_events": f"tcp://127.0.0.1:{5570 + i}"} for i, u in enumerate(engines)]
                }
            },
            "routing": {
                "decider": {"name": "token_threshold", "threshold": 1024},
                "prefix": {"hash_seed": "0"},
                "tiers": {
                    "enabled": True,
                    "l1_blocks": int(args.l1_gb * 1e9 // block_bytes),
                    "l2_blocks": 10_000_000,
                    "l2_learn": True,
                },
            },
            "admin": {"token_env": "PDGATE_ADMIN_TOKEN"},
            "signals": {"scrape_interval_s": 0.5},
        }
        (work / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        start("gateway", ["pdgate", "serve", "--config", str(work / "gateway.yaml")], {"PDGATE_ADMIN_TOKEN": ADMIN})
        gw = "http://127.0.0.1:8000"
        _wait(gw + "/ready", 120)
        result = {"phases": []}

        def chat(url: str, content: str) -> dict:
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()

        def belief(content: str) -> dict:
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            headers = {"authorization": f"Bearer {ADMIN}"}
            return httpx.post(gw + "/debug/route", json=body, headers=headers, timeout=30).json()

        def phase(name: str, engine: str) -> None:
            planned = belief(DOC)
            served = chat(gw, DOC)["usage"]
            metrics = httpx.get(engine + "/metrics", timeout=10).text
            result["phases"].append(
                {
                    "phase": name,
                    "decision": {k: planned[k] for k in ("path", "reason", "decode", "detail")},
                    "believed": planned["tiers"].get(engine),
                    "served_cached_tokens": (served.get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "prompt_tokens": served["prompt_tokens"],
                    "vllm_cached_by_source_external": _metric(
                        metrics, "vllm:prompt_tokens_cached_by_source", source="external_unspecified"
                    ),
                    "lmcache_num_hit_tokens": _metric(metrics, "lmcache:num_hit_tokens"),
                }
            )

        chat(engines[0], DOC)  # the document on A: GPU, L1 and (written through) L2
        for i in range(12):  # other long prompts evict it from A's GPU
            chat(engines[0], f"Filler {i}. " + DOC[::-1][: 6000 + i])
        phase("evicted from A's GPU: A's L1", engines[0])
        procs[1].send_signal(signal.SIGTERM)  # engine A stops: the document is in L2 only for B
        procs[1].wait(60)
        time.sleep(3)
        phase("A stopped: B loads from L2", engines[1])
        gm = httpx.get(gw + "/metrics", timeout=10).text
        result["gateway"] = {
            tier: {
                "believed": _metric(gm, "pdgate_tier_believed_tokens_total", tier=tier),
                "confirmed": _metric(gm, "pdgate_tier_confirmed_tokens_total", tier=tier),
            }
            for tier in ("gpu", "l1", "l2")
        }
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
