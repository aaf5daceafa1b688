"""The chart's `helm test` pod, run for real on loopback: its script, as rendered, with a stand-in
`kubectl` that answers the EndpointSlice list from a fake cluster and runs each `kubectl exec` as a
local process of the real preflight (helm/pdgate/files/preflight.py, NIXL over UCX in the cached
vLLM CPU venv). It must pair every decode engine with a prefill engine of its zone, as the gateway
does, move the buffer, and fail with the preflight's own words when a pair cannot work."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.procs import free_port
from tests.realvllm import engines as E

from .conftest import ROOT, Tools
from .test_chart import render

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

SCRIPT = ROOT / "helm" / "pdgate" / "files" / "preflight.py"

# A stand-in for kubectl: the two calls the test pod makes. `get endpointslices` prints what the
# rendered jsonpath prints (pod|zone|address|ready per endpoint); `exec POD -c vllm -- python3
# SCRIPT ARGS` runs the real preflight locally (serve on loopback), or fails for a broken pod.
FAKE_KUBECTL = r"""
import json, os, sys
cluster = json.load(open(os.environ["FAKE_CLUSTER"]))
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as log:
    log.write(" ".join(args) + "\n")
if "get" in args and "endpointslices" in args:
    service = args[args.index("-l") + 1].split("=", 1)[1]
    for ep in cluster["slices"].get(service, []):
        ready = {True: "true", False: "false", None: ""}[ep.get("ready", True)]
        print(f"{ep['pod']}|{ep.get('zone', '')}|{ep['ip']}|{ready}")
    sys.exit(0)
if "exec" in args:
    pod = args[args.index("exec") + 1]
    rest = args[args.index("--") + 1:]
    assert rest[0] == "python3" and rest[1] == "/opt/pdgate/preflight/preflight.py", rest
    if pod in cluster["broken"]:
        print("preflight FAILED: NIXL cannot load its UCX plugin (a broken engine, for the test)")
        sys.exit(1)
    cmd = [cluster["python"], cluster["script"], *rest[2:]]
    if rest[2] == "serve":
        cmd += ["--host", "127.0.0.1"]
    os.execv(cmd[0], cmd)
sys.exit(f"fake kubectl: unexpected call {args}")
"""


@pytest.fixture(scope="module")
def python() -> Path:
    venv, _model = E.venv_and_model()  # skips (a user's run) or fails (CI) when it cannot be built
    return venv / "bin" / "python"


def helm_test_pod(tools: Tools, *args: str) -> dict:
    docs = render(
        tools,
        "--set",
        "preflight.device=cpu",
        "--set",
        "preflight.test.timeoutSeconds=20",
        "--set",
        "preflight.test.sizeMiB=8",
        *args,
        values=ROOT / "deploy" / "values-small.yaml",
    )
    [pod] = [d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"] == "pdgate-preflight-test"]
    return pod


def run_pod(
    pod: dict, tmp_path: Path, python: Path, slices: dict, broken: tuple[str, ...] = ()
) -> tuple[int, str, list[str]]:
    [c] = pod["spec"]["containers"]
    assert c["command"][:2] == ["sh", "-c"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f"#!{sys.executable}\n{FAKE_KUBECTL}")
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IXUSR)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"slices": slices, "broken": list(broken), "python": str(python), "script": str(SCRIPT)})
    )
    calls = tmp_path / "calls"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "FI_", "NIXL_"))}
    env.update({e["name"]: str(e["value"]) for e in c["env"]})
    env.update(
        {
            "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
            "FAKE_CLUSTER": str(cluster),
            "FAKE_CALLS": str(calls),
            "PORT": str(free_port()),
            "TMPDIR": str(tmp_path),
        }
    )
    done = subprocess.run(c["command"], capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stdout + done.stderr, calls.read_text().splitlines()


def slices(prefill: list[tuple[str, str | None]], decode: list[tuple[str, str | None]], **ready: bool) -> dict:
    def eps(pods: list[tuple[str, str | None]]) -> list[dict]:
        return [
            {"pod": p, "ip": "127.0.0.1", "ready": ready.get(p, True), **({"zone": z} if z else {})} for p, z in pods
        ]

    return {"pdgate-prefill": eps(prefill), "pdgate-decode": eps(decode)}


def execs(calls: list[str]) -> list[tuple[str, str]]:
    """(pod, serve|pull) of each kubectl exec, sorted (a pair's serve runs in the background)."""
    out = []
    for line in calls:
        words = line.split()
        if "exec" in words:
            out.append((words[words.index("exec") + 1], words[words.index("--") + 3]))
    return sorted(out)


def pairs(out: str) -> list[tuple[str, str]]:
    """(decode, prefill) of each pair the pod made, in order."""
    return re.findall(r"^pair \d+: decode (\S+) pulls from prefill (\S+) ", out, re.M)


def test_every_decode_engine_pulls_from_a_prefill_engine_of_its_zone(tools: Tools, tmp_path: Path, python: Path):
    pod = helm_test_pod(tools)
    code, out, calls = run_pod(
        pod,
        tmp_path,
        python,
        slices(
            prefill=[("prefill-a", "us-east-1a"), ("prefill-b", "us-east-1b"), ("prefill-gone", "us-east-1b")],
            decode=[("decode-b", "us-east-1b"), ("decode-a", "us-east-1a")],
            **{"prefill-gone": False},
        ),
    )
    assert code == 0, out
    assert pairs(out) == [("decode-b", "prefill-b"), ("decode-a", "prefill-a")]  # never prefill-gone
    assert execs(calls) == [("decode-a", "pull"), ("decode-b", "pull"), ("prefill-a", "serve"), ("prefill-b", "serve")]
    assert out.count("preflight ok: pulled 8 MiB from 127.0.0.1:") == 2, out
    assert out.strip().endswith("preflight ok: 2 pair(s) moved KV with UCX")
    # the list the pod reads is the pools' EndpointSlices, as the gateway's discovery reads them
    lists = [c for c in calls if "endpointslices" in c]
    assert [c.split("-l ")[1].split()[0] for c in lists] == [
        "kubernetes.io/service-name=pdgate-prefill",
        "kubernetes.io/service-name=pdgate-decode",
    ]


def test_a_decode_engine_without_a_prefill_engine_in_its_zone_fails_the_test(
    tools: Tools, tmp_path: Path, python: Path
):
    code, out, calls = run_pod(
        helm_test_pod(tools),
        tmp_path,
        python,
        slices(prefill=[("prefill-a", "us-east-1a")], decode=[("decode-a", "us-east-1a"), ("decode-c", "us-east-1c")]),
    )
    assert code == 1, out
    assert (
        "preflight FAILED: decode engine decode-c (zone us-east-1c) has no ready prefill engine in its zone" in out
    ), out
    assert pairs(out) == [("decode-a", "prefill-a")]  # the other pair still ran
    assert execs(calls) == [("decode-a", "pull"), ("prefill-a", "serve")]
    # with placement.pairing off, any prefill engine serves any decode engine
    (tmp_path / "off").mkdir()
    code, out, calls = run_pod(
        helm_test_pod(tools, "--set", "placement.pairing=off"),
        tmp_path / "off",
        python,
        slices(prefill=[("prefill-a", "us-east-1a")], decode=[("decode-c", "us-east-1c")]),
    )
    assert code == 0 and pairs(out) == [("decode-c", "prefill-a")], out


def test_a_pair_that_cannot_move_kv_fails_with_the_preflights_words(tools: Tools, tmp_path: Path, python: Path):
    code, out, _calls = run_pod(
        helm_test_pod(tools),
        tmp_path,
        python,
        slices(prefill=[("prefill-broken", None)], decode=[("decode-a", "us-east-1a")]),
        broken=("prefill-broken",),
    )
    assert code == 1, out
    assert "preflight FAILED: NIXL cannot load its UCX plugin" in out  # the serving side's own message
    assert "preflight FAILED: could not connect" in out, out  # the puller, bounded by the test's timeout
    assert "moved KV" not in out


def test_the_test_pods_role_reads_endpointslices_and_execs_only(tools: Tools):
    docs = render(tools, values=ROOT / "deploy" / "values-small.yaml")
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "pdgate-preflight-test"]
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
    ]


