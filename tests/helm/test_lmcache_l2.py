"""LMCache's L2 store (issue 30): one the chart runs (lmcache.l2.deploy: Redis or LMCache's own
server, no persistence, bounded memory, locked down, reachable only from the engines that load
LMCache) or one that exists (lmcache.l2.url / urlSecret), never both; the engines' remote_url
names it; `helm test` checks every LMCache engine reaches it. Rendered offline with helm, checked
against the Kubernetes schemas, and the rendered Redis arguments run in a real redis-server with
the preflight's check against it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.procs import free_port

from .conftest import CHART, KUBE_VERSION, ROOT, Tools
from .test_chart import find, helm_template, of_kind, render

BIG = ROOT / "deploy" / "values-llama-3.3-70b.yaml"
SCRIPT = CHART / "files" / "preflight.py"
STORE = "pdgate-lmcache-l2"
# LMCache on both pools (their default 64Gi limits hold a 20 GB L1 + 16Gi /dev/shm) with an L2
LM = ["--set", "lmcache.enabled=true", "--set", "lmcache.l2.enabled=true"]
DEPLOY = [*LM, "--set", "lmcache.l2.deploy=true"]


def refused(tools: Tools, *args: str, values: Path | None = None) -> str:
    out = helm_template(tools, *args, values=values)
    assert out.returncode != 0, "rendered, but should have been refused"
    return out.stderr


def lmcache_config(docs: list[dict], pool: str) -> dict:
    return yaml.safe_load(find(docs, "ConfigMap", "pdgate-lmcache")["data"][f"{pool}.yaml"])


def store_objects(docs: list[dict]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"]["name"] == STORE)


def engine_pod_labels(docs: list[dict], pool: str) -> dict:
    return find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_store_on_renders_a_bounded_locked_down_redis_the_engines_name(tools: Tools, tmp_path):
    out = helm_template(tools, *DEPLOY)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert store_objects(docs) == [("Deployment", STORE), ("NetworkPolicy", STORE), ("Service", STORE)]
    dep, svc = find(docs, "Deployment", STORE), find(docs, "Service", STORE)
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]
    assert (
        svc["spec"]["selector"]
        == dep["spec"]["selector"]["matchLabels"]
        == {
            "app.kubernetes.io/name": "pdgate",
            "app.kubernetes.io/instance": "pdgate",
            "app.kubernetes.io/component": "lmcache-l2",
        }
    )
    assert selects(svc["spec"]["selector"], pod["metadata"]["labels"])
    [c] = pod["spec"]["containers"]
    assert c["image"] == "redis:7.4-alpine"
    # resources: requests and a memory limit; --maxmemory = 8Gi less 20 %, evicting LRU; no persistence
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    args = c["args"]
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs == {
        "--port": "6379",
        "--save": "",
        "--appendonly": "no",
        "--maxmemory": "6553mb",
        "--maxmemory-policy": "allkeys-lru",
    }
    # no volume claim anywhere: the only volume is a size-limited emptyDir (Redis's working directory)
    assert not of_kind(docs, "PersistentVolumeClaim") and not of_kind(docs, "StatefulSet")
    assert [v for v in pod["spec"]["volumes"] if set(v) != {"name", "emptyDir"}] == []
    # locked down: non-root, read-only root file system, no capabilities, no API token
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 999
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "-p", "6379", "ping"]
    assert c["livenessProbe"]["tcpSocket"] == {"port": "l2"}
    assert c["ports"] == [{"name": "l2", "containerPort": 6379, "protocol": "TCP"}]
    assert svc["spec"]["ports"] == [{"name": "l2", "port": 6379, "targetPort": "l2", "protocol": "TCP"}]
    assert not [p for p in of_kind(docs, "PodDisruptionBudget") if p["metadata"]["name"] == STORE]
    # the engines' LMCache names the Service, on its port, with the configured serde
    for pool in ("prefill", "decode"):
        cfg = lmcache_config(docs, pool)
        assert cfg["remote_url"] == f"redis://{STORE}:6379" and cfg["remote_serde"] == "naive"
    assert lmcache_config(render(tools, *DEPLOY, "--set", "lmcache.l2.serde=cachegen"), "decode")["remote_serde"] == (
        "cachegen"
    )
    # the rendering passes the Kubernetes schemas
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(out.stdout)
    check = subprocess.run(
        [str(tools.kubernetes_validate), "--strict", "-k", KUBE_VERSION, str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0 and "ERROR" not in check.stdout + check.stderr, check.stdout + check.stderr


def test_network_policy_admits_only_the_lmcache_engines_on_the_store_port(tools: Tools):
    docs = render(tools, *DEPLOY)  # networkPolicy.enabled is off: the store's policy renders anyway
    policy = find(docs, "NetworkPolicy", STORE)
    store_pod = find(docs, "Deployment", STORE)["spec"]["template"]
    assert (
        policy["spec"]["podSelector"]["matchLabels"]
        == find(docs, "Deployment", STORE)["spec"]["selector"]["matchLabels"]
    )
    assert selects(policy["spec"]["podSelector"]["matchLabels"], store_pod["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "l2", "protocol": "TCP"}]  # the container's named port
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    assert all(set(p) == {"podSelector"} for p in rule["from"])  # no namespaceSelector, no ipBlock
    for pool in ("prefill", "decode"):  # each engine pod is admitted
        assert any(selects(peer, engine_pod_labels(docs, pool)) for peer in peers), pool
    gateway = find(docs, "Deployment", "pdgate-gateway")["spec"]["template"]["metadata"]["labels"]
    redis = find(docs, "Deployment", "pdgate-redis")["spec"]["template"]["metadata"]["labels"]
    assert not any(
        selects(peer, labels) for peer in peers for labels in (gateway, redis, store_pod["metadata"]["labels"])
    )
    # only the pools that load LMCache
    docs = render(tools, *DEPLOY, "--set", "lmcache.pools={decode}")
    peers = [p["podSelector"]["matchLabels"] for p in find(docs, "NetworkPolicy", STORE)["spec"]["ingress"][0]["from"]]
    assert [p["app.kubernetes.io/component"] for p in peers] == ["decode"]
    assert not any(selects(peer, engine_pod_labels(docs, "prefill")) for peer in peers)
    # multi-node engines: every pod of a group (leader and workers) carries the pool's labels
    docs = render(
        tools,
        *DEPLOY,
        "--set",
        "lmcache.l1.enabled=false",
        values=ROOT / "deploy" / "values-llama-3.1-405b-multinode.yaml",
    )
    peers = [p["podSelector"]["matchLabels"] for p in find(docs, "NetworkPolicy", STORE)["spec"]["ingress"][0]["from"]]
    for lws in of_kind(docs, "LeaderWorkerSet"):
        t = lws["spec"]["leaderWorkerTemplate"]
        for template in (t["leaderTemplate"], t["workerTemplate"]):
            assert any(selects(peer, template["metadata"]["labels"]) for peer in peers)


def test_lmcache_server_kind_runs_lmcaches_own_server_in_the_engine_image(tools: Tools):
    docs = render(tools, *DEPLOY, "--set", "lmcache.l2.store.kind=lmcache-server")
    [c] = find(docs, "Deployment", STORE)["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "vllm/vllm-openai:v0.32.0"  # engines.image: it has LMCache
    assert c["command"] == ["lmcache_server", "0.0.0.0", "65432", "cpu"]
    assert {e["name"]: e["value"] for e in c["env"]}["LMCACHE_TRACK_USAGE"] == "false"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["startupProbe"]["tcpSocket"] == c["readinessProbe"]["tcpSocket"] == {"port": "l2"}
    assert lmcache_config(docs, "prefill")["remote_url"] == f"lm://{STORE}:65432"
    assert find(docs, "Service", STORE)["spec"]["ports"][0]["port"] == 65432
    docs = render(
        tools,
        *DEPLOY,
        "--set",
        "lmcache.l2.store.port=7000",
        "--set",
        "lmcache.l2.store.image.repository=registry.example/redis,lmcache.l2.store.image.tag=7.4",
    )
    assert lmcache_config(docs, "decode")["remote_url"] == f"redis://{STORE}:7000"
    [c] = find(docs, "Deployment", STORE)["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example/redis:7.4" and c["args"][:2] == ["--port", "7000"]
    assert "lmcache.l2.store.extraArgs: only the redis kind" in refused(
        tools, *DEPLOY, "--set", "lmcache.l2.store.kind=lmcache-server", "--set", "lmcache.l2.store.extraArgs={--x}"
    )


def test_existing_store_by_url_renders_no_store(tools: Tools):
    docs = render(tools, *LM, "--set", "lmcache.l2.url=redis://elasticache.example:6379")
    assert store_objects(docs) == []
    assert lmcache_config(docs, "decode")["remote_url"] == "redis://elasticache.example:6379"
    docs = render(tools, *LM, "--set", "lmcache.l2.urlSecret.name=lmcache-l2")
    assert store_objects(docs) == [] and "remote_url" not in lmcache_config(docs, "decode")
    assert store_objects(render(tools)) == []  # the chart's defaults: no LMCache, no store


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [*DEPLOY, "--set", "lmcache.l2.url=redis://r:6379"],
            "lmcache.l2: deploy and url are all set; choose one store: deploy=true (this release runs it) or url",
        ),
        (
            [*DEPLOY, "--set", "lmcache.l2.urlSecret.name=l2"],
            "lmcache.l2: deploy and urlSecret.name are all set; choose one store",
        ),
        (
            [*LM, "--set", "lmcache.l2.url=redis://r:6379", "--set", "lmcache.l2.urlSecret.name=l2"],
            "lmcache.l2: url and urlSecret.name are all set",
        ),
        (LM, "lmcache.l2.enabled needs a store: lmcache.l2.deploy=true (this release runs one) or lmcache.l2.url"),
        (
            ["--set", "lmcache.enabled=true", "--set", "lmcache.l2.deploy=true"],
            "lmcache.l2.deploy runs a store that only the engines' LMCache uses: also set lmcache.enabled=true and "
            "lmcache.l2.enabled=true",
        ),
        (["--set", "lmcache.l2.deploy=true"], "lmcache.l2.deploy runs a store that only the engines' LMCache uses"),
        (
            [*DEPLOY, "--set", "lmcache.l2.store.resources.limits=null"],
            "lmcache.l2.store.resources needs requests.cpu, requests.memory and limits.memory",
        ),
        (
            [*DEPLOY, "--set", "lmcache.l2.store.resources.requests.cpu=null"],
            "lmcache.l2.store.resources needs requests.cpu, requests.memory and limits.memory",
        ),
        (
            [*DEPLOY, "--set", "lmcache.l2.store.resources.limits.memory=128Mi"],
            "lmcache.l2.store.resources.limits.memory 128Mi is below 256Mi",
        ),
        (
            [*DEPLOY, "--set", "prefill.enabled=false", "--set", "lmcache.pools={prefill}"],
            "lmcache.l2.deploy: no enabled pool loads LMCache",
        ),
        ([*DEPLOY, "--set", "lmcache.l2.store.kind=memcached"], "lmcache.l2.store.kind must be one of the following"),
        ([*DEPLOY, "--set", "lmcache.l2.store.headroomPercent=0"], "lmcache.l2.store.headroomPercent: Must be greater"),
    ],
)
def test_store_settings_that_cannot_work_are_refused(tools: Tools, args, message):
    assert message in refused(tools, *args)


def test_helm_test_checks_every_lmcache_engine_reaches_the_store(tools: Tools):
    script = "/opt/pdgate/preflight/preflight.py"
    docs = render(tools, *DEPLOY, "--set", "lmcache.pools={decode}")
    [c] = find(docs, "Pod", "pdgate-preflight-test")["spec"]["containers"]
    sh = c["command"][2]
    assert "for pool in decode; do" in sh  # the pools that load LMCache; every ready engine of each
    assert f'kubectl -n "$NS" exec "$e" -c vllm -- python3 {script} l2 --timeout 10 </dev/null || failed=1' in sh
    assert 'done < "$work/$pool"' in sh
    assert "engine(s) reach the LMCache L2 store" in sh and sh.rstrip().endswith('exit "$failed"')
    # the check runs inside the engine pods, so the store's NetworkPolicy admits it as it admits vLLM
    # (the test pod itself has no engine labels and needs no rule)
    # an existing store is checked the same way (the engines' own remote_url / LMCACHE_REMOTE_URL)
    sh = find(render(tools, *LM, "--set", "lmcache.l2.urlSecret.name=l2"), "Pod", "pdgate-preflight-test")["spec"][
        "containers"
    ][0]["command"][2]
    assert "for pool in prefill decode; do" in sh and f"{script} l2" in sh
    # no L2, no check
    sh = find(render(tools), "Pod", "pdgate-preflight-test")["spec"]["containers"][0]["command"][2]
    assert " l2 " not in sh and "L2" not in sh


def test_70b_example_deploys_its_l2_redis(tools: Tools):
    docs = render(tools, values=BIG)
    assert store_objects(docs) == [("Deployment", STORE), ("NetworkPolicy", STORE), ("Service", STORE)]
    [c] = find(docs, "Deployment", STORE)["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["memory"] == "64Gi"
    assert c["args"][c["args"].index("--maxmemory") + 1] == "52428mb"  # 64 GiB less 20 %
    for pool in ("prefill", "decode"):
        assert lmcache_config(docs, pool)["remote_url"] == f"redis://{STORE}:6379"
    sh = find(docs, "Pod", "pdgate-preflight-test")["spec"]["containers"][0]["command"][2]
    assert "for pool in prefill decode; do" in sh
    # nothing in the example names a store that nothing deploys
    assert "svc.cluster.local" not in BIG.read_text()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_rendered_redis_arguments_run_and_the_preflight_reaches_it(tools: Tools, tmp_path):
    """The store's arguments, as rendered, in a real redis-server (Debian's, where the chart runs the
    redis:7.4-alpine image); then the engines' preflight check against it, with an engine's LMCache
    config file (its host rewritten to loopback), and against a closed port."""
    docs = render(tools, *DEPLOY, "--set", "lmcache.l2.store.resources.limits.memory=1Gi")
    [c] = find(docs, "Deployment", STORE)["spec"]["template"]["spec"]["containers"]
    port = free_port()
    argv = ["redis-server", *c["args"], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    log = (tmp_path / "redis.log").open("w")
    redis = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:

        def cli(*a: str) -> str:
            return subprocess.run(["redis-cli", "-p", str(port), *a], capture_output=True, text=True, timeout=10).stdout

        deadline = time.monotonic() + 10
        while cli("ping").strip() != "PONG":
            assert redis.poll() is None and time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
            time.sleep(0.1)
        assert cli("config", "get", "maxmemory").split("\n")[1] == str(819 * 1024 * 1024)  # 1Gi less 20 %
        assert cli("config", "get", "maxmemory-policy").split("\n")[1] == "allkeys-lru"
        assert cli("config", "get", "appendonly").split("\n")[1] == "no"
        assert cli("config", "get", "save").split("\n")[1] == ""
        # the engine's own config: remote_url from its ConfigMap, pointed at this server
        cfg = find(docs, "ConfigMap", "pdgate-lmcache")["data"]["decode.yaml"]
        path = tmp_path / "decode.yaml"
        path.write_text(cfg.replace(f"{STORE}:6379", f"127.0.0.1:{port}"))
        env = {"PATH": "/usr/bin:/bin", "LMCACHE_CONFIG_FILE": str(path)}
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "l2", "--timeout", "5"], capture_output=True, text=True, timeout=30, env=env
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith(f"preflight ok: LMCache L2 store redis://127.0.0.1:{port} (from {path})")
        assert "PING: PONG" in done.stdout
    finally:
        redis.terminate()
        redis.wait(timeout=10)
        log.close()
    # the store gone: one line, within the timeout
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "l2", "--timeout", "2"], capture_output=True, text=True, timeout=30, env=env
    )
    assert done.returncode == 1 and time.monotonic() - start < 10
    [line] = done.stdout.splitlines()
    assert line.startswith(f"preflight FAILED: LMCache L2 store redis://127.0.0.1:{port} (from {path}) within 2 s")
    assert f"cannot reach 127.0.0.1:{port}" in line and "NetworkPolicies" in line
