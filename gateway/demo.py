"""``pdgate demo``: the whole system on one machine, no GPU: simulated prefill and decode engines
behind a real gateway. Every process it starts is stopped on Ctrl-C or SIGTERM, and its temporary
folder (engine logs, generated config, access log) removed unless ``--keep-logs`` is given.

Why a request took its path should be visible without reading the docs: the demo turns on the
``x-pdgate-route`` header (``routing.debug_headers``) and an admin token of its own, generated for
this run and printed, so that ``/debug/route`` and ``/admin/config`` answer (they are off, 404,
without a token)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from gateway.ports import free_port

MODEL = "demo"
MAX_MODEL_LEN = 32768
# Latencies of the simulated engines: roughly a mid-size model on one GPU, so that streaming is visible.
SIM_TIMING = [
    "--prefill-time-per-token",
    "0.00005",
    "--decode-time-per-token",
    "0.02",
    "--kv-transfer-time-per-token",
    "0.000005",
    "--default-max-tokens",
    "32",
]


def cache_dir() -> Path:
    base = os.environ.get("PDGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdgate"
    )
    return Path(base)


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the demo itself is killed (Linux), so no engine is left behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound as uvicorn binds it (SO_REUSEADDR) and held from the
    start, so that a busy port is told before anything starts and no engine can take it meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _port_problem(host: str, port: int, err: OSError) -> str:
    """One line: why the gateway cannot listen, and what to pass instead."""
    if err.errno != errno.EADDRINUSE:
        return f"pdgate demo: cannot listen on {host}:{port} ({err.strerror or err}); choose another port with --port"
    suggestion = ""
    for other in range(port + 1, min(port + 50, 65536)):
        with contextlib.suppress(OSError), _bind(host, other):
            suggestion = f" (e.g. --port {other})"
            break
    return f"pdgate demo: port {port} is already in use on {host}; choose another with --port{suggestion}"


DEMO_WORKERS = 2  # by default: enough to show the gateway as deployed, without a worker per core of a laptop


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the simulated engine exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
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


def _curls(port: int, admin_token: str) -> str:
    base = f"http://127.0.0.1:{port}"
    auth = f"-H 'Authorization: Bearer {admin_token}'"
    hello = f'-d \'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\''
    short = f"curl -si {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n  {hello}"
    long_body = (
        'python3 -c \'import json; print(json.dumps({"model": "' + MODEL + '", "stream": True, '
        '"messages": [{"role": "user", "content": "Summarize this. " + "The quick brown fox '
        "jumps over the lazy dog. \" * 600}]}))'"
    )
    long = f"curl -siN {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n  -d \"$({long_body})\""
    explain = f"curl -s {base}/debug/route {auth} -H 'Content-Type: application/json' \\\n  {hello}"
    return (
        f"Short prompt (goes direct to a decode engine):\n  {short}\n\n"
        f"Long prompt, streamed (goes prefill -> decode; sent again, it goes direct to the engine "
        f"that now holds it):\n  {long}\n\n"
        f"The response header x-pdgate-path says which path a request took, x-pdgate-route why "
        f"(the decider's reason and numbers, the chosen engines); metrics at {base}/metrics.\n\n"
        f"Admin token for this run: {admin_token}\n"
        f"What the gateway would do with a request, without sending it:\n  {explain}\n"
        f"The running config:\n  curl -s {base}/admin/config {auth}"
    )


def run_demo(args: argparse.Namespace) -> int:
    keep_logs = args.keep_logs
    access_to_terminal = args.access_log
    try:  # before anything starts or is printed: a busy port is one line, not a traceback
        listener = _bind(args.host, args.port)
    except OSError as err:
        print(_port_problem(args.host, args.port, err), file=sys.stderr, flush=True)
        return 1

    from engine_model.tinymodel import build_tokenizer
    from gateway.cluster.workers import serve as serve_workers
    from gateway.cluster.workers import worker_count
    from gateway.config import parse_config
    from gateway.config.reload import version_of
    from gateway.http.app import create_app
    from gateway.http.uvicorn_server import make_server
    from gateway.ops.requestlog import LineWriter

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(0)

    # uvicorn hands a captured SIGTERM back to this handler after its graceful shutdown.
    signal.signal(signal.SIGTERM, _exit)
    procs: list[subprocess.Popen[bytes]] = []
    logs = ""
    access_file = None
    access_sink: LineWriter | None = None
    pools: dict[str, list[dict[str, str]]] = {"prefill": [], "decode": []}
    try:
        tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
        logs = tempfile.mkdtemp(prefix="pdgate-demo-")  # mode 0700: the admin token's file is the user's alone
        admin_token = secrets.token_urlsafe(18)
        token_file = os.path.join(logs, "admin-token")
        Path(token_file).write_text(admin_token + "\n")
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(count):
                port, kv_port, events, replay = (free_port() for _ in range(4))
                # Every engine publishes its KV cache events, as vLLM does with --kv-events-config;
                # the gateway follows them for precise prefix routing.
                events_cfg = {
                    "enable_kv_cache_events": True,
                    "endpoint": f"tcp://*:{events}",
                    "replay_endpoint": f"tcp://*:{replay}",
                }
                argv = [
                    sys.executable,
                    "-m",
                    "sim",
                    "--role",
                    role,
                    "--port",
                    str(port),
                    "--kv-port",
                    str(kv_port),
                    "--model",
                    MODEL,
                    "--tokenizer",
                    str(tokenizer),
                    "--max-model-len",
                    str(MAX_MODEL_LEN),
                    "--kv-events-config",
                    json.dumps(events_cfg),
                    *SIM_TIMING,
                ]
                with open(os.path.join(logs, f"{role}-{i}.log"), "wb") as log:
                    procs.append(
                        subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
                    )
                pools[role].append(
                    {
                        "url": f"http://127.0.0.1:{port}",
                        "kv_events": f"tcp://127.0.0.1:{events}",
                        "kv_events_replay": f"tcp://127.0.0.1:{replay}",
                    }
                )
        for proc, ep in zip(procs, pools["prefill"] + pools["decode"], strict=False):
            _wait_ready(ep["url"] + "/health", proc)
        cfg = parse_config(
            {
                "server": {"host": args.host, "port": args.port},
                "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": MAX_MODEL_LEN}],
                "pools": {"prefill": {"endpoints": pools["prefill"]}, "decode": {"endpoints": pools["decode"]}},
                "routing": {
                    "decider": {"name": "token_threshold", "threshold": args.threshold},
                    "debug_headers": True,
                },  # x-pdgate-route: why each request took its path
                "admin": {"token_file": token_file},
            },
            "demo",
        )
        config_path = os.path.join(logs, "gateway.yaml")
        raw = yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False).encode()
        Path(config_path).write_bytes(raw)
        access_path = os.path.join(logs, "access.log")
        if not access_to_terminal:  # one JSON line per request would flood the terminal under load
            access_file = open(access_path, "ab")  # noqa: SIM115 - closed in finally
            access_sink = LineWriter(access_file)
        kept = "kept after exit" if keep_logs else "removed on exit; --keep-logs keeps them"
        print(
            f"pdgate demo: {args.prefill} prefill + {args.decode} decode simulated engines, "
            f"gateway on http://{args.host}:{args.port} (P/D from {args.threshold} uncached prompt tokens)"
        )
        print(f"config: {config_path} (edits apply live)   engine logs: {logs} ({kept})")
        print(
            "access log (one JSON line per request): "
            + ("this terminal" if access_to_terminal else f"{access_path} (--access-log prints it here instead)")
        )
        print(f"tokenizer: {tokenizer} (model {MODEL!r}; give this folder to load tools as their tokenizer)\n")
        print(_curls(args.port, admin_token), "\n\nCtrl-C stops everything.\n", flush=True)
        workers = args.workers or min(DEMO_WORKERS, worker_count(cfg))
        if workers > 1:  # the gateway as it is deployed: one process per core on one socket
            print(f"gateway: {workers} worker processes\n", flush=True)
            return serve_workers(
                cfg,
                config_path,
                raw.decode(),
                args.host,
                args.port,
                workers,
                sock=listener,
                access_log_path=None if access_to_terminal else access_path,
            )
        server = make_server(
            cfg,
            lambda connections: create_app(
                cfg,
                config_path=config_path,
                config_version=version_of(raw),
                access_sink=access_sink,
                connections=connections,
            ),
            host=args.host,
            port=args.port,
            log_level="warning",
        )
        server.run(sockets=[listener])  # returns on SIGINT/SIGTERM
        return 0 if server.started else 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(procs)
        listener.close()
        if access_sink is not None:
            access_sink.close()
        if access_file is not None:
            access_file.close()
        if logs and not keep_logs:
            shutil.rmtree(logs, ignore_errors=True)
        where = f"; logs kept in {logs}" if logs and keep_logs else ""
        print(f"pdgate demo: stopped all engines{where}.", flush=True)