def test_with_an_lmcache_l2_every_engine_checks_it_reaches_the_store(
    tools: Tools, tmp_path: Path, python: Path, monkeypatch: pytest.MonkeyPatch
):
    """The L2 check runs in each ready engine of the LMCache pools (kubectl exec), with the engine's own
    LMCache settings (here LMCACHE_REMOTE_URL, as the chart's urlSecret sets it), after the pairs."""
    pod = helm_test_pod(
        tools,
        "--set",
        "lmcache.enabled=true,lmcache.l1.enabled=false,lmcache.l2.enabled=true,lmcache.l2.deploy=true",
    )
    store = socket.create_server(("127.0.0.1", 0))  # a Redis stand-in: +PONG to every connection
    answer = threading.Thread(target=_pong_forever, args=(store,), daemon=True)
    answer.start()
    cluster = slices(prefill=[("prefill-a", None)], decode=[("decode-a", None), ("decode-b", None)])
    monkeypatch.setenv("LMCACHE_REMOTE_URL", f"redis://127.0.0.1:{store.getsockname()[1]}")
    (tmp_path / "up").mkdir()
    code, out, calls = run_pod(pod, tmp_path / "up", python, cluster)
    store.close()
    assert code == 0, out
    assert [pod for pod, cmd in execs(calls) if cmd == "l2"] == ["decode-a", "decode-b", "prefill-a"]
    assert out.count("preflight ok: LMCache L2 store redis://127.0.0.1:") == 3, out
    assert out.strip().endswith("preflight ok: 2 pair(s) moved KV with UCX; 3 engine(s) reach the LMCache L2 store")
    # the store unreachable: each engine says so in one line, and the test fails after the pairs ran
    monkeypatch.setenv("LMCACHE_REMOTE_URL", f"redis://127.0.0.1:{free_port()}")
    (tmp_path / "down").mkdir()
    code, out, calls = run_pod(pod, tmp_path / "down", python, cluster)
    assert code == 1, out
    assert out.count("preflight FAILED: LMCache L2 store redis://127.0.0.1:") == 3, out
    assert len(pairs(out)) == 2 and "reach the LMCache L2 store" not in out


def _pong_forever(server: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while True:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"+PONG\r\n")
