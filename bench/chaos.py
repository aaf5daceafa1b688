"""Engines die under load; does every request still end cleanly, and do answers survive?

A bounded load test on loopback: 2 prefill + 2 decode simulated engines behind the gateway, a
fixed number of chat requests (mixed short/long prompts, streaming and not) at a fixed
concurrency, and halfway through one prefill and one decode engine are killed (``POST
/sim/crash``: the process exits at once, connections cut). Every tenth request asks for JSON
output (``response_format``), which mid-stream migration does not continue. Each request is
classified:

- ``ok``: HTTP 200 and the whole answer: a JSON body, or a stream ending with ``[DONE]`` and no
  error event, with a finish reason and as many tokens as asked for (the usage says);
- ``error``: a clear error: an OpenAI error body, or a stream with an error event (then ``[DONE]``);
- ``unclear``: anything else (a cut stream, a non-JSON body, a short answer): must be 0;
- ``hung``: no end within ``--timeout``: must be 0.

By default the run is done twice with the same seed-free workload: mid-stream migration off
(``routing.migration.enabled: false``: an answer whose decode engine dies ends with the error
event), then on (the default): the report gives both, split into migratable requests and the rest.

Afterwards the gateway's in-flight gauges must read 0, and its resident memory is sampled along
the run (flat: no growth between the second quarter and the end).

``--attacks`` runs hostile clients alongside (bench/attacks.py), for the whole run, reconnecting
whenever the gateway cuts them off: one sending an endless request header, ``--slowloris``
connections trickling a head a byte every half second, ``--stalled`` clients sending a request
head and part of its body, ``--after-answer`` connections each on ``GET /health`` and on an
unauthenticated ``POST`` that send a byte after their answer and stay idle (how long each is held
is reported), a client sending ``chat_template_kwargs`` that pad to ten million tokens, and a
forged KV event feed (a million block hashes a batch, then garbage) in place of one decode
engine's. With attacks the gateway requires an API key (the legitimate clients send theirs), and
``/health`` is probed every 100 ms: its latency bounds the event loop's stalls. The gateway's peak
resident memory (VmHWM) is reported. After the load, a second gateway with two worker processes
is checked for stale configs (bench/stale_config.py).
``--redis`` shares state through a private redis-server, killed three quarters of the way through.
The report adds the legitimate requests' latency (p50/p99 of the ``ok`` ones) and what the
attackers got back.

    python -m bench.chaos [--requests 2000] [--concurrency 64] [--migration both|on|off] [--attacks]
                          [--redis] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import attacks, stale_config
from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.procs import ProcGroup, free_port

MODEL = "chaos"
LONG = "Incident review. " + "An engine failed while the gateway kept serving its clients. " * 40
MAX_TOKENS = 32
KEY = "sk-chaos-legitimate"


@dataclass
class Report:
    requests: int
    concurrency: int
    killed: list[str]
    outcomes: dict[str, int]
    paths: dict[str, int]
    failovers: dict[str, int]
    in_flight_after: int
    rss_mb: list[float] = field(default_factory=list)
    seconds: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # of the ok requests
    attacks: dict[str, Any] = field(default_factory=dict)  # what the attackers got (bench/attacks.py Seen)
    redis_killed: bool = False
    migration: bool = True
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)  # migratable | guided -> outcomes
    migrations: dict[str, int] = field(default_factory=dict)  # the gateway's pdgate_migrations_total by result
    # From the access log: the gap each migration left (failure to the continuation's first token),
    # p50 / p99 / max in ms, and the generated tokens the continuations kept.
    migration_ms: dict[str, float] = field(default_factory=dict)
    migrated_tokens: int = 0
    health_ms: dict[str, float] = field(default_factory=dict)  # /health's latency under attack: p50/p99/max
    rss_peak_mb: float = 0.0  # the gateway's VmHWM at the end

    @property
    def clean(self) -> bool:
        return self.outcomes.get("unclear", 0) == 0 and self.outcomes.get("hung", 0) == 0 and not self.in_flight_after


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _classify(raw: bytes, status: int, stream: bool) -> str:
    """ok (the whole answer), error (a clear one) or unclear; see the module docstring."""
    if status != 200:
        err = json.loads(raw).get("error") if raw.startswith(b"{") else None
        return "error" if isinstance(err, dict) and err.get("message") else "unclear"
    if not stream:
        body = json.loads(raw)
        choice = (body.get("choices") or [{}])[0]
        whole = choice.get("finish_reason") and body.get("usage", {}).get("completion_tokens") == MAX_TOKENS
        return "ok" if whole else "unclear"
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "unclear"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "error"
    finished = [c for e in chunks for c in e.get("choices") or [] if c.get("finish_reason")]
    usage = chunks[-1].get("usage") if chunks else None
    return "ok" if len(finished) == 1 and usage and usage.get("completion_tokens") == MAX_TOKENS else "unclear"


async def _one(session: aiohttp.ClientSession, url: str, i: int, timeout: float) -> tuple[str, str, str]:
    stream = i % 2 == 0
    content = (f"Case {i}. " + LONG) if i % 3 == 0 else f"Short question {i}?"
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if _guided(i):
        body["response_format"] = {"type": "json_object"}
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, json=body) as resp:
                raw = await resp.read()
                path = resp.headers.get("x-pdgate-path") or ("none" if resp.status == 200 else f"refused {resp.status}")
                failover = resp.headers.get("x-pdgate-failover", "")
                return _classify(raw, resp.status, stream), path, failover
    except TimeoutError:
        return "hung", "none", ""
    except (aiohttp.ClientError, json.JSONDecodeError):
        return "unclear", "none", ""


def _guided(i: int) -> bool:
    """Every tenth request asks for JSON output: migration does not continue those."""
    return i % 10 == 5


async def _load(
    gateway: str,
    sims: dict[str, list[str]],
    n: int,
    concurrency: int,
    timeout: float,
    gateway_pid: int,
    attackers: dict[str, int],
    redis: Any = None,
    forged_feed: str = "",
) -> Report:
    url = gateway + "/v1/chat/completions"
    outcomes: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {"migratable": Counter(), "guided": Counter()}
    paths: Counter[str] = Counter()
    failovers: Counter[str] = Counter()
    killed: list[str] = []
    rss: list[float] = []
    latencies: list[float] = []
    seen = attacks.Seen()
    stalls: list[float] = []
    todo = iter(range(n))
    done = 0
    stop = asyncio.Event()
    port = int(gateway.rsplit(":", 1)[1])
    headers = {"Authorization": f"Bearer {KEY}"} if attackers else {}
    hostile = [
        asyncio.create_task(attacks.connection(kind, port, seen, stop, KEY))
        for kind, k in attackers.items()
        if kind in attacks.CONNECTION_KINDS
        for _ in range(k)
    ]
    if attackers.get("template_kwargs"):
        hostile.append(asyncio.create_task(attacks.template_kwargs(gateway, MODEL, headers, seen, stop)))
    if forged_feed:
        hostile.append(asyncio.create_task(attacks.kv_forger(forged_feed, seen, stop)))
    if attackers:
        hostile.append(asyncio.create_task(attacks.health_probe(gateway, stalls, stop)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), headers=headers) as session:

        async def worker() -> None:
            nonlocal done
            for i in todo:
                t0 = time.perf_counter()
                outcome, path, failover = await _one(session, url, i, timeout)
                if outcome == "ok":
                    latencies.append(time.perf_counter() - t0)
                outcomes[outcome] += 1
                by_kind["guided" if _guided(i) else "migratable"][outcome] += 1
                paths[path] += 1
                for event in filter(None, failover.split(",")):
                    failovers[event] += 1
                done += 1
                if done % max(1, n // 8) == 0:
                    rss.append(round(_rss_mb(gateway_pid), 1))
                if done == n // 2 and not killed:
                    for pool in ("prefill", "decode"):
                        victim = sims[pool][0]
                        killed.append(f"{pool} {victim}")
                        with contextlib.suppress(aiohttp.ClientError):  # it may die answering
                            await session.post(victim + "/sim/crash")
                if redis is not None and done == 3 * n // 4 and redis.popen.poll() is None:
                    redis.stop(grace=0)
                    killed.append("redis")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*hostile, return_exceptions=True)
        await asyncio.sleep(0.5)
        async with session.get(gateway + "/metrics") as resp:
            metrics = await resp.text()
    in_flight = sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.splitlines()
        if line.startswith("pdgate_endpoint_in_flight_requests{")
    )
    migrations: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith("pdgate_migrations_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            migrations[result] += int(float(line.rsplit(" ", 1)[1]))
    latencies.sort()
    pct = (
        {f"p{q}": round(latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))] * 1000, 1) for q in (50, 99)}
        if latencies
        else {}
    )
    return Report(
        n,
        concurrency,
        killed,
        dict(outcomes),
        dict(paths),
        dict(failovers),
        in_flight,
        rss,
        round(seconds, 1),
        pct,
        seen.report() if attackers else {},
        redis is not None,
        by_kind={k: dict(v) for k, v in by_kind.items()},
        migrations=dict(migrations),
        health_ms={"p50": _pct(stalls, 50), "p99": _pct(stalls, 99), "max": round(max(stalls), 1)} if stalls else {},
        rss_peak_mb=round(_rss_mb(gateway_pid, "VmHWM"), 1),
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 1)


def _migrations(log: Path) -> tuple[list[float], int]:
    """The migrations the gateway's access log records: their gaps (ms) and the tokens kept."""
    gaps, kept = [], 0
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"migrations"' in line:
            for m in json.loads(line)["migrations"]:
                if m.get("result") == "ok":
                    gaps.append(m["ms"])
                    kept += m["tokens"]
    return gaps, kept


