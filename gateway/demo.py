"""``pdgate demo``: the whole system on one machine, no GPU: simulated prefill and decode engines
behind a real gateway. Every process it starts is stopped on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from .ports import free_port

MODEL = "demo"
MAX_MODEL_LEN = 32768
# Latencies of the simulated engines: roughly a mid-size model on one GPU, so that streaming is visible.
SIM_TIMING = ["--prefill-time-per-token", "0.00005", "--decode-time-per-token", "0.02",
              "--kv-transfer-time-per-token", "0.000005", "--default-max-tokens", "32"]


def cache_dir() -> Path:
    base = os.environ.get("PDGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdgate"
    )
    return Path(base)


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the demo itself is killed (Linux), so no engine is left behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the simulated engine exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _curls(port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    short = (f"curl -si {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
             f"  -d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
    long_body = (
        "python3 -c 'import json; print(json.dumps({\"model\": \"" + MODEL + "\", \"stream\": True, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"Summarize this. \" + \"The quick brown fox "
        "jumps over the lazy dog. \" * 600}]}))'"
    )
    long = (f"curl -siN {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"  -d \"$({long_body})\"")
    return (f"Short prompt (goes direct to a decode engine):\n  {short}\n\n"
            f"Long prompt, streamed (goes prefill -> decode):\n  {long}\n\n"
            f"The response header x-pdgate-path says which path a request took; "
            f"metrics at {base}/metrics.")


def run_demo(args: argparse.Namespace) -> int:
    from sim.tinymodel import build_tokenizer

    from .app import create_app
    from .config import parse_config
    from .httpserver import make_server
    from .reload import version_of

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    # uvicorn hands a captured SIGTERM back to this handler after its graceful shutdown.
    signal.signal(signal.SIGTERM, _exit)
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    procs: list[subprocess.Popen] = []
    logs = tempfile.mkdtemp(prefix="pdgate-demo-")
    pools: dict[str, list[dict[str, str]]] = {"prefill": [], "decode": []}
    try:
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port, kv_port, events, replay = (free_port() for _ in range(4))
                # Every engine publishes its KV cache events, as vLLM does with --kv-events-config;
                # the gateway follows them for precise prefix routing.
                events_cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                              "replay_endpoint": f"tcp://*:{replay}"}
                argv = [sys.executable, "-m", "sim", "--role", role, "--port", str(port), "--kv-port",
                        str(kv_port), "--model", MODEL, "--tokenizer", str(tokenizer),
                        "--max-model-len", str(MAX_MODEL_LEN), "--kv-events-config", json.dumps(events_cfg),
                        *SIM_TIMING]
                with open(os.path.join(logs, f"{role}-{i}.log"), "wb") as log:
                    procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  preexec_fn=_die_with_parent))
                pools[role].append({"url": f"http://127.0.0.1:{port}", "kv_events": f"tcp://127.0.0.1:{events}",
                                    "kv_events_replay": f"tcp://127.0.0.1:{replay}"})
        for proc, ep in zip(procs, pools["prefill"] + pools["decode"], strict=False):
            _wait_ready(ep["url"] + "/health", proc)
        cfg = parse_config({
            "server": {"host": args.host, "port": args.port},
            "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": MAX_MODEL_LEN}],
            "pools": {"prefill": {"endpoints": pools["prefill"]}, "decode": {"endpoints": pools["decode"]}},
            "routing": {"decider": {"name": "token_threshold", "threshold": args.threshold}},
        }, "demo")
        config_path = os.path.join(logs, "gateway.yaml")
        raw = yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False).encode()
        Path(config_path).write_bytes(raw)
        print(f"pdgate demo: {args.prefill} prefill + {args.decode} decode simulated engines, "
              f"gateway on http://{args.host}:{args.port} (P/D from {args.threshold} uncached prompt tokens)")
        print(f"config: {config_path} (edits apply live)   engine logs: {logs}\n")
        print(_curls(args.port), "\n\nCtrl-C stops everything.\n", flush=True)
        server = make_server(
            cfg, lambda connections: create_app(cfg, config_path=config_path, config_version=version_of(raw),
                                                connections=connections),
            host=args.host, port=args.port, log_level="warning")
        server.run()  # returns on SIGINT/SIGTERM
        return 0 if server.started else 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(procs)
        print("pdgate demo: stopped all engines.", flush=True)
