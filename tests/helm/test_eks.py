"""The chart on EKS for real (issue 17): engines that move KV over EFA (the EFA engine image, hugepages,
UCX with a CUDA transport), the preflight (init check and helm test), the gateway behind an NLB,
autoscaling signals per release, validation across values, engine identity and probes, extension
points, placement and topology-aware pairing, model loading, and multi-node engines (LeaderWorkerSet:
kubernetes-validate only warns on custom resources, so their structure is asserted here)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from gateway.config import load_config

from .conftest import CHART, KUBE_VERSION, ROOT, Tools
from .test_chart import find, helm_template, of_kind, render

BIG = ROOT / "deploy" / "values-llama-3.3-70b.yaml"
SMALL = ROOT / "deploy" / "values-small.yaml"
MULTI = ROOT / "deploy" / "values-llama-3.1-405b-multinode.yaml"
EFA = ["--set", "efa.enabled=true", "--set", "prefill.efaDevices=4", "--set", "decode.efaDevices=4"]
SCRIPT = "/opt/pdgate/preflight/preflight.py"


def pod(docs: list[dict], pool: str) -> dict:
    return find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]


def container(docs: list[dict], pool: str) -> dict:
    [c] = pod(docs, pool)["containers"]
    return c


def env(c: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def gateway_config(docs: list[dict]) -> dict:
    return yaml.safe_load(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])


def refused(tools: Tools, *args: str, values=None) -> str:
    out = helm_template(tools, *args, values=values)
    assert out.returncode != 0, "rendered, but should have been refused"
    return out.stderr


# 1. the three defects ------------------------------------------------------------------------------


def test_70b_example_runs_the_efa_engine_image_with_hugepages_and_the_preflight(tools: Tools):
    docs = render(tools, values=BIG)
    for pool in ("prefill", "decode"):
        spec, c = pod(docs, pool), container(docs, pool)
        # the image built from deploy/engine-image/Dockerfile, not stock vLLM (no EFA libraries)
        assert c["image"] == "ACCOUNT.dkr.ecr.REGION.amazonaws.com/pdgate-vllm-efa:v0.32.0-efa1.51.0"
        kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert kv["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"] == {
            "backends": ["LIBFABRIC"]
        }
        for section in ("requests", "limits"):  # hugetlb allowance: AWS's EFA pod examples' 5120Mi
            assert c["resources"][section]["hugepages-2Mi"] == "5120Mi"
        assert "FI_EFA_USE_HUGE_PAGE" not in env(c)
        # the init check: the engine image, the same GPUs / EFA devices / huge pages as vLLM
        [init] = spec["initContainers"]
        assert init["name"] == "preflight" and init["image"] == c["image"]
        assert init["command"] == [
            "python3",
            SCRIPT,
            "check",
            "--backend",
            "LIBFABRIC",
            "--efa-devices",
            "32",
            "--device",
            "cuda",
        ]
        for section in ("requests", "limits"):
            for res in ("nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi"):
                assert init["resources"][section][res] == c["resources"][section][res]
        assert init["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
        assert env(init)["FI_PROVIDER"] == "efa"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/opt/pdgate/preflight"]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["preflight"]["configMap"]["name"] == "pdgate-preflight"
    script = find(docs, "ConfigMap", "pdgate-preflight")["data"]["preflight.py"]
    assert script == (CHART / "files" / "preflight.py").read_text()
    # the example says the image is a placeholder, and how to set it
    header = BIG.read_text()
    assert "PLACEHOLDER" in header and "--set engines.image.repository=" in header


def test_without_hugepages_libfabric_is_told_not_to_use_them(tools: Tools):
    docs = render(tools, *EFA, "--set", "efa.hugepages2Mi=")
    for pool in ("prefill", "decode"):
        c, spec = container(docs, pool), pod(docs, pool)
        assert "hugepages-2Mi" not in c["resources"]["limits"]
        assert env(c)["FI_EFA_USE_HUGE_PAGE"] == "0"
        assert env(spec["initContainers"][0])["FI_EFA_USE_HUGE_PAGE"] == "0"
        assert "hugepages" not in {v["name"] for v in spec["volumes"]}
    # the user's own setting is not duplicated
    docs = render(
        tools,
        *EFA,
        "--set",
        "efa.hugepages2Mi=",
        "--set",
        "decode.extraEnv[0].name=FI_EFA_USE_HUGE_PAGE",
        "--set-string",
        "decode.extraEnv[0].value=1",
    )
    names = [e["name"] for e in container(docs, "decode")["env"]]
    assert names.count("FI_EFA_USE_HUGE_PAGE") == 1 and env(container(docs, "decode"))["FI_EFA_USE_HUGE_PAGE"] == "1"


def test_ucx_needs_a_cuda_transport(tools: Tools):
    small = render(tools, values=SMALL)
    tls = env(container(small, "decode"))["UCX_TLS"]
    assert "cuda_copy" in tls.split(",")  # llm-d's sm,cuda_ipc,cuda_copy,tcp
    err = refused(tools, "--set", "nixl.env[0].name=UCX_TLS", "--set", "nixl.env[0].value=tcp\\,self\\,sm")
    assert "prefill: UCX_TLS=tcp,self,sm has no CUDA transport" in err and "cuda_copy" in err
    # the value the container ends with counts: a pool's extraEnv overrides nixl.env
    err = refused(
        tools, "--set", "decode.extraEnv[0].name=UCX_TLS", "--set", "decode.extraEnv[0].value=tcp", values=SMALL
    )
    assert "decode: UCX_TLS=tcp has no CUDA transport" in err
    assert "UCX_TLS=^cuda_copy" in refused(
        tools, "--set", "engines.extraEnv[0].name=UCX_TLS", "--set", "engines.extraEnv[0].value=^cuda_copy"
    )
    for fine in ("all", "^rc\\,ud", "tcp\\,cuda"):
        render(tools, "--set", "nixl.env[0].name=UCX_TLS", "--set", f"nixl.env[0].value={fine}")
    # EFA with LIBFABRIC: UCX_TLS does not matter
    render(tools, *EFA, "--set", "nixl.env[0].name=UCX_TLS", "--set", "nixl.env[0].value=tcp")


# 2. the gateway behind an NLB ----------------------------------------------------------------------


def test_gateway_waits_for_the_load_balancer_before_stopping(tools: Tools):
    docs = render(tools)
    spec = find(docs, "Deployment", "pdgate-gateway")["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "10"]}}
    assert spec["terminationGracePeriodSeconds"] == 50  # preStop + 40 s of draining
    spec = find(render(tools, "--set", "gateway.preStopSleepSeconds=0"), "Deployment", "pdgate-gateway")["spec"][
        "template"
    ]["spec"]
    assert "lifecycle" not in spec["containers"][0] and spec["terminationGracePeriodSeconds"] == 40
    readme = (ROOT / "deploy" / "eks" / "README.md").read_text()
    assert "elbv2.k8s.aws/pod-readiness-gate-inject=enabled" in readme


def test_pod_annotations_override_the_scrape_hints_without_duplicate_keys(tools: Tools):
    out = helm_template(
        tools,
        "--set-string",
        "gateway.podAnnotations.prometheus\\.io/scrape=false",
        "--set-string",
        "gateway.podAnnotations.team=llm",
        "--show-only",
        "templates/gateway-deployment.yaml",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("prometheus.io/scrape") == 1  # a YAML mapping with one key, not two
    annotations = yaml.safe_load(out.stdout)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "false",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
        "team": "llm",
    }


# 3. autoscaling signals ----------------------------------------------------------------------------


def test_autoscalers_follow_their_own_release_only(tools: Tools):
    out = helm_template(tools, values=BIG).stdout
    # another release of the chart in the same namespace
    cmd = [
        str(tools.helm),
        "template",
        "other",
        str(CHART),
        "--namespace",
        "llm",
        "--kube-version",
        KUBE_VERSION,
        "-f",
        str(BIG),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for text, release in ((out, "pdgate"), (run.stdout, "other")):
        docs = [d for d in yaml.safe_load_all(text) if d]
        for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
            for m in hpa["spec"]["metrics"]:
                assert m["external"]["metric"]["selector"]["matchLabels"]["app_kubernetes_io_instance"] == release
        sm = next(d for d in of_kind(docs, "ServiceMonitor") if d["metadata"]["name"].endswith("-gateway"))
        assert sm["spec"]["podTargetLabels"] == ["app.kubernetes.io/instance"]  # the label the HPAs match
    docs = render(tools, "--set", "autoscaling.releaseLabel=", values=BIG)
    hpa = find(docs, "HorizontalPodAutoscaler", "pdgate-decode")
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"] == {"pool": "decode"}


# 4. validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "prefill.tensorParallelSize=2"],
            "prefill: gpus is 1 but tensorParallelSize 2 x pipelineParallelSize 1 = 2",
        ),
        (
            ["--set", "decode.gpus=8", "--set", "decode.tensorParallelSize=4"],
            "decode: gpus is 8 but tensorParallelSize 4 x pipelineParallelSize 1 = 4",
        ),
        (["--set", "decode.extraArgs={--tensor-parallel-size,2}"], "decode.extraArgs sets --tensor-parallel-size"),
        (["--set", "decode.extraArgs={-tp=2}"], "decode.extraArgs sets -tp"),
        (
            ["--set", "prefill.autoscaling.enabled=true", "--set", "prefill.autoscaling.minReplicas=5"],
            "prefill.autoscaling: minReplicas 5 is above maxReplicas 4",
        ),
        (
            ["--set", "decode.terminationGracePeriodSeconds=15"],
            "must stay below decode.terminationGracePeriodSeconds (15)",
        ),
        (
            ["--set", "prefill.podLabels.app\\.kubernetes\\.io/component=decode"],
            "prefill.podLabels sets app.kubernetes.io/component",
        ),
        (
            [
                "--set",
                "prefill.multiNode.enabled=true",
                "--set",
                "prefill.gpus=8",
                "--set",
                "prefill.tensorParallelSize=8",
            ],
            "prefill: 8 GPUs per pod x multiNode.size 2 = 16 GPUs, "
            "but tensorParallelSize 8 x pipelineParallelSize 1 = 8",
        ),
    ],
)
def test_values_that_cannot_work_together_are_refused(tools: Tools, args, message):
    assert message in refused(tools, *args)


def test_pipeline_parallel_counts_in_the_gpu_check(tools: Tools):
    docs = render(
        tools,
        "--set",
        "decode.gpus=4",
        "--set",
        "decode.tensorParallelSize=2",
        "--set",
        "decode.pipelineParallelSize=2",
    )
    args = container(docs, "decode")["args"]
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in container(docs, "prefill")["args"]  # 1: vLLM's default, unchanged


@pytest.mark.parametrize(
    ("flag", "value", "rendered"),
    [
        ("--set", "0.85", "0.85"),
        ("--set-string", "0.85", "0.85"),
        ("--set-string", ".8", ".8"),
        ("--set", "1", "1"),
    ],
)
def test_gpu_memory_utilization_as_number_or_string(tools: Tools, flag, value, rendered):
    args = container(render(tools, flag, f"decode.gpuMemoryUtilization={value}"), "decode")["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == rendered


@pytest.mark.parametrize("flag", ["--set", "--set-string"])
def test_out_of_range_fractions_are_refused_with_the_rule(tools: Tools, flag):
    err = refused(tools, flag, "decode.gpuMemoryUtilization=1.5")
    assert "decode.gpuMemoryUtilization" in err and "values don't meet the specifications of the schema" in err
    assert "planner.target" in refused(tools, flag, "planner.target=0")


def test_planner_target_given_as_a_string_reaches_the_gateway_as_a_number(tools: Tools, tmp_path):
    docs = render(tools, "--set", "planner.enabled=true", "--set-string", "planner.target=0.95")
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    assert gateway_config(docs)["planner"]["target"] == 0.95
    assert load_config(path).planner.target == 0.95


def test_decimals_given_with_set_reach_the_gateway_and_lmcache_as_numbers(tools: Tools, tmp_path):
    """helm --set passes 1.5 as a string: the schema takes it, the rendered configs carry numbers."""
    docs = render(
        tools,
        "--set",
        "planner.enabled=true",
        "--set",
        "planner.windowSeconds=120.5",
        "--set",
        "planner.slos[0].ttft_s=1.5",
        "--set",
        "planner.slos[0].itl_p90_s=0.05",
        "--set",
        "lmcache.enabled=true",
        "--set",
        "lmcache.l1.sizeGB=1.5",
    )
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"])
    planner = load_config(path).planner
    assert planner.window_s == 120.5 and gateway_config(docs)["planner"]["slos"] == [{"ttft_s": 1.5, "itl_p90_s": 0.05}]
    lmcache = yaml.safe_load(find(docs, "ConfigMap", "pdgate-lmcache")["data"]["decode.yaml"])
    assert lmcache["max_local_cpu_size"] == 1.5
    assert "lmcache.l1.sizeGB" in refused(tools, "--set", "lmcache.enabled=true", "--set", "lmcache.l1.sizeGB=lots")


def test_a_hash_seed_of_0_given_with_set_still_reaches_the_gateway(tools: Tools):
    """--set engines.pythonHashSeed=0 is the integer 0: the gateway must still hash with seed "0"."""
    docs = render(tools, "--set", "engines.pythonHashSeed=0")
    assert gateway_config(docs)["routing"]["prefix"]["hash_seed"] == "0"
    assert env(container(docs, "decode"))["PYTHONHASHSEED"] == "0"


# 5. engines: identity, disk, grace, probes --------------------------------------------------------


def test_engine_service_account_for_irsa_and_pod_identity(tools: Tools):
    docs = render(tools)
    assert "serviceAccountName" not in pod(docs, "decode")
    assert pod(docs, "decode")["automountServiceAccountToken"] is False
    role = "arn:aws:iam::111122223333:role/pdgate-engines"
    docs = render(
        tools,
        "--set",
        "engines.serviceAccount.create=true",
        "--set",
        f"engines.serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn={role}",
    )
    sa = find(docs, "ServiceAccount", "pdgate-engines")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": role}
    assert sa["automountServiceAccountToken"] is False  # IRSA / Pod Identity mount their own token
    for pool in ("prefill", "decode"):
        assert pod(docs, pool)["serviceAccountName"] == "pdgate-engines"
        assert pod(docs, pool)["automountServiceAccountToken"] is False
    docs = render(
        tools, "--set", "engines.serviceAccount.name=s3-reader", "--set", "engines.serviceAccount.automountToken=true"
    )
    created = sorted(s["metadata"]["name"] for s in of_kind(docs, "ServiceAccount"))
    assert created == ["pdgate-gateway", "pdgate-preflight-test"]  # the existing one is used, not made
    assert pod(docs, "prefill")["serviceAccountName"] == "s3-reader"
    assert pod(docs, "prefill")["automountServiceAccountToken"] is True


def test_emptydir_model_cache_is_requested_as_ephemeral_storage(tools: Tools):
    c = container(render(tools, values=SMALL), "decode")
    # model.cache.sizeLimit + engines.compileCache.sizeLimit (both emptyDirs on the node's disk)
    assert c["resources"]["requests"]["ephemeral-storage"] == "40Gi"
    assert "ephemeral-storage" not in c["resources"]["limits"]
    # a pvc model cache: only the compile cache
    assert container(render(tools, values=BIG), "decode")["resources"]["requests"]["ephemeral-storage"] == "20Gi"
    assert (
        "ephemeral-storage"
        not in container(render(tools, "--set", "engines.compileCache.type=none", values=BIG), "decode")["resources"][
            "requests"
        ]
    )
    c = container(render(tools, "--set", "decode.resources.requests.ephemeral-storage=300Gi"), "decode")
    assert c["resources"]["requests"]["ephemeral-storage"] == "300Gi"


def test_engine_grace_period_and_probes_are_configurable_and_patient(tools: Tools):
    c = container(render(tools), "decode")
    ready = c["readinessProbe"]
    # a busy engine's slow /health: ~30 s of failures before it leaves the pools
    assert ready["timeoutSeconds"] >= 10 and ready["periodSeconds"] * ready["failureThreshold"] >= 30
    docs = render(
        tools,
        "--set",
        "decode.terminationGracePeriodSeconds=300",
        "--set",
        "engines.probes.readiness.failureThreshold=10",
        "--set",
        "engines.probes.liveness.timeoutSeconds=30",
    )
    assert pod(docs, "decode")["terminationGracePeriodSeconds"] == 300
    assert pod(docs, "prefill")["terminationGracePeriodSeconds"] == 120
    assert container(docs, "decode")["readinessProbe"]["failureThreshold"] == 10
    assert container(docs, "decode")["livenessProbe"]["timeoutSeconds"] == 30
    # the API server takes a liveness probe only with successThreshold 1: refused at install
    assert "engines.probes.liveness.successThreshold" in refused(
        tools, "--set", "engines.probes.liveness.successThreshold=2"
    )


# 6. extension points ------------------------------------------------------------------------------

EXTENSIONS = {
    "podLabels": {"team": "llm"},
    "podAnnotations": {"example.com/owner": "platform"},
    "schedulerName": "gpu-scheduler",
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-high",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
    "extraVolumes": [{"name": "extra", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
    "extraEnv": [{"name": "EXTRA", "value": "1"}],
}


def test_extension_points_have_the_same_names_everywhere_and_render_when_set(tools: Tools, tmp_path):
    values = tmp_path / "ext.yaml"
    values.write_text(yaml.safe_dump({c: EXTENSIONS for c in ("gateway", "prefill", "decode")}))
    docs = render(tools, "-f", str(values), *EFA)
    for name in ("gateway", "prefill", "decode"):
        template = find(docs, "Deployment", f"pdgate-{name}")["spec"]["template"]
        spec, main = template["spec"], template["spec"]["containers"][0]
        assert template["metadata"]["labels"]["team"] == "llm"
        assert template["metadata"]["labels"]["app.kubernetes.io/component"] == name
        assert template["metadata"]["annotations"]["example.com/owner"] == "platform"
        for key in ("schedulerName", "runtimeClassName", "priorityClassName", "topologySpreadConstraints"):
            assert spec[key] == EXTENSIONS[key], (name, key)
        assert spec["initContainers"][0]["name"] == "warm"  # before the chart's preflight check
        assert {"name": "extra", "emptyDir": {}} in spec["volumes"]
        assert {"name": "extra", "mountPath": "/extra"} in main["volumeMounts"]
        assert env(main)["EXTRA"] == "1"
    assert [c["name"] for c in pod(docs, "decode")["initContainers"]] == ["warm", "preflight"]
    # none of them by default
    spec = pod(render(tools), "decode")
    assert not {
        "schedulerName",
        "runtimeClassName",
        "priorityClassName",
        "topologySpreadConstraints",
        "initContainers",
    } & set(spec)
    # the schema knows each of them on each component
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    for name in ("gateway", "prefill", "decode"):
        assert set(EXTENSIONS) <= set(schema[name]["properties"]), name


# 9. placement and pairing -------------------------------------------------------------------------

ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]}


def test_placement_keeps_both_pools_in_one_zone(tools: Tools, tmp_path):
    assert "affinity" not in pod(render(tools), "decode")
    docs = render(tools, "--set", "placement.zone=us-east-1a", "--set", "placement.nodeSelector.pg=pd-1")
    for pool in ("prefill", "decode"):
        spec = pod(docs, pool)
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [ZONE]}]
        assert spec["nodeSelector"] == {"pg": "pd-1"}
    # the zone joins each of the pool's own (ORed) terms, and its other affinity stays
    values = tmp_path / "aff.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "decode": {
                    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                                    {"matchExpressions": [{"key": "b", "operator": "Exists"}]},
                                ]
                            }
                        },
                        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
                    },
                }
            }
        )
    )
    spec = pod(
        render(
            tools, "-f", str(values), "--set", "placement.zone=us-east-1a", "--set", "placement.nodeSelector.pg=pd-1"
        ),
        "decode",
    )
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"] for t in terms] == [
        [{"key": "a", "operator": "Exists"}, ZONE],
        [{"key": "b", "operator": "Exists"}, ZONE],
    ]
    assert "podAntiAffinity" in spec["affinity"]
    assert spec["nodeSelector"] == {"pg": "pd-1", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert "placement.zone" in refused(tools, "--set", "placement.zone=not a zone")


DEFAULT_SCORERS = [{"name": "prefix_affinity", "weight": 2}, {"name": "load", "weight": 1}]


def test_pairing_modes_in_the_gateway_config_and_rbac(tools: Tools, tmp_path):
    cfg = gateway_config(render(tools))  # default: zone
    assert cfg["routing"]["prefill"] == {"filters": [{"name": "same_zone"}], "scorers": DEFAULT_SCORERS}
    assert "decode" not in cfg["routing"] and cfg["routing"]["decider"]["name"] == "token_threshold"
    assert all("node_labels" not in p["discovery"] for p in cfg["pools"].values())
    docs = render(tools, "--set", "placement.pairing=spine")
    cfg = gateway_config(docs)
    spine = "topology.k8s.aws/network-node-layer-3"
    assert cfg["routing"]["prefill"]["scorers"] == [
        *DEFAULT_SCORERS,
        {"name": "topology", "weight": 2, "levels": ["topology.kubernetes.io/zone", spine]},
    ]
    assert cfg["routing"]["prefill"]["filters"] == [{"name": "same_zone"}]
    for p in cfg["pools"].values():
        assert p["discovery"]["node_labels"] == [spine]
    role = find(docs, "ClusterRole", "llm-pdgate-gateway")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = find(docs, "ClusterRoleBinding", "llm-pdgate-gateway")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdgate-gateway", "namespace": "llm"}]
    assert binding["roleRef"]["name"] == "llm-pdgate-gateway"
    # the gateway's own loader takes each mode's config
    for mode in ("zone", "spine", "off"):
        path = tmp_path / f"{mode}.yaml"
        path.write_text(
            find(render(tools, "--set", f"placement.pairing={mode}"), "ConfigMap", "pdgate-gateway")["data"][
                "config.yaml"
            ]
        )
        load_config(path)
    docs = render(tools, "--set", "placement.pairing=off")
    assert "prefill" not in gateway_config(docs)["routing"] and not of_kind(docs, "ClusterRole")
    assert not of_kind(render(tools), "ClusterRole")
    # gateway.config is merged over (lists replace)
    cfg = gateway_config(
        render(
            tools,
            "--set",
            "gateway.config.routing.prefill.filters[0].name=same_zone",
            "--set",
            "gateway.config.routing.prefill.filters[0].strict=false",
        )
    )
    assert cfg["routing"]["prefill"]["filters"] == [{"name": "same_zone", "strict": False}]


# 10. preflight -------------------------------------------------------------------------------------


def test_helm_test_pairs_decode_with_prefill_engines_over_the_pools_backend(tools: Tools):
    docs = render(tools, values=BIG)
    hooks = [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    # one test hook, kept after its run: `helm test --logs` reads every test hook's pod by name once
    # the hooks ran (a deleted pod, or RBAC hooks of the same name, fail it: helm/helm#9098)
    assert [d["kind"] for d in hooks] == ["Pod"]
    assert hooks[0]["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation"
    for kind in ("ServiceAccount", "Role", "RoleBinding"):  # part of the release
        assert "annotations" not in find(docs, kind, "pdgate-preflight-test")["metadata"]
    role = find(docs, "Role", "pdgate-preflight-test")  # its rules: test_preflight_pairs.py
    assert {r["resources"][0] for r in role["rules"]} == {"endpointslices", "pods", "pods/exec"}
    test = find(docs, "Pod", "pdgate-preflight-test")
    assert test["spec"]["serviceAccountName"] == "pdgate-preflight-test" and test["spec"]["restartPolicy"] == "Never"
    [c] = test["spec"]["containers"]
    e = env(c)
    assert (e["PREFILL_SERVICE"], e["DECODE_SERVICE"]) == ("pdgate-prefill", "pdgate-decode")
    assert e["MAX_PAIRS"] == "4" and e["PORT"] == "5650"
    script = c["command"][2]
    args = "--backend LIBFABRIC --size-mib 64 --timeout 120 --device cuda"
    assert f'exec "$p" -c vllm -- python3 {SCRIPT} serve {args} --port "$PORT"' in script
    assert f'exec "$d" -c vllm -- python3 {SCRIPT} pull {args} --peer "$ip:$PORT"' in script
    assert 'head -n "$MAX_PAIRS"' in script and 'exit "$failed"' in script
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and test["spec"]["securityContext"]["runAsNonRoot"]
    # the NetworkPolicy lets engines reach each other on every port (the test port included)
    for pool in ("prefill", "decode"):
        rule = find(docs, "NetworkPolicy", f"pdgate-{pool}")["spec"]["ingress"][0]
        assert "ports" not in rule
        assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in rule["from"]} >= {
            "prefill",
            "decode",
        }
    # UCX without EFA; no init check unless asked for
    docs = render(tools, values=SMALL)
    assert "--backend UCX" in find(docs, "Pod", "pdgate-preflight-test")["spec"]["containers"][0]["command"][2]
    assert "initContainers" not in pod(docs, "decode")
    init = pod(render(tools, "--set", "preflight.initContainer=always", values=SMALL), "decode")["initContainers"][0]
    assert init["command"] == ["python3", SCRIPT, "check", "--backend", "UCX", "--device", "cuda"]
    assert "vpc.amazonaws.com/efa" not in init["resources"]["limits"]
    # off
    assert "initContainers" not in pod(render(tools, "--set", "preflight.initContainer=never", values=BIG), "decode")
    docs = render(tools, "--set", "preflight.test.enabled=false")
    assert not of_kind(docs, "Pod") and find(docs, "ConfigMap", "pdgate-preflight")
    docs = render(tools, "--set", "preflight.enabled=false", values=BIG)
    assert not of_kind(docs, "Pod") and "initContainers" not in pod(docs, "decode")
    assert "preflight" not in {v["name"] for v in pod(docs, "decode")["volumes"]}


# 11. model loading ---------------------------------------------------------------------------------


def test_preload_job_fills_the_shared_cache_before_install(tools: Tools):
    docs = render(tools, "--set", "model.preload.enabled=true", values=BIG)
    job = find(docs, "Job", "pdgate-model-preload")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    spec = job["spec"]["template"]["spec"]
    [c] = spec["containers"]
    assert c["image"] == container(docs, "decode")["image"]
    assert env(c)["MODEL"] == "meta-llama/Llama-3.3-70B-Instruct" and env(c)["HF_HOME"] == "/models/huggingface"
    assert {e["name"]: e for e in c["env"]}["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    assert "hf download" in c["command"][2] and "huggingface-cli download" in c["command"][2]
    assert spec["volumes"] == [{"name": "models", "persistentVolumeClaim": {"claimName": "models-fsx"}}]
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert "model.preload needs model.cache.type pvc" in refused(tools, "--set", "model.preload.enabled=true")


def test_run_ai_streamer_from_s3(tools: Tools):
    s3 = ["--set", "model.id=s3://models/llama-3.3-70b", "--set", "model.tokenizer=meta-llama/Llama-3.3-70B-Instruct"]
    docs = render(tools, *s3, "--set", "model.loadFormat=runai_streamer", "--set", "model.streamer.concurrency=32")
    c = container(docs, "decode")
    assert c["args"][0] == "s3://models/llama-3.3-70b"
    assert c["args"][c["args"].index("--load-format") + 1] == "runai_streamer"
    assert env(c)["RUNAI_STREAMER_CONCURRENCY"] == "32"
    assert gateway_config(docs)["models"][0]["tokenizer"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert "loadFormat runai_streamer" in refused(tools, *s3)
    assert "set model.tokenizer" in refused(
        tools, "--set", "model.id=s3://m/x", "--set", "model.loadFormat=runai_streamer"
    )
    assert "--load-format" not in container(render(tools), "decode")["args"]


# 12. multi-node engines ----------------------------------------------------------------------------


def test_multinode_engines_are_leaderworkersets_with_leaders_in_the_service(tools: Tools):
    docs = render(tools, values=MULTI)
    assert not [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] in ("pdgate-prefill", "pdgate-decode")]
    for pool in ("prefill", "decode"):
        lws = find(docs, "LeaderWorkerSet", f"pdgate-{pool}")
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = lws["spec"]
        assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
        assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}  # no Service named like ours
        assert spec["rolloutStrategy"]["type"] == "RollingUpdate"
        t = spec["leaderWorkerTemplate"]
        assert t["size"] == 2 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader, worker = t["leaderTemplate"], t["workerTemplate"]
        [lc], [wc] = leader["spec"]["containers"], worker["spec"]["containers"]
        # written once: the same engine flags, image and devices on both
        assert lc["image"] == wc["image"] and lc["resources"] == wc["resources"]
        limits = lc["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 8 and limits["vpc.amazonaws.com/efa"] == 32

        def flag(args, name):
            return args[args.index(name) + 1]

        for c in (lc, wc):
            a = c["args"]
            assert (flag(a, "--tensor-parallel-size"), flag(a, "--pipeline-parallel-size")) == ("8", "2")
            assert flag(a, "--nnodes") == "$(LWS_GROUP_SIZE)" and flag(a, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
            assert flag(a, "--distributed-executor-backend") == "mp" and flag(a, "--master-port") == "29501"
            assert flag(a, "--kv-transfer-config") == flag(lc["args"], "--kv-transfer-config")
        assert flag(lc["args"], "--node-rank") == "0" and "--headless" not in lc["args"]
        assert flag(wc["args"], "--node-rank") == "$(PDGATE_NODE_RANK)" and wc["args"][-1] == "--headless"
        [rank] = [e["valueFrom"]["fieldRef"]["fieldPath"] for e in wc["env"] if e["name"] == "PDGATE_NODE_RANK"]
        assert rank == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"  # any LWS version
        # only the leader serves the API: probes, preStop, the http port
        assert {"readinessProbe", "startupProbe", "livenessProbe", "lifecycle"} <= set(lc)
        assert not {"readinessProbe", "startupProbe", "livenessProbe", "lifecycle"} & set(wc)
        assert [p["name"] for p in wc["ports"]] == ["nixl"]
        for tpl in (leader, worker):  # the preflight check on every node of the engine
            assert tpl["spec"]["initContainers"][0]["name"] == "preflight"
            assert tpl["metadata"]["labels"]["app.kubernetes.io/component"] == pool
        svc = find(docs, "Service", f"pdgate-{pool}")
        assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # the helm test pairs the engines of the pools' Services, whose slices hold the leaders only
    test = find(docs, "Pod", "pdgate-preflight-test")
    assert env(test["spec"]["containers"][0])["DECODE_SERVICE"] == "pdgate-decode"


def test_multinode_autoscaling_targets_the_leaderworkerset(tools: Tools):
    on = ["--set", "decode.autoscaling.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true"]
    docs = render(tools, *on, values=MULTI)
    hpa = find(docs, "HorizontalPodAutoscaler", "pdgate-decode")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "pdgate-decode",
    }
    assert "replicas" not in find(docs, "LeaderWorkerSet", "pdgate-decode")["spec"]
    so = find(render(tools, *on, "--set", "autoscaling.backend=keda", values=MULTI), "ScaledObject", "pdgate-decode")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "pdgate-decode",
    }
    assert "multiNode" in refused(tools, "--set", "decode.strategy.type=Recreate", values=MULTI)
    assert "multiNode.size" in refused(tools, "--set", "decode.multiNode.size=1", values=MULTI)


def test_readme_covers_what_the_chart_does():
    readme = (ROOT / "deploy" / "eks" / "README.md").read_text()
    for needed in (
        "helm test",
        "--timeout 60m",
        "pod-security.kubernetes.io/enforce=privileged",
        "IPC_LOCK",
        "restricted",
        "LeaderWorkerSet",
        "runai_streamer",
        "placement.zone",
        "hugepages-2Mi",
        "preflight FAILED",
        "fi_info not found",
        "eks.amazonaws.com/role-arn",
        "deploy/engine-image",
    ):
        assert needed in readme, needed
    assert not re.search(r"/(work|root)/", readme)


def _section(text: str, heading: str) -> str:
    """A heading's text up to the next heading of its level or above (``#`` lines in code blocks are not headings)."""
    level = len(heading.split(" ")[0])
    lines = text.splitlines()
    start = lines.index(heading) + 1
    fenced = False
    for i, line in enumerate(lines[start:], start):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            return "\n".join(lines[start:i])
    return "\n".join(lines[start:])


