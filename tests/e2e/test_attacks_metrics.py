"""Issue 27.7, attacked on a real gateway (``pdgate serve``, two worker processes) in front of a
simulated engine, on loopback:

- ``/metrics`` named an unnamed API key's tenant after the first 40 bits of the key's plain
  sha256, readable without credentials: a weak key could be guessed offline. Now the label is an
  HMAC under a per-install secret, and ``admin.protect_metrics`` closes ``/metrics`` to all but the
  admin token;
- another process of the gateway's user connected to the workers' hub and sent forged in-flight
  counts (and garbage): the workers took them, saw the engine full and refused every request. Now
  they are dropped, counted, and logged once per interval;
- ``kill -9`` of the supervisor left its ``pdgate-bus-*`` folder behind: now its workers remove it
  as they stop.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
WEAK_KEY = "sk-1234"  # unnamed: its own tenant
NAMED_KEY = "sk-acme-0123456789abcdef tenant=acme"
TOKEN = "metrics-admin-token-0123456789"
SECRET = "per-install-label-secret-0123456789"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
PER_ENGINE = 4  # admission.max_per_decode_endpoint

# Another process of the gateway's user: connects to the hub's input and, for ``seconds``, says in
# every worker's name (the wire format the workers took before) that the decode engine has 1,000
# requests in flight; then, for a second, sends what a forger could make of the current format
# (a made-up signature, a stamp from the future, a topic that passes the workers' prefix filter)
# and garbage.
FORGER = """
import sys, time
import cbor2, zmq
folder, engine, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.connect(f"ipc://{folder}/in")
time.sleep(0.5)  # the hub forwards the workers' subscriptions to this new publisher
full = cbor2.dumps(["inflight", {engine: 1000}, {"occupancy": {"acme": 1e12}}])
stamp = (1 << 63).to_bytes(8, "big")
print("sending", flush=True)
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for topic in (b"w000", b"w001"):
        pub.send_multipart([topic, full])
        sent += 1
    time.sleep(0.002)
end = time.monotonic() + 1.0
while time.monotonic() < end:
    for topic in (b"w000", b"w001"):
        pub.send_multipart([topic, stamp, full, bytes(16)])
        pub.send_multipart([topic + b"9", stamp, full, bytes(16)])
        pub.send_multipart([topic, b"garbage"])
        pub.send_multipart([topic, b"\\xff" * 64, b"", b"", b""])
        sent += 4
    time.sleep(0.002)
print(sent, flush=True)
pub.close(0)
ctx.term()
"""


def private_tmp() -> str:
    """A short private TMPDIR for the gateway, so its hub's folder is found (and IPC paths stay short)."""
    return tempfile.mkdtemp(prefix="pdg-", dir="/tmp")


def hub_folder(tmp: str, supervisor: int) -> str:
    found = glob.glob(os.path.join(tmp, f"pdgate-bus-{supervisor}-*"))
    assert len(found) == 1, found
    return found[0]


