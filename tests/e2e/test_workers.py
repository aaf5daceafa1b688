"""One gateway, two worker processes (``server.workers: 2``) on one port, in front of simulated
engines: the workers act as one gateway (issue 15). A client connection stays with the worker that
accepted it, so each test holds one connection per worker and says which worker serves what."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "workers-admin-token"
LIMIT = 2
REPORT = "the prefill pool computes the prompt and the decode pool streams the answer back. " * 40


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode.append(c.start_sim("decode", "--enable-prompt-tokens-details", "--decode-time-per-token", "0.002"))
        c.start_gateway(
            THRESHOLD,
            server={"workers": 2},
            admin={"token_file": str(token_file)},
            admission={"max_in_flight": LIMIT, "queue_timeout_s": 0.2},
        )
        yield c
    finally:
        group.stop_all()


def worker_of(client: httpx.Client, cluster: Cluster) -> int:
    return client.get(cluster.url + "/ready").json()["workers"]["this"]


def one_client_per_worker(cluster: Cluster, workers: int = 2) -> dict[int, httpx.Client]:
    """A keep-alive connection to each worker (new connections until each worker has taken one)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1))
        w = worker_of(client, cluster)
        if w in found:
            client.close()
        else:
            found[w] = client
        if len(found) == workers:
            return found
    for client in found.values():
        client.close()
    pytest.fail(f"200 new connections reached only workers {sorted(found)}")


def chat(client: httpx.Client, cluster: Cluster, messages: list[dict], **kw) -> httpx.Response:
    return client.post(
        cluster.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4, **kw}
    )


def test_the_second_turn_on_the_other_worker_finds_the_first_turns_prefix(cluster):
    clients = one_client_per_worker(cluster)
    try:
        messages = [{"role": "user", "content": f"workers: {REPORT}"}]
        r1 = chat(clients[0], cluster, messages)
        assert r1.status_code == 200 and r1.headers["x-pdgate-path"] == "pd"
        said = r1.json()["choices"][0]["message"]["content"]
        turn2 = [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": "And then?"}]

        # worker 1 routed nothing of this conversation: it knows the prefix from worker 0 only
        def planned_path() -> str:
            return (
                clients[1]
                .post(
                    cluster.url + "/debug/route",
                    headers={"authorization": f"Bearer {TOKEN}"},
                    json={"model": "tiny", "messages": turn2},
                )
                .json()["path"]
            )

        ok = wait_for(lambda: planned_path() == "direct", timeout=5)
        assert ok, "worker 1 never learned what worker 0 routed"
        r2 = chat(clients[1], cluster, turn2)
        assert worker_of(clients[1], cluster) == 1  # the same connection, still worker 1
        assert r2.status_code == 200 and r2.headers["x-pdgate-path"] == "direct"
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > THRESHOLD  # the engine agrees
    finally:
        for c in clients.values():
            c.close()


def test_the_admission_limit_holds_across_workers(cluster):
    """Three streams on each worker's connections, LIMIT slots for the whole gateway: LIMIT are
    served, the rest get 429 with Retry-After, whichever worker they reached."""
    clients = [one_client_per_worker(cluster) for _ in range(3)]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hold a slot"}],
        "max_tokens": 400,
        "stream": True,
    }

    def stream(client: httpx.Client) -> tuple[int, str | None]:
        with client.stream("POST", cluster.url + "/v1/chat/completions", json=body) as r:
            r.read()
            return r.status_code, r.headers.get("retry-after")

    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(stream, [c for pair in clients for c in pair.values()]))
        served = [s for s, _ in results if s == 200]
        refused = [(s, ra) for s, ra in results if s == 429]
        assert len(served) == LIMIT and len(refused) == 6 - LIMIT, results
        assert all(ra for _, ra in refused)
        text = httpx.get(cluster.url + "/metrics", timeout=10).text
        assert sample(text, "pdgate_admission_in_flight") == 0  # every slot came back, in both workers
    finally:
        for pair in clients:
            for c in pair.values():
                c.close()


def test_one_metrics_endpoint_counts_the_whole_gateway(cluster):
    clients = one_client_per_worker(cluster)
    try:

        def served() -> float:
            text = clients[0].get(cluster.url + "/metrics").text
            return sample(text, "pdgate_requests_total", model="tiny", path="direct", status="200")

        before = served()
        for w in (0, 1, 1, 1):
            assert chat(clients[w], cluster, [{"role": "user", "content": f"count me {w}"}]).status_code == 200
        assert served() == before + 4  # three of them served by the other worker
        text = clients[1].get(cluster.url + "/metrics").text
        assert [sample(text, "pdgate_workers", state=s) for s in ("configured", "reporting")] == [2, 2]
        # what every worker sees alike is not counted twice
        assert sample(text, "pdgate_pool_healthy_endpoints", pool="decode") == 1
        assert sample(text, "pdgate_endpoint_healthy", pool="decode", engine=cluster.decode[0].url) == 1
    finally:
        for c in clients.values():
            c.close()


