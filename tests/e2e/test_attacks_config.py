"""Workers that forgot reloads, a keys file nobody watched, configs that quietly turned auth off
(issue 27, points 2, 3 and 6): the real gateway (a supervisor and two workers) in front of a
simulated engine, its config and keys files edited as an operator (or an attacker with a foot in
the door) would, its workers killed with SIGKILL.

- A worker restarted after a reload used to start from the config text the gateway started with:
  after a reload that turned API keys on, it served unauthenticated requests until its own watcher
  caught up, and forever once the file on disk was invalid. Now the supervisor hands it the config
  the workers applied last (its keys file's content included), before it serves anything.
- A key removed from the keys file used to change nothing until a restart, after which the workers
  disagreed. Now the keys file is part of the config: every worker applies the edit, and a worker
  restarted after it agrees with the others, whatever the file on disk holds by then.
- A reload that drops the auth section, or a second ``auth:`` key, used to open the gateway. Now
  the first is refused unless the new config says ``auth.disabled: true`` (then logged at ERROR),
  and a key given twice is refused.

Which worker answers is learned per connection (``GET /ready`` names it, then the request goes on
the same connection), so every answer of the restarted worker is seen, its first ones included.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.procs import ProcGroup, wait_for

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY, REVOKED = "sk-config-a", "sk-config-b"
TOKEN = "config-admin-token"
APPLIED_WITHIN_S = 20.0  # a reload's settle second and poll, on a loaded machine, with room to spare
# Answers that say nothing about auth: load shedding (a worker's event loop runs late while it
# starts, on a busy machine). Every other answer counts.
SHED = {429, 503}


@pytest.fixture
def make_cluster(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)

    def start(workers: int = 2, keys: list[str] | None = None) -> Cluster:
        c = Cluster(group, tokenizer_dir)
        (tmp_path / "admin-token").write_text(TOKEN)
        overrides: dict = {"admin": {"token_file": str(tmp_path / "admin-token")}, "server": {"workers": workers}}
        if keys is not None:
            (tmp_path / "keys").write_text("".join(k + "\n" for k in keys))
            overrides["auth"] = {"api_keys_file": str(tmp_path / "keys")}
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(10_000, **overrides)
        return c

    try:
        yield start
    finally:
        group.stop_all()


def ask(cluster: Cluster, key: str | None) -> tuple[int, int]:
    """(the worker that answered, the status of a chat with ``key``), on one new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.gateway_port, timeout=15)
    try:
        conn.request("GET", "/ready")
        ready = conn.getresponse()
        worker = json.loads(ready.read()).get("workers", {}).get("this", 0)  # (one worker: not said)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", "/v1/chat/completions", body, headers)  # the same connection: the same worker
        answer = conn.getresponse()
        answer.read()
        return worker, answer.status
    finally:
        conn.close()


def status(cluster: Cluster, key: str | None) -> int:
    """The status of a chat with ``key`` (asked again while the gateway sheds load)."""
    for _ in range(50):
        _, got = ask(cluster, key)
        if got not in SHED:
            return got
        time.sleep(0.2)
    return got


def every_worker_answers(cluster: Cluster, key: str | None, status: int, workers: int = 2) -> bool:
    """``key`` gets ``status`` from every worker (fresh connections until each answered twice; up
    to 30 s, as a worker still loading its tokenizer on a busy machine accepts none yet)."""
    seen: dict[int, list[int]] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        worker, got = ask(cluster, key)
        if got in SHED:
            continue
        seen.setdefault(worker, []).append(got)
        if len(seen) == workers and all(len(s) >= 2 for s in seen.values()):
            break
    return len(seen) == workers and all(s == status for answers in seen.values() for s in answers)