def worker_pids(cluster: Cluster) -> list[int]:
    assert cluster.gateway is not None
    out = subprocess.run(
        ["pgrep", "-P", str(cluster.gateway.pid), "-f", "multiprocessing.spawn"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(f"{WEAK_KEY}\n{NAMED_KEY}\n")
    (group.log_dir / "admin-token").write_text(TOKEN)
    tmp = private_tmp()
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(
            10_000,
            server={"workers": 2},
            env={"TMPDIR": tmp, "PDGATE_LABEL_SECRET": SECRET},
            auth={"api_keys_file": str(group.log_dir / "keys")},
            admin={
                "token_file": str(group.log_dir / "admin-token"),
                "protect_metrics": True,
                "tenant_label_secret_env": "PDGATE_LABEL_SECRET",
            },
            admission={"max_per_decode_endpoint": PER_ENGINE, "queue_timeout_s": 1.0},
        )
        c.tmp = tmp  # type: ignore[attr-defined]
        yield c
    finally:
        group.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def one_client_per_worker(cluster: Cluster) -> dict[int, httpx.Client]:
    """A keep-alive connection to each worker (new connections until each worker has taken one)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1))
        w = client.get(cluster.url + "/ready").json()["workers"]["this"]
        if w in found:
            client.close()
        else:
            found[w] = client
        if len(found) == 2:
            return found
    for client in found.values():
        client.close()
    pytest.fail(f"200 new connections reached only workers {sorted(found)}")


def chat(client: httpx.Client, cluster: Cluster, key: str = WEAK_KEY) -> int:
    return client.post(
        cluster.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ).status_code


def test_metrics_need_the_admin_token_on_every_worker(cluster):
    clients = one_client_per_worker(cluster)
    try:
        for client in clients.values():
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {WEAK_KEY}"}):
                r = client.get(cluster.url + "/metrics", headers=headers)
                assert r.status_code == 401, headers
                err = r.json()["error"]
                assert err["code"] == "invalid_admin_token" and err["type"] == "authentication_error"
                assert "pdgate_" not in r.text
            r = client.get(cluster.url + "/metrics", headers=ADMIN)
            assert r.status_code == 200 and sample(r.text, "pdgate_workers", state="reporting") == 2
    finally:
        for c in clients.values():
            c.close()


def test_an_unnamed_keys_tenant_label_reveals_no_hash_of_the_key(cluster):
    """Before: ``tenant="key-<sha256(key)[:10]>"``; sha256 of every 7-character key is an offline
    table. Now the label is HMAC(secret, key), the same in both workers (their counts merge)."""
    clients = one_client_per_worker(cluster)
    try:
        for w in (0, 1, 1):
            assert chat(clients[w], cluster) == 200
        text = clients[0].get(cluster.url + "/metrics", headers=ADMIN).text
    finally:
        for c in clients.values():
            c.close()
    plain = hashlib.sha256(WEAK_KEY.encode()).hexdigest()[:10]
    label = "key-" + hmac.new(SECRET.encode(), WEAK_KEY.encode(), hashlib.sha256).hexdigest()[:10]
    assert plain not in text and WEAK_KEY not in text
    assert sample(text, "pdgate_tenant_requests_total", tenant=label, outcome="admitted") == 3  # both workers'
    assert cluster.gateway is not None
    assert wait_for(lambda: f'"tenant":"{label}"' in cluster.gateway.log_path.read_text(), timeout=10)
    log = cluster.gateway.log_path.read_text()
    assert plain not in log and WEAK_KEY not in log  # the access log names it alike


def test_forged_messages_on_the_workers_hub_change_no_count(cluster):
    """A process of the same user says, in each worker's name, that the engine has 1,000 requests
    in flight (PER_ENGINE at most). Before: taken, so every request waited for room and got 429
    (and the first message of another shape ended the workers' receive loop for good)."""
    assert cluster.gateway is not None
    folder = hub_folder(cluster.tmp, cluster.gateway.pid)
    clients = one_client_per_worker(cluster)
    forger = subprocess.Popen(
        [sys.executable, "-c", FORGER, folder, cluster.decode[0].url, "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert forger.stdout is not None and forger.stdout.readline().strip() == "sending"
        time.sleep(0.5)  # well into the forgery (the workers publish their own counts every 0.1 s)
        statuses = []
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            statuses += [chat(clients[0], cluster), chat(clients[1], cluster)]
        out, err = forger.communicate(timeout=30)
        assert forger.returncode == 0, err
        assert int(out) > 1000
        assert statuses and set(statuses) == {200}, statuses
        assert {chat(c, cluster) for c in clients.values()} == {200}  # after the garbage too
        text = clients[0].get(cluster.url + "/metrics", headers=ADMIN).text
        assert sample(text, "pdgate_workers", state="reporting") == 2  # both workers still talk on the hub
        assert sample(text, "pdgate_worker_bus_dropped_messages_total", reason="forged") > 1000
        assert sample(text, "pdgate_worker_bus_dropped_messages_total", reason="invalid") == 0
        lines = [line for line in cluster.gateway.log_path.read_text().splitlines() if "worker bus: dropped" in line]
        assert 1 <= len(lines) <= 4, lines  # thousands of drops: a line per worker per 10 s at most
        assert "Traceback" not in cluster.gateway.log_tail(400)
    finally:
        forger.kill()
        forger.wait()
        for c in clients.values():
            c.close()


def test_kill_9_of_the_supervisor_leaves_no_hub_folder(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    (tmp_path / "keys").write_text(WEAK_KEY)
    tmp = private_tmp()
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(
            10_000, server={"workers": 2}, env={"TMPDIR": tmp}, auth={"api_keys_file": str(tmp_path / "keys")}
        )
        assert c.gateway is not None
        workers = worker_pids(c)
        assert len(workers) == 2
        folder = hub_folder(tmp, c.gateway.pid)
        os.kill(c.gateway.pid, signal.SIGKILL)  # the supervisor only: its workers are orphaned
        c.gateway.popen.wait(10)
        assert wait_for(lambda: not Path(folder).exists(), timeout=30), f"{folder} still there:\n{c.gateway.log_tail()}"
        assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), timeout=30)
        assert glob.glob(os.path.join(tmp, "pdgate-bus-*")) == []
    finally:
        group.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