def test_an_edited_config_reaches_every_worker(cluster):
    """Each worker watches the file: a new threshold applies in both, and /metrics counts the
    reload once (every worker saw the same edit)."""
    clients = one_client_per_worker(cluster)
    messages = [{"role": "user", "content": "a short question, well under any threshold"}]

    def path_in(w: int) -> str:
        return (
            clients[w]
            .post(
                cluster.url + "/debug/route",
                headers={"authorization": f"Bearer {TOKEN}"},
                json={"model": "tiny", "messages": messages},
            )
            .json()["path"]
        )

    def reloads() -> float:
        return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, "pdgate_config_reloads_total", result="ok")

    try:
        assert path_in(0) == path_in(1) == "direct"
        before = reloads()
        cfg = copy.deepcopy(cluster.config)
        cfg["routing"] = {"decider": {"name": "token_threshold", "threshold": 1}}
        tmp = cluster.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        tmp.replace(cluster.config_path)
        assert wait_for(lambda: path_in(0) == "pd" and path_in(1) == "pd", timeout=15)
        assert wait_for(lambda: reloads() == before + 1, timeout=5)
    finally:
        tmp = cluster.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cluster.config))
        tmp.replace(cluster.config_path)
        assert wait_for(lambda: path_in(0) == "direct" and path_in(1) == "direct", timeout=15)
        for c in clients.values():
            c.close()


def test_a_rejected_edit_is_logged_once_for_the_gateway(cluster):
    """Both workers reject the same bad edit (each keeps its version); the log says so once."""
    clients = one_client_per_worker(cluster)
    assert cluster.gateway is not None and cluster.config_path is not None

    def last_error(w: int) -> str | None:
        return (
            clients[w]
            .get(cluster.url + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
            .json()["last_reload_error"]
        )

    def rejections() -> int:
        return cluster.gateway.log_path.read_text().count("config reload rejected")

    before = rejections()
    tmp = cluster.config_path.with_suffix(".tmp")
    try:
        cfg = copy.deepcopy(cluster.config)
        cfg["routing"] = {"decider": {"name": "no_such_decider"}}
        tmp.write_text(yaml.safe_dump(cfg))
        tmp.replace(cluster.config_path)
        assert wait_for(lambda: last_error(0) and last_error(1), timeout=15)
        time.sleep(0.2)  # the log line is written as the error is kept
        assert rejections() == before + 1
    finally:
        tmp.write_text(yaml.safe_dump(cluster.config))
        tmp.replace(cluster.config_path)
        assert wait_for(lambda: last_error(0) is None and last_error(1) is None, timeout=15)
        for c in clients.values():
            c.close()


def worker_pids(cluster: Cluster) -> list[int]:
    assert cluster.gateway is not None
    out = subprocess.run(
        ["pgrep", "-P", str(cluster.gateway.popen.pid), "-f", "multiprocessing.spawn"], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]


def test_a_worker_that_dies_is_started_again(cluster):
    pids = worker_pids(cluster)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    assert wait_for(lambda: len(set(worker_pids(cluster)) - {pids[0]}) == 2, timeout=30), (
        f"no new worker:\n{cluster.gateway.log_tail()}"
    )
    clients = one_client_per_worker(cluster)  # both serve again
    for c in clients.values():
        c.close()


def pid_holding(connection_port: int, server_port: int, pids: list[int]) -> int:
    """Which of ``pids`` holds the gateway's end of the client connection from ``connection_port``."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                local, remote = cols[1].rsplit(":", 1)[1], cols[2].rsplit(":", 1)[1]
                if int(local, 16) == server_port and int(remote, 16) == connection_port:
                    inodes.add(f"socket:[{cols[9]}]")
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
    pytest.fail(f"no worker holds the connection from port {connection_port}")


def test_a_dead_workers_requests_leave_the_in_flight_gauge(cluster):
    """A worker killed mid-stream: until it is back, /metrics (from the other worker) keeps its
    counts but no longer shows its stream in flight."""
    port = int(cluster.url.rsplit(":", 1)[1])
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hold a slot"}], "max_tokens": 1000, "stream": True}
    ).encode()

    def scrape() -> str:
        return httpx.get(cluster.url + "/metrics", timeout=10).text

    def streaming() -> socket.socket:
        """A plain socket: its own port names the worker process that holds the stream. (A worker
        just started may shed while its loop warms up: 429, and the test asks again.)"""
        for _ in range(50):
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            head = conn.recv(65536)
            if head.startswith(b"HTTP/1.1 200"):  # the headers, then the stream goes on
                return conn
            conn.close()
            assert head.startswith(b"HTTP/1.1 429"), head[:200]
            time.sleep(0.2)
        pytest.fail("the gateway shed every try")

    with streaming() as conn:
        # a scrape served by each worker: each then holds the other's last exposition (a worker
        # only knows a dead sibling's counters from a scrape it gathered while the sibling answered)
        clients = one_client_per_worker(cluster)
        try:
            befores = [c.get(cluster.url + "/metrics").text for c in clients.values()]
        finally:
            for c in clients.values():
                c.close()
        assert all(sample(before, "pdgate_admission_in_flight") == 1 for before in befores)
        served = min(sample(b, "pdgate_requests_total", model="tiny", path="direct", status="200") for b in befores)
        os.kill(pid_holding(conn.getsockname()[1], port, worker_pids(cluster)), signal.SIGKILL)
        assert wait_for(lambda: sample(scrape(), "pdgate_workers", state="reporting") == 1, timeout=10)
        after = scrape()
        assert sample(after, "pdgate_admission_in_flight") == 0
        assert sample(after, "pdgate_requests_total", model="tiny", path="direct", status="200") >= served
    assert wait_for(lambda: len(worker_pids(cluster)) == 2, timeout=30)
    clients = one_client_per_worker(cluster)  # both serve again
    for c in clients.values():
        c.close()


def test_sigterm_stops_the_supervisor_and_every_worker(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(THRESHOLD, server={"workers": 2})
        pids = worker_pids(c)
        assert len(pids) == 2
        assert c.gateway is not None
        c.gateway.popen.send_signal(signal.SIGTERM)  # the supervisor only, as Kubernetes does
        assert c.gateway.popen.wait(timeout=40) == 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    finally:
        group.stop_all()