NOT_RUN = "#what-this-project-has-not-run-on-eks"


def test_readme_states_each_examples_needs_and_what_is_not_run_in_one_place():
    """Issue 33: per example the nodes, objects and add-ons, checks runnable before the install, and
    one list of what needs a real EKS cluster that the rest of the guide points to."""
    readme = (ROOT / "deploy" / "eks" / "README.md").read_text()
    # one row per example values file (overlays included) in the nodes-per-example table, every cell filled
    table = readme[readme.index("**Nodes per example.**") :].split("\n\n")[1]
    rows: dict[str, str] = {}  # the row of each file a first cell starts with, unless it adds files (+)
    named = set()
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 5 and all(cells), row
        files = re.findall(r"`(values-[^`]+\.yaml)`", cells[0])
        named |= set(files)
        if " + " not in cells[0]:
            rows[files[0]] = row
    examples = sorted(p.name for p in (ROOT / "deploy").glob("values-*.yaml"))
    assert named == set(examples)
    assert set(rows) == set(examples) - {"values-llama-3.3-70b-two-nodes.yaml"}  # that one: on top of the 70B file
    assert "eks-pod-identity-agent" in rows["values-lora.yaml"] and "OIDC provider" in rows["values-lora.yaml"]
    assert "s3:GetObject" in rows["values-lora.yaml"] and "pdgate-engines" in rows["values-lora.yaml"]
    assert "staticEndpoints" in rows["values-external-engines.yaml"]

    # the checks before the install name the add-ons' APIs and every Secret and claim the examples use
    before = _section(readme, "### Before `helm install`")
    after = _section(readme, "### After `helm install`")
    for check in (
        "kubectl get crd servicemonitors.monitoring.coreos.com",
        "kubectl get apiservice v1beta1.external.metrics.k8s.io",
        "kubectl get crd leaderworkersets.leaderworkerset.x-k8s.io",
        "kubectl get csidriver fsx.csi.aws.com",
        "kubectl get crd policyendpoints.networking.k8s.aws",
        "eks-pod-identity-agent",
    ):
        assert check in before, check
    secrets, claims = set(), set()
    for path in examples:
        values = yaml.safe_load((ROOT / "deploy" / path).read_text())
        model, gateway = values.get("model", {}), values.get("gateway", {})
        secrets |= {model.get("hfTokenSecret"), gateway.get("apiKeysSecret", {}).get("name")}
        secrets |= {gateway.get("adminTokenSecret", {}).get("name")}
        claims.add(model.get("cache", {}).get("claimName"))
    secret_lines = [line for line in before.splitlines() if line.startswith("kubectl -n llm get secret ")]
    for name in sorted(secrets - {None, ""}):
        assert any(name in line.split() for line in secret_lines), name
    for claim in sorted(claims - {None, ""}):
        assert f"kubectl -n llm get pvc {claim}" in before, claim
    # what can pass only after the install is marked so, and is not among the checks before it
    assert "pdgate_pool_" in after and "pdgate_pool_" not in before
    step2 = _section(readme, "## 2. Cluster add-ons")
    [adapter_row] = [line for line in step2.splitlines() if "external.metrics.k8s.io/v1beta1`" in line]
    assert adapter_row.index("After the install only") < adapter_row.index("lists `pdgate_pool_*`")

    # one list of what needs a real cluster, and every other mention points to it
    assert readme.count("## What this project has not run on EKS") == 1
    not_run = _section(readme, "## What this project has not run on EKS")
    for item in (
        "NodeOverlay",
        "LMCache 0.5.6",
        "container registry",
        "LeaderWorkerSet",
        "`helm test` itself",
        "preload Job",
        "values-lora.yaml",
        "values-external-engines.yaml",
    ):
        assert item in not_run, item
    untried = re.compile(r"untried|not\s+run\s+on\s+hardware|no\s+build\s+was\s+run|ha(s|ve)\s+been\s+run", re.I)
    for paragraph in re.split(r"\n\s*\n", readme.replace(not_run, "")):
        if untried.search(paragraph):
            assert NOT_RUN in paragraph, paragraph


def test_leaderworkerset_pod_templates_pass_the_pod_schema(tools: Tools, tmp_path):
    """kubernetes-validate only warns on a LeaderWorkerSet: its leader and worker templates are
    checked as Pods against the Kubernetes schema instead."""
    docs = render(tools, values=MULTI)
    pods = []
    for lws in of_kind(docs, "LeaderWorkerSet"):
        for role in ("leaderTemplate", "workerTemplate"):
            tpl = lws["spec"]["leaderWorkerTemplate"][role]
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"{lws['metadata']['name']}-{role.lower()}", **tpl["metadata"]},
                    "spec": tpl["spec"],
                }
            )
    assert len(pods) == 4
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(yaml.safe_dump_all(pods))
    check = subprocess.run(
        [str(tools.kubernetes_validate), "--strict", "-k", KUBE_VERSION, str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(" passed for resource ") == 4
