"""Stale configs in a gateway with worker processes (issue 27, points 2, 3 and 6), measured.

A gateway with two workers in front of a simulated decode engine, its config and keys files edited
while it serves, its workers killed with SIGKILL; every answer is attributed to the worker that
gave it (``GET /ready`` names it, then the request goes on the same connection). Figures:

- ``auth_on_restart``: a reload turns API keys on, then a worker is killed; the restarted worker's
  answers to unauthenticated chats for ``--window`` seconds (before issue 27: all 200, the worker
  started from the config the gateway started with);
- ``auth_on_restart_invalid_file``: the same, the config file made invalid before the kill (before:
  all 200, for good);
- ``key_revoked``: a key removed from the keys file: seconds until every worker refuses it (before:
  never), then after a worker's restart each worker's answers to it (before: the workers
  disagreed);
- ``reload_opening_access``: a reload dropping the auth section unsaid, and one adding a second
  ``auth: {}``: what unauthenticated chats get afterwards (before: 200; now 401, both refused).

``stale_answers`` sums the answers given under an older config than the one last applied: it must
be 0.

    python -m bench.stale_config [--window 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine_model.tinymodel import build_tokenizer
from gateway.demo import cache_dir
from tests.e2e.cluster import Cluster
from tests.procs import ProcGroup, wait_for

KEY, REVOKED = "sk-stale-a", "sk-stale-b"
SHED = {429, 503}  # load shedding: says nothing about auth
APPLIED_WITHIN_S = 30.0


@dataclass
class StaleReport:
    auth_on_restart: dict[str, int] = field(default_factory=dict)  # status -> count, restarted worker, no key
    auth_on_restart_invalid_file: dict[str, int] = field(default_factory=dict)
    key_revoked_s: float | None = None  # until every worker refused the removed key (None: never)
    key_revoked_after_restart: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> status -> n
    reload_opening_access: dict[str, int] = field(default_factory=dict)  # attempt -> status after it
    reloads_missed: int = 0  # reloads turning keys on that a worker had not applied after 30 s under load
    stale_answers: int = 0

    @property
    def clean(self) -> bool:
        return self.stale_answers == 0 and self.reloads_missed == 0


def _ask(port: int, key: str | None) -> tuple[int, int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("GET", "/ready")
        worker = json.loads(conn.getresponse().read()).get("workers", {}).get("this", 0)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", "/v1/chat/completions", body, headers)
        answer = conn.getresponse()
        answer.read()
        return worker, answer.status
    finally:
        conn.close()


def _answers(port: int, key: str | None, seconds: float, threads: int = 2) -> dict[int, Counter[int]]:
    """Each worker's answers (status counts) to chats with ``key`` over ``seconds``, new connections."""
    seen: dict[int, Counter[int]] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def probe() -> None:
        while time.monotonic() < end:
            try:
                worker, status = _ask(port, key)
            except (OSError, http.client.HTTPException, ValueError):
                continue
            if status not in SHED:
                with lock:
                    seen.setdefault(worker, Counter())[status] += 1

    pool = [threading.Thread(target=probe) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return seen


def _all_refuse(port: int, key: str | None) -> bool:
    seen = _answers(port, key, 1.0, threads=1)
    return len(seen) == 2 and all(set(c) == {401} for c in seen.values())


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _worker_pids(gateway_pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(gateway_pid), "-f", "multiprocessing.spawn"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def _kill_a_worker(c: Cluster) -> int:
    """SIGKILL one worker; its index, once the supervisor started it again."""
    assert c.gateway is not None
    log, pid = c.gateway.log_path, c.gateway.pid
    pids = _worker_pids(pid)
    os.kill(pids[0], signal.SIGKILL)
    found: list[int] = []

    def restarted() -> bool:
        match = re.search(rf"worker (\d+) \(pid {pids[0]}\) exited", log.read_text())
        found[:] = [int(match.group(1))] if match else []
        return bool(found) and len(set(_worker_pids(pid)) - set(pids)) == 1

    if not wait_for(restarted, timeout=60):
        raise RuntimeError(f"no worker restarted:\n{c.gateway.log_tail()}")
    return found[0]


def _group(logs: Path) -> ProcGroup:
    logs.mkdir(parents=True, exist_ok=True)
    return ProcGroup(logs)


def _gateway(group: ProcGroup, tokenizer: Path, keys: list[str] | None) -> Cluster:
    c = Cluster(group, tokenizer)
    (group.log_dir / "admin-token").write_text("stale-admin\n")
    extra: dict[str, Any] = {"admin": {"token_file": str(group.log_dir / "admin-token")}, "server": {"workers": 2}}
    if keys is not None:
        (group.log_dir / "keys").write_text("".join(k + "\n" for k in keys))
        extra["auth"] = {"api_keys_file": str(group.log_dir / "keys")}
    c.decode.append(c.start_sim("decode"))
    c.start_gateway(10_000, **extra)
    return c


def _restart_after_auth_on(logs: Path, tokenizer: Path, window: float, invalid: bool) -> tuple[Counter[int], bool]:
    group = _group(logs)
    try:
        c = _gateway(group, tokenizer, None)
        assert c.config_path is not None
        (logs / "keys").write_text(KEY + "\n")
        cfg = copy.deepcopy(c.config)
        cfg["auth"] = {"api_keys_file": str(logs / "keys")}
        _replace(c.config_path, yaml.safe_dump(cfg))
        applied = wait_for(lambda: _all_refuse(c.gateway_port, None), timeout=APPLIED_WITHIN_S)
        if invalid:
            _replace(c.config_path, "models: [oops\n")
            time.sleep(3)  # each worker's watcher reads it (and rejects it)
        worker = _kill_a_worker(c)
        return _answers(c.gateway_port, None, window).get(worker, Counter()), applied
    finally:
        group.stop_all()


def run(logs: Path, window: float = 10.0, tokenizer: Path | None = None) -> StaleReport:
    tokenizer = tokenizer or build_tokenizer(cache_dir() / "demo-tokenizer")
    report = StaleReport()
    for invalid in (False, True):
        got, applied = _restart_after_auth_on(logs / f"auth-{invalid}", tokenizer, window, invalid)
        report.reloads_missed += not applied
        counts = {str(s): n for s, n in sorted(got.items())}
        if invalid:
            report.auth_on_restart_invalid_file = counts
        else:
            report.auth_on_restart = counts
        report.stale_answers += sum(n for s, n in got.items() if s != 401)

    group = _group(logs / "revoked")
    try:
        c = _gateway(group, tokenizer, [KEY, REVOKED])
        keys = group.log_dir / "keys"
        start = time.monotonic()
        _replace(keys, KEY + "\n")
        if wait_for(lambda: _all_refuse(c.gateway_port, REVOKED), timeout=APPLIED_WITHIN_S):
            report.key_revoked_s = round(time.monotonic() - start, 1)
        _replace(keys, f"{KEY}\n{KEY}\n")  # then a keys file that does not load
        time.sleep(3)
        _kill_a_worker(c)
        seen = _answers(c.gateway_port, REVOKED, window)
        report.key_revoked_after_restart = {
            str(w): {str(s): n for s, n in sorted(cs.items())} for w, cs in sorted(seen.items())
        }
        report.stale_answers += sum(n for cs in seen.values() for s, n in cs.items() if s != 401)

        assert c.config_path is not None
        no_auth = copy.deepcopy(c.config)
        del no_auth["auth"]
        for attempt, text in (
            ("auth section dropped", yaml.safe_dump(no_auth)),
            ("second auth: {}", yaml.safe_dump(c.config) + "auth: {}\n"),
        ):
            _replace(c.config_path, text)
            time.sleep(4)  # a settle second and a poll, with room
            seen = _answers(c.gateway_port, None, 1.0, threads=1)
            statuses = Counter(s for cs in seen.values() for s in cs.elements())
            report.reload_opening_access[attempt] = statuses.most_common(1)[0][0] if statuses else 0
            report.stale_answers += sum(n for s, n in statuses.items() if s != 401)
    finally:
        group.stop_all()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=10.0, help="seconds of answers counted after each restart")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdgate-stale-") as logs:
        report = run(Path(logs), args.window)
    out = {**asdict(report), "clean": report.clean}
    print(json.dumps(out, indent=2))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
