"""The Helm chart (helm/pdgate) and the deploy/ examples, checked offline: helm lint --strict, helm
template for the chart's defaults and every example values file, the rendered manifests against the
Kubernetes schemas (kubernetes-validate --strict), and the gateway config the chart renders through
the gateway's own validator, so that chart and code cannot drift."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.cli import main as pdgate
from gateway.config import load_config
from gateway.http.reconfigure import validate

from .conftest import CHART, KUBE_VERSION, ROOT, Tools

EXAMPLES = sorted((ROOT / "deploy").glob("values-*.yaml"))
CASES = [None, *EXAMPLES]  # None: the chart's own defaults
IDS = ["defaults", *(p.stem for p in EXAMPLES)]
NAMESPACE = "llm"


def helm_template(tools: Tools, *args: str, values: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [str(tools.helm), "template", "pdgate", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values is not None:
        cmd += ["-f", str(values)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


def render(tools: Tools, *args: str, values: Path | None = None) -> list[dict]:
    out = helm_template(tools, *args, values=values)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module")
def rendered(tools: Tools) -> dict[Path | None, list[dict]]:
    return {case: render(tools, values=case) for case in CASES}


def test_helm_lint_strict(tools: Tools):
    for case in CASES:
        cmd = [str(tools.helm), "lint", "--strict", str(CHART)] + (["-f", str(case)] if case else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{case}: {out.stdout}{out.stderr}"
        assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rendered_manifests_pass_the_kubernetes_schemas(tools: Tools, case, tmp_path):
    out = helm_template(tools, values=case)
    assert out.returncode == 0, out.stderr
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(out.stdout)
    check = subprocess.run(
        [str(tools.kubernetes_validate), "--strict", "-k", KUBE_VERSION, str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ERROR" not in check.stdout + check.stderr
    # every built-in kind was really checked (custom resources only get a warning)
    passed = check.stdout.count(" passed for resource ")
    custom = ("coreos.com", "keda.sh", "leaderworkerset.x-k8s.io")  # CRDs: see tests/helm/test_eks.py
    builtin = [d for d in yaml.safe_load_all(out.stdout) if d and not any(c in d["apiVersion"] for c in custom)]
    assert passed == len(builtin)


def _gateway_env(docs: list[dict]) -> dict[str, dict]:
    dep = find(docs, "Deployment", "pdgate-gateway")
    [container] = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_configmap_passes_the_gateways_own_validator(rendered, case, tmp_path, monkeypatch, capsys):
    docs = rendered[case]
    text = find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    cfg = load_config(path)
    env = _gateway_env(docs)
    # variables the config names must come from the gateway container (Secrets in the cluster)
    named = [cfg.state.url_env, cfg.auth.api_keys_env, cfg.admin.token_env]
    for name in filter(None, named):
        assert name in env and "secretKeyRef" in env[name]["valueFrom"], name
        monkeypatch.setenv(name, "redis://redis:6379/0" if name == cfg.state.url_env else "k1,k2")
    validate(cfg)  # policies, hash settings, secrets, Redis URL: what the gateway checks at startup
    # --no-tokenizers: the chart names hub tokenizers, and no hub is reachable here
    assert pdgate(["check-config", str(path), "--no-tokenizers"]) == 0, capsys.readouterr().err
    assert cfg.models[0].max_model_len > 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_discovery_finds_the_engine_services_with_rbac(rendered, case):
    docs = rendered[case]
    cfg = yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    discovered = {pool: c["discovery"] for pool, c in cfg["pools"].items() if "discovery" in c}
    for d in discovered.values():
        assert d["address_type"] == "IPv4"  # one family: a dual-stack Service's pods are not counted twice
        service = d["label_selector"].removeprefix("kubernetes.io/service-name=")
        svc = find(docs, "Service", service)
        assert svc["spec"]["clusterIP"] == "None"  # headless: the gateway picks each engine
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert d["port"] in ports
        if "kv_events_port" in d:
            assert ports["kv-events"] == d["kv_events_port"] and ports["kv-replay"] == d["kv_events_replay_port"]
        # the engines behind it listen where the Service and the gateway expect
        deployments = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == service]
        if deployments:
            engines = deployments[0]
            assert svc["spec"]["selector"] == engines["spec"]["selector"]["matchLabels"]
            pod = engines["spec"]["template"]
        else:  # multi-node engines: the Service selects the LeaderWorkerSet's leaders only
            pod = find(docs, "LeaderWorkerSet", service)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
            assert svc["spec"]["selector"].pop("leaderworkerset.sigs.k8s.io/worker-index") == "0"
            assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        [vllm] = pod["spec"]["containers"]
        assert {p["name"] for p in vllm["ports"]} >= set(ports)
    if discovered:
        role = find(docs, "Role", "pdgate-gateway")  # (ClusterRole for nodes: placement.pairing spine only)
        assert role["rules"] == [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
        ]
        binding = find(docs, "RoleBinding", "pdgate-gateway")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdgate-gateway", "namespace": NAMESPACE}]
        pod = find(docs, "Deployment", "pdgate-gateway")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "pdgate-gateway" and pod["automountServiceAccountToken"] is True
    else:
        assert not of_kind(docs, "Role")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gateway_pod_is_locked_down_and_probed(rendered, case):
    docs = rendered[case]
    dep = find(docs, "Deployment", "pdgate-gateway")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["args"] == ["serve", "--config", "/etc/pdgate/config.yaml"]
    # the ConfigMap is mounted as a directory (no subPath), so the kubelet's updates reach the
    # file and the gateway hot-reloads them; writable scratch only in emptyDirs
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "subPath" not in mounts["/etc/pdgate"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/pdgate"]["name"]]["configMap"]["name"] == "pdgate-gateway"
    assert all("emptyDir" in volumes[m["name"]] for p, m in mounts.items() if p != "/etc/pdgate")
    assert dep["spec"]["replicas"] >= 1
    pdbs = [d for d in of_kind(docs, "PodDisruptionBudget") if d["metadata"]["name"] == "pdgate-gateway"]
    if dep["spec"]["replicas"] > 1:
        [pdb] = pdbs
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    else:  # minAvailable 1 over a single pod would block every node drain
        assert not pdbs


def test_gateway_pdb_only_with_several_replicas(tools: Tools):
    docs = render(tools)
    spec = find(docs, "PodDisruptionBudget", "pdgate-gateway")["spec"]
    assert spec["minAvailable"] == 1
    # a gateway that is not Ready (decode down) can still be evicted: drains never wait on it
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    docs = render(tools, "--set", "gateway.replicas=1", "--set", "redis.enabled=false")
    assert not of_kind(docs, "PodDisruptionBudget")


def test_replicas_share_state_on_redis(rendered, tools: Tools):
    docs = rendered[None]
    cfg = yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert find(docs, "Deployment", "pdgate-gateway")["spec"]["replicas"] == 2
    assert cfg["state"] == {"backend": "redis", "url": "redis://pdgate-redis:6379/0"}
    redis = find(docs, "Deployment", "pdgate-redis")
    assert redis["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # an external Redis by Secret: the URL never lands in the ConfigMap
    docs = render(tools, "--set", "redis.urlSecret.name=redis-url")
    cfg = yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert cfg["state"] == {"backend": "redis", "url_env": "PDGATE_REDIS_URL"}
    assert not [d for d in docs if d["metadata"]["name"] == "pdgate-redis"]
    # several replicas without shared state is refused with the reason
    out = helm_template(tools, "--set", "redis.enabled=false")
    assert out.returncode != 0 and "gateway.replicas > 1 needs shared state" in out.stderr


def _hpa_metrics(hpa: dict) -> list[tuple[str, dict, dict]]:
    return [
        (m["external"]["metric"]["name"], m["external"]["metric"]["selector"]["matchLabels"], m["external"]["target"])
        for m in hpa["spec"]["metrics"]
    ]


def test_each_pool_scales_on_its_own_signal(rendered, tools: Tools):
    docs = rendered[ROOT / "deploy" / "values-llama-3.3-70b.yaml"]
    prefill, decode = (
        find(docs, "HorizontalPodAutoscaler", "pdgate-prefill"),
        find(docs, "HorizontalPodAutoscaler", "pdgate-decode"),
    )
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pdgate-prefill"}
    assert prefill["spec"]["scaleTargetRef"] == target
    assert (prefill["spec"]["minReplicas"], prefill["spec"]["maxReplicas"]) == (2, 6)
    # this release's series only (the ServiceMonitor copies the pods' app.kubernetes.io/instance)
    mine = {"app_kubernetes_io_instance": "pdgate"}
    assert _hpa_metrics(prefill) == [
        (
            "pdgate_pool_uncached_prompt_tokens",
            {**mine, "pool": "prefill"},
            {"type": "AverageValue", "averageValue": "32768"},
        )
    ]
    assert _hpa_metrics(decode) == [
        ("pdgate_pool_kv_usage_ratio", {**mine, "pool": "decode"}, {"type": "Value", "value": "0.75"}),
        (
            "pdgate_pool_engine_running_requests",
            {**mine, "pool": "decode"},
            {"type": "AverageValue", "averageValue": "192"},
        ),
    ]
    # the HPA owns the replica count
    assert "replicas" not in find(docs, "Deployment", "pdgate-prefill")["spec"]
    # KEDA instead: the same signals as PromQL, aggregated as the metric needs
    docs = render(tools, "--set", "autoscaling.backend=keda", values=ROOT / "deploy" / "values-llama-3.3-70b.yaml")
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    so = find(docs, "ScaledObject", "pdgate-decode")
    assert so["spec"]["scaleTargetRef"] == {"name": "pdgate-decode"}
    assert [(t["metricType"], t["metadata"]["query"], t["metadata"]["threshold"]) for t in so["spec"]["triggers"]] == [
        (
            "Value",
            "max(max by (pool, pod) (pdgate_pool_kv_usage_ratio{"
            'app_kubernetes_io_instance="pdgate",namespace="llm",pool="decode"}))',
            "0.75",
        ),
        (
            "AverageValue",
            "max(max by (pool, pod) (pdgate_pool_engine_running_requests{"
            'app_kubernetes_io_instance="pdgate",namespace="llm",pool="decode"}))',
            "192",
        ),
    ]
    # a gateway pod scraped twice counts once: max by (pool, pod) before the sum over pods
    query = find(docs, "ScaledObject", "pdgate-prefill")["spec"]["triggers"][0]["metadata"]["query"]
    assert query == (
        "sum(max by (pool, pod) (pdgate_pool_uncached_prompt_tokens{"
        'app_kubernetes_io_instance="pdgate",namespace="llm",pool="prefill"}))'
    )
    # turned off: no autoscaler, a fixed replica count
    docs = render(
        tools,
        "--set",
        "decode.autoscaling.enabled=false",
        "--set",
        "decode.replicas=3",
        values=ROOT / "deploy" / "values-llama-3.3-70b.yaml",
    )
    assert [h["metadata"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")] == ["pdgate-prefill"]
    assert find(docs, "Deployment", "pdgate-decode")["spec"]["replicas"] == 3


def test_autoscaling_is_off_by_default_and_needs_metrics(rendered, tools: Tools, tmp_path):
    """HPAs without a scrape of the gateway's metrics never scale: off by default, on in the 70B
    example together with the ServiceMonitor, and NOTES warns when only autoscaling is on."""
    assert not of_kind(rendered[None], "HorizontalPodAutoscaler")
    assert not of_kind(rendered[None], "ServiceMonitor")
    big = rendered[ROOT / "deploy" / "values-llama-3.3-70b.yaml"]
    assert len(of_kind(big, "HorizontalPodAutoscaler")) == 2
    assert find(big, "ServiceMonitor", "pdgate-gateway")["spec"]["endpoints"][0]["path"] == "/metrics"
    values = tmp_path / "hpa-only.yaml"
    values.write_text("prefill: {autoscaling: {enabled: true}}\n")
    notes = render_notes(tools, tmp_path / "hpa-only", values)
    assert "WARNING: autoscaling is on (prefill) but monitoring.serviceMonitor.enabled is false" in notes
    assert "Autoscaling is off" in render_notes(tools, tmp_path / "small", ROOT / "deploy" / "values-small.yaml")


def test_prometheus_adapter_rules_cover_the_hpa_metrics():
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus-adapter-values.yaml").read_text())["rules"]["external"]
    by_name = {r["name"]["as"]: r["metricsQuery"] for r in rules}
    # one series per gateway pod first (a pod scraped by two Prometheus replicas or two jobs counts
    # once), keeping the release label the HPAs select on; then over the pods
    inner = "(max by (pool, app_kubernetes_io_instance, pod) (<<.Series>>{<<.LabelMatchers>>}))"
    for summed in (
        "pdgate_pool_uncached_prompt_tokens",
        "pdgate_pool_in_flight_requests",
        "pdgate_pool_desired_engines",
    ):  # per gateway replica
        assert by_name[summed] == f"sum by (pool, app_kubernetes_io_instance) {inner}"
    for engine_scraped in (
        "pdgate_pool_kv_usage_ratio",
        "pdgate_pool_engine_running_requests",
        "pdgate_pool_engine_waiting_requests",
        "pdgate_pool_healthy_endpoints",
    ):
        assert by_name[engine_scraped] == f"max by (pool, app_kubernetes_io_instance) {inner}"  # same on every replica
    schema = json.loads((CHART / "values.schema.json").read_text())
    metric_names = schema["properties"]["prefill"]["properties"]["autoscaling"]["properties"]["metrics"]["items"][
        "properties"
    ]["name"]["enum"]
    assert set(metric_names) == set(by_name)


def _vllm(docs: list[dict], pool: str) -> dict:
    return find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_engines_nixl_over_efa_with_lmcache_tiers(rendered):
    docs = rendered[ROOT / "deploy" / "values-llama-3.3-70b.yaml"]
    for pool in ("prefill", "decode"):
        c = _vllm(docs, pool)
        args = c["args"]
        assert c["command"] == ["vllm", "serve"] and args[0] == "meta-llama/Llama-3.3-70B-Instruct"
        assert _flag(args, "--tensor-parallel-size") == "8"
        assert "--enable-prompt-tokens-details" in args  # what the gateway audits its beliefs against
        kv = json.loads(_flag(args, "--kv-transfer-config"))
        assert kv["kv_connector"] == "MultiConnector" and kv["kv_role"] == "kv_both"
        nixl, lm = kv["kv_connector_extra_config"]["connectors"]  # NIXL first: P/D transfer wins
        assert nixl == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"backends": ["LIBFABRIC"]},
        }  # NIXL's EFA path
        assert lm == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        events = json.loads(_flag(args, "--kv-events-config"))
        assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["FI_PROVIDER"]["value"] == "efa"
        assert env["LMCACHE_CONFIG_FILE"]["value"] == f"/etc/lmcache/{pool}.yaml"
        assert env["LMCACHE_TRACK_USAGE"]["value"] == "false"
        assert env["PYTHONHASHSEED"]["value"] == "0"
        for section in ("requests", "limits"):
            assert c["resources"][section]["nvidia.com/gpu"] == 8
            assert c["resources"][section]["vpc.amazonaws.com/efa"] == 32
        pod = find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    for pool in ("prefill", "decode"):
        lmcache = yaml.safe_load(find(docs, "ConfigMap", "pdgate-lmcache")["data"][f"{pool}.yaml"])
        # LMCache allocates max_local_cpu_size in each of the 8 GPU workers: 45 GB each, 360 GB a pod
        assert lmcache == {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": 45,
            "remote_url": "redis://pdgate-lmcache-l2:6379",  # the L2 Redis this release runs
            "remote_serde": "naive",
        }
        c = _vllm(docs, pool)
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"add": ["IPC_LOCK"]}}
    # the gateway hashes prefixes with the engines' seed and algorithm
    cfg = yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert cfg["routing"]["prefix"] == {"hash_algo": "sha256", "hash_seed": "0"}


def test_small_example_has_plain_nixl_and_no_autoscaler(rendered):
    docs = rendered[ROOT / "deploy" / "values-small.yaml"]
    kv = json.loads(_flag(_vllm(docs, "decode")["args"], "--kv-transfer-config"))
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    # no LMCache
    assert [c["metadata"]["name"] for c in of_kind(docs, "ConfigMap")] == ["pdgate-gateway", "pdgate-preflight"]
    assert "vpc.amazonaws.com/efa" not in _vllm(docs, "prefill")["resources"]["limits"]


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_network_policy_only_lets_the_gateway_and_engines_reach_engines(rendered, pool):
    docs = rendered[ROOT / "deploy" / "values-llama-3.3-70b.yaml"]
    policy = find(docs, "NetworkPolicy", f"pdgate-{pool}")
    engines = find(docs, "Deployment", f"pdgate-{pool}")
    assert policy["spec"]["podSelector"]["matchLabels"] == engines["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers = [p["podSelector"]["matchLabels"] for p in policy["spec"]["ingress"][0]["from"]]
    assert sorted(p["app.kubernetes.io/component"] for p in peers) == ["decode", "gateway", "prefill"]
    assert all(p["app.kubernetes.io/instance"] == "pdgate" for p in peers)  # this release's pods only
    assert "ports" not in policy["spec"]["ingress"][0]  # HTTP, KV events, NIXL side channel and transfer
    monitoring = policy["spec"]["ingress"][1]
    assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert monitoring["ports"] == [{"port": "http", "protocol": "TCP"}]  # metrics only


def test_network_policy_with_service_monitor_needs_the_monitoring_namespace(tools: Tools):
    out = helm_template(tools, "--set", "networkPolicy.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true")
    assert out.returncode != 0
    assert (
        "networkPolicy.enabled with monitoring.serviceMonitor.enabled needs networkPolicy."
        "monitoringNamespaceSelector" in out.stderr
    )
    docs = render(tools, "--set", "networkPolicy.enabled=true")  # no ServiceMonitor: nothing to let in
    assert len(find(docs, "NetworkPolicy", "pdgate-decode")["spec"]["ingress"]) == 1


def test_efa_needs_libfabric_and_efa_devices(tools: Tools):
    out = helm_template(tools, "--set", "efa.enabled=true")
    assert out.returncode != 0 and "efa.enabled needs prefill.efaDevices >= 1" in out.stderr
    devices = ["--set", "prefill.efaDevices=4", "--set", "decode.efaDevices=4"]
    out = helm_template(tools, "--set", "efa.enabled=true", "--set", "nixl.backends={UCX}", *devices)
    assert out.returncode != 0 and "efa.enabled needs NIXL's LIBFABRIC backend" in out.stderr
    docs = render(tools, "--set", "efa.enabled=true", *devices)  # backends left empty: LIBFABRIC
    c = _vllm(docs, "decode")
    kv = json.loads(_flag(c["args"], "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FI_PROVIDER"] == "efa"
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 4
    # without EFA the default stays UCX
    kv = json.loads(_flag(_vllm(render(tools), "decode")["args"], "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"] == {"backends": ["UCX"]}


def test_lmcache_l1_is_split_over_the_gpu_workers_and_fits_the_pod(tools: Tools):
    base = [
        "--set",
        "lmcache.enabled=true",
        "--set",
        "lmcache.l1.sizeGB=100",
        "--set",
        "prefill.tensorParallelSize=4",
        "--set",
        "prefill.gpus=4",
        "--set",
        "prefill.resources.limits.memory=256Gi",
        "--set",
        "decode.resources.limits.memory=200G",
    ]
    docs = render(tools, *base)
    data = find(docs, "ConfigMap", "pdgate-lmcache")["data"]
    assert yaml.safe_load(data["prefill.yaml"])["max_local_cpu_size"] == 25  # 100 GB over 4 workers
    assert yaml.safe_load(data["decode.yaml"])["max_local_cpu_size"] == 100
    # each pool's engines read their own file, and restart when it changes
    for pool in ("prefill", "decode"):
        env = {e["name"]: e.get("value") for e in _vllm(docs, pool)["env"]}
        assert env["LMCACHE_CONFIG_FILE"] == f"/etc/lmcache/{pool}.yaml"
    annotations = [
        find(docs, "Deployment", f"pdgate-{p}")["spec"]["template"]["metadata"]["annotations"]
        for p in ("prefill", "decode")
    ]
    assert annotations[0]["checksum/lmcache"] != annotations[1]["checksum/lmcache"]
    # a pod whose memory limit cannot hold its L1 plus /dev/shm is refused
    out = helm_template(tools, *base, "--set", "decode.resources.limits.memory=100Gi")
    assert out.returncode != 0
    assert "decode: a memory limit of 100Gi cannot hold LMCache's L1 (lmcache.l1.sizeGB 100 GB per pod" in out.stderr
    # only the pools listed load LMCache
    docs = render(tools, *base, "--set", "lmcache.pools={decode}")
    assert set(find(docs, "ConfigMap", "pdgate-lmcache")["data"]) == {"decode.yaml"}
    assert "LMCACHE_CONFIG_FILE" not in {e["name"] for e in _vllm(docs, "prefill")["env"]}


def test_lmcache_l2_url_from_a_secret_never_lands_in_a_configmap(tools: Tools):
    secret_url = [
        "--set",
        "lmcache.enabled=true",
        "--set",
        "lmcache.l2.enabled=true",
        "--set",
        "lmcache.l2.urlSecret.name=lmcache-l2",
    ]
    out = helm_template(tools, *secret_url)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for cm in of_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"] == "pdgate-preflight":
            continue  # the preflight script reads the engines' remote_url (its L2 check); it holds none
        for text in cm.get("data", {}).values():
            assert "remote_url" not in text, cm["metadata"]["name"]
    assert yaml.safe_load(find(docs, "ConfigMap", "pdgate-lmcache")["data"]["decode.yaml"])["remote_serde"] == "naive"
    for pool in ("prefill", "decode"):
        env = {e["name"]: e for e in _vllm(docs, pool)["env"]}
        # LMCache reads LMCACHE_CONFIG_FILE, then applies LMCACHE_* variables over it
        assert env["LMCACHE_REMOTE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "lmcache-l2", "key": "url"}}
    out = helm_template(tools, *secret_url, "--set", "lmcache.l2.url=redis://r:6379")
    assert out.returncode != 0 and "lmcache.l2: url and urlSecret.name are all set; choose one store" in out.stderr


def test_engines_drain_before_sigterm_and_roll_without_an_outage(rendered, tools: Tools):
    small = rendered[ROOT / "deploy" / "values-small.yaml"]
    for pool in ("prefill", "decode"):
        dep = find(small, "Deployment", f"pdgate-{pool}")
        pod = dep["spec"]["template"]["spec"]
        [c] = pod["containers"]
        # the EndpointSlice removal reaches the gateway before vLLM stops taking requests
        assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "15"]}}
        assert pod["terminationGracePeriodSeconds"] > 15
        assert c["securityContext"] == {"allowPrivilegeEscalation": False}
        # a single engine is replaced surge-first: the pool is never empty during an upgrade
        assert dep["spec"]["replicas"] == 1
        assert dep["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
    assert not of_kind(small, "PodDisruptionBudget")
    big = rendered[ROOT / "deploy" / "values-llama-3.3-70b.yaml"]  # minReplicas 2: one at a time, no spare GPUs
    assert find(big, "Deployment", "pdgate-decode")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    pdb = find(big, "PodDisruptionBudget", "pdgate-prefill")
    selector = find(big, "Deployment", "pdgate-prefill")["spec"]["selector"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": selector, "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    docs = render(
        tools,
        "--set",
        "engines.preStopSleepSeconds=0",
        "--set",
        "decode.replicas=2",
        "--set",
        "decode.strategy.type=Recreate",
    )
    assert "lifecycle" not in _vllm(docs, "decode")
    assert find(docs, "Deployment", "pdgate-decode")["spec"]["strategy"] == {"type": "Recreate"}
    assert find(docs, "Deployment", "pdgate-prefill")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1


def test_gpu_count_comes_from_gpus_only(tools: Tools):
    out = helm_template(
        tools, "--set", "prefill.resources.limits.nvidia\\.com/gpu=1", "--show-only", "templates/engines.yaml"
    )
    assert out.returncode == 0, out.stderr
    prefill = [d for d in out.stdout.split("\n---") if "kind: Deployment" in d and "name: pdgate-prefill" in d]
    assert prefill[0].count("nvidia.com/gpu:") == 2  # requests and limits, no duplicate key
    out = helm_template(tools, "--set", "prefill.resources.limits.nvidia\\.com/gpu=2")
    assert out.returncode != 0
    assert "prefill.resources.limits sets nvidia.com/gpu to 2 but prefill.gpus is 1" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "gateway.replicas=two"], "gateway.replicas: Invalid type. Expected: integer, given: string"),
        (["--set", "prefill.gpus=0"], "prefill.gpus: Must be greater than or equal to 1"),
        (
            [
                "--set",
                "decode.autoscaling.metrics[0].name=gpu_busy,decode.autoscaling.metrics[0].aggregate=max,"
                "decode.autoscaling.metrics[0].type=Value,decode.autoscaling.metrics[0].target=1",
            ],
            "decode.autoscaling.metrics.0.name: decode.autoscaling.metrics.0.name must be one of the following",
        ),
        (["--set", "gateway.replica=3"], "Additional property replica is not allowed"),
        (["--set", "nixl.backends={EFA}"], "nixl.backends.0: nixl.backends.0 must be one of the following"),
        (["--set", "model.cache.type=hostPath"], "model.cache.hostPath: String length must be greater"),
    ],
)
def test_schema_rejects_wrong_values_with_a_clear_message(tools: Tools, args, message):
    out = helm_template(tools, *args)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr, out.stderr


def test_a_bad_gateway_setting_fails_in_the_gateway_validator(tools: Tools, tmp_path, capsys):
    """gateway.config is free-form in the schema: the gateway's own validator is its check."""
    docs = render(tools, "--set", "gateway.config.admission.max_in_flight=-1")
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert pdgate(["check-config", str(path), "--no-tokenizers"]) == 1
    assert "admission.max_in_flight: Input should be greater than or equal to 0" in capsys.readouterr().err