def replace(path: Path, text: str) -> None:
    """An atomic edit (a new file renamed over the old), as editors and ConfigMaps make them."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def worker_pids(cluster: Cluster) -> list[int]:
    assert cluster.gateway is not None
    out = subprocess.run(
        ["pgrep", "-P", str(cluster.gateway.popen.pid), "-f", "multiprocessing.spawn"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def kill_a_worker(cluster: Cluster) -> tuple[int, int]:
    """SIGKILL a worker; (its index, the new worker's PID) once the supervisor started it again."""
    assert cluster.gateway is not None
    pids = worker_pids(cluster)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    found: list[int] = []

    def restarted() -> bool:
        match = re.search(rf"worker (\d+) \(pid {pids[0]}\) exited", cluster.gateway.log_path.read_text())
        found[:] = [int(match.group(1))] if match else []
        return bool(found) and len(set(worker_pids(cluster)) - set(pids)) == 1

    assert wait_for(restarted, timeout=30), cluster.gateway.log_tail()
    (new_pid,) = set(worker_pids(cluster)) - set(pids)
    return found[0], new_pid


def answers_of(cluster: Cluster, worker: int, key: str | None, count: int = 8, timeout: float = 60) -> list[int]:
    """The statuses of the first ``count`` chats with ``key`` that ``worker`` answers, asked from
    two threads on new connections from now on (refused connections while it starts are skipped)."""
    got: list[int] = []
    others: list[int] = []
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def probe() -> None:
        while time.monotonic() < deadline:
            with lock:
                if len(got) >= count:
                    return
            try:
                who, status = ask(cluster, key)
            except (OSError, http.client.HTTPException, ValueError):
                continue  # the killed worker's half-accepted connections
            with lock:
                if status not in SHED:
                    (got if who == worker else others).append(status)

    threads = [threading.Thread(target=probe) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) >= count, f"worker {worker} answered {len(got)} times in {timeout} s (others: {len(others)})"
    return got


def reload_to(cluster: Cluster, cfg: dict) -> None:
    assert cluster.config_path is not None
    replace(cluster.config_path, yaml.safe_dump(cfg, sort_keys=False))


def reload_errors(cluster: Cluster, workers: int = 2) -> dict[int, str | None]:
    """Each worker's last rejected reload (/admin/config), on fresh connections until each answered.
    (The log says a rejection once for the gateway, not once per worker.)"""
    seen: dict[int, str | None] = {}
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", cluster.gateway_port, timeout=15)
        try:
            conn.request("GET", "/ready")
            worker = json.loads(conn.getresponse().read()).get("workers", {}).get("this", 0)
            conn.request("GET", "/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
            answer = conn.getresponse()
            if answer.status == 200:
                seen[worker] = json.loads(answer.read())["last_reload_error"]
        except (OSError, http.client.HTTPException, ValueError):
            continue  # a worker that is starting
        finally:
            conn.close()
        if len(seen) == workers:
            break
    return seen


def every_worker_rejected(cluster: Cluster, what: str) -> bool:
    errors = reload_errors(cluster)
    return len(errors) == 2 and all(e is not None and what in e for e in errors.values())


def log_count(cluster: Cluster, text: str) -> int:
    assert cluster.gateway is not None
    return cluster.gateway.log_path.read_text().count(text)


@pytest.mark.parametrize("then_broken", [False, True], ids=["file-valid", "file-then-invalid"])
def test_a_restarted_worker_keeps_the_auth_a_reload_turned_on(make_cluster, tmp_path, then_broken):
    cluster = make_cluster(workers=2)  # API keys off at start
    assert every_worker_answers(cluster, None, 200)
    (tmp_path / "keys").write_text(KEY + "\n")
    cfg = copy.deepcopy(cluster.config)
    cfg["auth"] = {"api_keys_file": str(tmp_path / "keys")}
    reload_to(cluster, cfg)
    assert wait_for(lambda: every_worker_answers(cluster, None, 401), timeout=APPLIED_WITHIN_S)
    if then_broken:  # the file on disk now says nothing usable: the workers keep the last valid config
        assert cluster.config_path is not None
        replace(cluster.config_path, "models: [oops\n")
        assert wait_for(lambda: every_worker_rejected(cluster, ""), timeout=APPLIED_WITHIN_S)
        assert log_count(cluster, "config reload rejected") == 1  # said once for the gateway
    worker, pid = kill_a_worker(cluster)
    first = answers_of(cluster, worker, None)
    assert first == [401] * len(first), f"worker {worker} (pid {pid}) answered without a key: {first}"
    assert worker_pids(cluster).count(pid) == 1  # the same restarted process answered
    if then_broken:  # its own watcher reads the invalid file, rejects it, and it still asks for keys
        assert wait_for(lambda: reload_errors(cluster).get(worker) is not None, timeout=APPLIED_WITHIN_S)
        assert set(answers_of(cluster, worker, None, count=4)) == {401}
    assert every_worker_answers(cluster, KEY, 200)


def test_a_key_removed_from_the_keys_file_is_refused_by_every_worker_and_after_a_restart(make_cluster, tmp_path):
    cluster = make_cluster(workers=2, keys=[KEY, REVOKED])
    assert every_worker_answers(cluster, REVOKED, 200)
    keys = tmp_path / "keys"
    replace(keys, KEY + "\n")  # the config file is untouched
    assert wait_for(lambda: every_worker_answers(cluster, REVOKED, 401), timeout=APPLIED_WITHIN_S)
    assert every_worker_answers(cluster, KEY, 200)
    replace(keys, f"{KEY}\n{KEY}\n")  # then a keys file that does not load: rejected, the last keys stay
    assert wait_for(lambda: every_worker_rejected(cluster, "a key is listed twice"), timeout=APPLIED_WITHIN_S)
    worker, _ = kill_a_worker(cluster)
    first = answers_of(cluster, worker, REVOKED)
    assert first == [401] * len(first), f"the restarted worker took the revoked key: {first}"
    assert set(answers_of(cluster, worker, KEY, count=3)) == {200}
    # the workers agree: the restart read neither the startup keys nor the file as it is now
    assert every_worker_answers(cluster, REVOKED, 401) and every_worker_answers(cluster, KEY, 200)


def test_reloads_that_would_open_the_gateway_unsaid_are_refused(make_cluster):
    cluster = make_cluster(workers=1, keys=[KEY])
    assert status(cluster, None) == 401
    rejected = log_count(cluster, "config reload rejected")
    no_auth = copy.deepcopy(cluster.config)
    del no_auth["auth"]
    reload_to(cluster, no_auth)  # the auth section dropped, without saying so
    assert wait_for(lambda: log_count(cluster, "config reload rejected") > rejected, timeout=APPLIED_WITHIN_S)
    assert "switches off API keys" in cluster.gateway.log_path.read_text()
    assert status(cluster, None) == 401
    text = yaml.safe_dump(cluster.config, sort_keys=False) + "auth: {}\n"  # a second auth key, last wins
    assert cluster.config_path is not None
    replace(cluster.config_path, text)
    assert wait_for(lambda: log_count(cluster, "'auth' appears twice") >= 1, timeout=APPLIED_WITHIN_S)
    assert status(cluster, None) == 401
    said = copy.deepcopy(cluster.config)
    said["auth"] = {"disabled": True}  # said on purpose: applied, and logged at ERROR
    reload_to(cluster, said)
    assert wait_for(lambda: status(cluster, None) == 200, timeout=APPLIED_WITHIN_S)
    log = cluster.gateway.log_path.read_text()
    assert re.search(r"ERROR .*switches authentication OFF on purpose: API keys \(from auth.api_keys_file", log)