def run(
    n: int,
    concurrency: int,
    timeout: float,
    logs: Path,
    attackers: dict[str, int] | None = None,
    redis: bool = False,
    migration: bool = True,
) -> Report:
    tokenizer = build_tokenizer(cache_dir() / "demo-tokenizer")
    group = ProcGroup(logs)
    try:
        redis_proc, state = None, {}
        if redis:
            redis_port = free_port()
            redis_proc = group.start(
                "redis",
                ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            )
            state = {"state": {"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0"}}
        sims: dict[str, list[str]] = {"prefill": [], "decode": []}
        for pool in ("prefill", "decode"):
            for _ in range(2):
                port, kv = free_port(), free_port()
                proc = group.start(
                    f"{pool}-{port}",
                    [
                        sys.executable,
                        "-m",
                        "sim",
                        "--role",
                        pool,
                        "--port",
                        str(port),
                        "--kv-port",
                        str(kv),
                        "--model",
                        MODEL,
                        "--tokenizer",
                        str(tokenizer),
                        "--max-model-len",
                        "4096",
                        "--decode-time-per-token",
                        "0.002",
                        "--prefill-time-per-token",
                        "0.00001",
                        "--kv-expiry",
                        "5",
                    ],
                )
                proc.wait_http(f"http://127.0.0.1:{port}/health")
                sims[pool].append(f"http://127.0.0.1:{port}")
        port = free_port()
        decode: list[Any] = list(sims["decode"])
        hostile: dict[str, Any] = {}
        forged_feed = ""
        if attackers:  # keys on, and one decode engine's KV event feed is the forger's
            (logs / "keys").write_text(KEY + "\n")
            hostile["auth"] = {"api_keys_file": str(logs / "keys")}
            forged_feed = f"tcp://127.0.0.1:{free_port()}"
            decode[0] = {"url": decode[0], "kv_events": forged_feed}
        cfg = {
            "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 4096}],
            "pools": {"prefill": {"endpoints": sims["prefill"]}, "decode": {"endpoints": decode}},
            "routing": {
                "decider": {"name": "token_threshold", "threshold": 200},
                # the non-streamed half migrates too (its 32 tokens would otherwise go as sent)
                "migration": {"enabled": migration, "non_streaming_min_tokens": 0},
            },
            "health": {"interval_s": 0.5, "timeout_s": 0.5},
            "timeouts": {"connect_s": 1, "prefill_s": 10, "decode_first_byte_s": 10, "decode_idle_s": 5},
            "server": {"host": "127.0.0.1", "port": port, "head_timeout_s": 2, "body_idle_timeout_s": 2, "workers": 1},
            **state,
            **hostile,
        }
        (logs / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gw = group.start("gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(logs / "gateway.yaml")])
        gw.wait_http(f"http://127.0.0.1:{port}/ready", timeout=60)
        report = asyncio.run(
            _load(
                f"http://127.0.0.1:{port}",
                sims,
                n,
                concurrency,
                timeout,
                gw.pid,
                attackers or {},
                redis_proc,
                forged_feed,
            )
        )
        report.migration = migration
        gaps, kept = _migrations(gw.log_path)
        report.migrated_tokens = kept
        if gaps:
            report.migration_ms = {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99), "max": round(max(gaps), 1)}
        return report
    finally:
        group.stop_all()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0, help="a request not over by then counts as hung")
    ap.add_argument(
        "--migration",
        choices=("both", "on", "off"),
        default="both",
        help="mid-stream migration: a run without it, then one with it (both), or one run",
    )
    ap.add_argument("--attacks", action="store_true", help="hostile clients alongside (see above)")
    ap.add_argument("--slowloris", type=int, default=20, help="with --attacks: trickling connections")
    ap.add_argument("--stalled", type=int, default=8, help="with --attacks: clients stalling their bodies")
    ap.add_argument(
        "--after-answer",
        type=int,
        default=20,
        help="with --attacks: connections of each after-answer kind (a byte after the answer, then idle)",
    )
    ap.add_argument("--redis", action="store_true", help="shared state on a private redis-server, killed at 3/4")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    attackers = (
        {
            "endless_header": 1,
            "slowloris": args.slowloris,
            "stalled_body": args.stalled,
            "after_answer": args.after_answer,
            "unauth_after_answer": args.after_answer,
            "template_kwargs": 1,
        }
        if args.attacks
        else {}
    )
    runs = {"both": (False, True), "on": (True,), "off": (False,)}[args.migration]
    reports = []
    for migration in runs:
        with tempfile.TemporaryDirectory(prefix="pdgate-chaos-") as logs:
            report = run(args.requests, args.concurrency, args.timeout, Path(logs), attackers, args.redis, migration)
        reports.append({**asdict(report), "clean": report.clean})
        print(json.dumps(reports[-1], indent=2))
    if args.attacks:  # workers that must not serve an older config than the one last applied
        with tempfile.TemporaryDirectory(prefix="pdgate-chaos-") as logs:
            stale = stale_config.run(Path(logs))
        reports.append({"stale_config": asdict(stale), "clean": stale.clean})
        print(json.dumps(reports[-1], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        names = [f"migration_{'on' if m else 'off'}" for m in runs] + (["stale_config"] if args.attacks else [])
        data = reports[0] if len(reports) == 1 else dict(zip(names, reports, strict=True))
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(r["clean"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