def test_no_decode_engines_is_refused(tools: Tools):
    out = helm_template(tools, "--set", "decode.enabled=false")
    assert out.returncode != 0 and "gateway: no decode engines" in out.stderr


def test_grafana_dashboard_configmap(tools: Tools):
    dashboard = CHART / "files" / "pdgate-dashboard.json"
    source = ROOT / "deploy" / "grafana" / "pdgate-dashboard.json"
    if dashboard.exists() and source.exists():  # the chart's copy follows the dashboard
        assert json.loads(dashboard.read_text()) == json.loads(source.read_text())
    out = helm_template(tools, "--set", "monitoring.grafanaDashboard.enabled=true")
    if not dashboard.exists():
        assert out.returncode != 0 and "has no files/pdgate-dashboard.json" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cm = find(docs, "ConfigMap", "pdgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdgate-dashboard.json"]) == json.loads(dashboard.read_text())


def render_notes(tools: Tools, tmp_path: Path, values: Path) -> str:
    """NOTES.txt as `helm install` prints it. helm renders NOTES only while installing, which needs
    a cluster, so a copy of the chart renders the same text as a template."""
    chart = tmp_path / "pdgate"
    shutil.copytree(CHART, chart)
    notes = chart / "templates" / "NOTES.txt"
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + notes.read_text() + "{{- end -}}\n")
    notes.unlink()
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ include "notes" . | toJson }}\n'
    )
    out = subprocess.run(
        [
            str(tools.helm),
            "template",
            "pdgate",
            str(chart),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            "-f",
            str(values),
            "--show-only",
            "templates/notes.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["data"]["notes"]


def test_notes_say_how_to_reach_the_gateway_and_send_a_first_request(tools: Tools, tmp_path):
    notes = render_notes(tools, tmp_path, ROOT / "deploy" / "values-llama-3.3-70b.yaml")
    assert "kubectl -n llm port-forward svc/pdgate-gateway 8000:80" in notes
    assert "curl -s localhost:8000/ready" in notes
    assert "get svc pdgate-gateway -o jsonpath='{.status.loadBalancer.ingress[0].hostname}'" in notes
    assert '"model": "llama-3.3-70b"' in notes and "localhost:8000/v1/chat/completions" in notes
    assert "get secret pdgate-api-keys -o jsonpath='{.data.api-keys}'" in notes  # the request carries a key
    assert "Prompts of 4096+ uncached tokens go prefill -> decode" in notes
    assert "in the running engines, and that every LMCache engine reaches its L2 store):" in notes
    small = render_notes(tools, tmp_path / "small", ROOT / "deploy" / "values-small.yaml")
    assert "Authorization" not in small and "loadBalancer" not in small
    assert "prefill -> decode in the running engines):" in small  # no L2


def test_hyperpod_example_turns_dpd_on_with_pdspec():
    doc = yaml.safe_load((ROOT / "deploy" / "hyperpod" / "inference-endpoint-config.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("inference.sagemaker.aws.amazon.com/v1", "InferenceEndpointConfig")
    spec = doc["spec"]
    assert {"modelName", "modelSourceConfig", "worker"} <= set(spec)  # the resource's required fields
    pd = spec["pdSpec"]
    for role in ("prefillSpec", "decodingSpec"):
        assert pd[role]["replicas"] >= 1
        assert pd[role]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
    assert pd["routingThreshold"] == 4096
    # the pdSpec fields the operator's CRD (v1) defines; anything else would be pruned or refused
    assert set(pd) <= {"prefillSpec", "decodingSpec", "routingThreshold", "topologySpec", "autoScalingSpec"}
    for role in ("prefillSpec", "decodingSpec"):
        assert set(pd[role]) <= {"replicas", "args", "resources", "nodeSelector"}
    assert set(pd["topologySpec"]) <= {"sameAZ", "availabilityZone", "placementGroup"}
    readme = (ROOT / "deploy" / "hyperpod" / "README.md").read_text()
    assert "**Confirmed from source.**" in readme and "**From AWS documentation only**" in readme
    for field in (
        "pdSpec.prefillSpec.replicas",
        "pdSpec.routingThreshold",
        "pdSpec.autoScalingSpec",
        "kvCacheSpec.enableL1Cache",
        "pdSpec.topologySpec.sameAZ",
    ):
        assert field in readme


@pytest.mark.parametrize(
    ("values", "workers"),
    [
        ((), 2),  # the default CPU request, "2"
        (("--set-string", "gateway.resources.requests.cpu=1500m"), 2),
        (("--set-string", "gateway.resources.requests.cpu=500m"), 1),
        (("--set", "gateway.workers=3"), 3),
    ],
)
def test_gateway_workers_follow_the_cpu_request(tools: Tools, values, workers):
    """Inside a container the gateway may see every core of the node: the chart sets the count."""
    docs = render(tools, *values)
    config = yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert config["server"]["workers"] == workers


def test_planner_signal_scales_each_pool_toward_the_desired_split(tools: Tools, tmp_path):
    """autoscaling.signal=planner: the gateway runs its live planner and both pools follow
    pdgate_pool_desired_engines (summed over gateway replicas, one replica per unit)."""
    big = ROOT / "deploy" / "values-llama-3.3-70b.yaml"
    docs = render(tools, "--set", "autoscaling.signal=planner", "--set", "planner.tail=true", values=big)
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    cfg = load_config(path)
    assert cfg.planner.enabled and cfg.planner.tail and cfg.planner.profile == "llama-3.3-70b-tp8-h100"
    for pool in ("prefill", "decode"):
        hpa = find(docs, "HorizontalPodAutoscaler", f"pdgate-{pool}")
        assert _hpa_metrics(hpa) == [
            (
                "pdgate_pool_desired_engines",
                {"app_kubernetes_io_instance": "pdgate", "pool": pool},
                {"type": "AverageValue", "averageValue": "1"},
            )
        ]
    docs = render(tools, "--set", "autoscaling.signal=planner", "--set", "autoscaling.backend=keda", values=big)
    trigger = find(docs, "ScaledObject", "pdgate-decode")["spec"]["triggers"]
    assert [(t["metricType"], t["metadata"]["query"], t["metadata"]["threshold"]) for t in trigger] == [
        (
            "AverageValue",
            "sum(max by (pool, pod) (pdgate_pool_desired_engines{"
            'app_kubernetes_io_instance="pdgate",namespace="llm",pool="decode"}))',
            "1",
        )
    ]
    # the default: the pools' own signals, and no planner in the gateway
    cfg = yaml.safe_load(find(render(tools, values=big), "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert "planner" not in cfg
    bad = helm_template(tools, "--set", "autoscaling.signal=guess")
    assert bad.returncode != 0 and "signal" in bad.stderr
