"""A config file caught half-written is never applied, and a reload that opens access says so
(issue 13): the real gateway process, with API keys and an admin token, its config rewritten
non-atomically with a pause after a valid YAML prefix that lacks the auth and admin sections."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
import yaml

from tests.procs import ProcGroup, wait_for

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY = "sk-reload"
ADMIN = "reload-admin"


@pytest.fixture
def cluster(tokenizer_dir, tmp_path):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    (tmp_path / "keys").write_text(KEY)
    (tmp_path / "admin").write_text(ADMIN)
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(
            10_000, auth={"api_keys_file": str(tmp_path / "keys")}, admin={"token_file": str(tmp_path / "admin")}
        )
        yield c
    finally:
        group.stop_all()


def ask(cluster: Cluster, key: str | None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=10).status_code


def version(cluster: Cluster) -> str:
    r = httpx.get(cluster.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 200, r.text  # admin never disappears mid-write
    return r.json()["version"]


def test_a_half_written_config_never_serves_without_auth(cluster):
    assert cluster.config_path is not None
    new = copy.deepcopy(cluster.config)
    new["routing"]["decider"]["threshold"] = 20_000
    whole = yaml.safe_dump(new, sort_keys=False).encode()
    cut = min(whole.index(b"auth:"), whole.index(b"admin:"))
    half = whole[:cut]
    assert "auth" not in yaml.safe_load(half) and "admin" not in yaml.safe_load(half)
    before = version(cluster)
    seen: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            seen.append(ask(cluster, None))
            version(cluster)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with open(cluster.config_path, "wb") as f:  # a plain rewrite, not atomic, paused mid-way
            f.write(half)
            f.flush()
            time.sleep(0.5)
            f.write(whole[cut:])
        assert wait_for(lambda: version(cluster) != before, timeout=15)
    finally:
        stop.set()
        prober.join(30)
    assert seen and set(seen) == {401}, seen  # no moment without auth
    assert ask(cluster, KEY) == 200


def test_a_reload_that_opens_access_is_applied_with_a_warning(cluster):
    assert cluster.config_path is not None and cluster.gateway is not None
    new = copy.deepcopy(cluster.config)
    new["auth"] = {"disabled": True}  # said on purpose (without it the reload is refused: test_attacks_config.py)
    tmp = cluster.config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(new, sort_keys=False))
    tmp.replace(cluster.config_path)
    assert wait_for(lambda: ask(cluster, None) == 200, timeout=15)
    log = cluster.gateway.log_path.read_text()
    assert "config reload changes auth" in log and "access is now open" in log
