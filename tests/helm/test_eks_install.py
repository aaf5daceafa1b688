"""The second pass over the EKS install (issue 33): what would stop or hurt a platform team on day
one. Each test renders the chart as a user would install it and checks the manifest that fixes one
point: drains that proceed while decode is down, engines that drain on SIGTERM and keep their
compiled kernels, an NLB that checks /ready and lets streams finish, a two-node example, a
`helm test` whose exec right is narrowed to the preflight script, and a test image from any
registry. The admission policy's CEL is evaluated for real (cel-python), with the commands the
rendered test pod runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import celpy
import pytest
import yaml

from tests.procs import ProcGroup, free_port

from .conftest import CHART, ROOT, Tools
from .test_chart import find, helm_template, of_kind, render, render_notes

BIG = ROOT / "deploy" / "values-llama-3.3-70b.yaml"
TWO = ROOT / "deploy" / "values-llama-3.3-70b-two-nodes.yaml"


def vllm(docs: list[dict], pool: str) -> dict:
    pod = find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]
    [c] = [c for c in pod["containers"] if c["name"] == "vllm"]
    return c


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def refused(tools: Tools, *args: str, values=None) -> str:
    out = helm_template(tools, *args, values=values)
    assert out.returncode != 0, "the chart rendered what it should refuse"
    return out.stderr


# -- disruption budgets -----------------------------------------------------------------------------


def test_drains_are_not_blocked_by_pods_that_are_not_ready(tools: Tools):
    """The gateway is not Ready while no decode engine is: a minAvailable budget over not-Ready pods
    would block every node drain during a decode outage, the moment a drain matters most."""
    docs = render(tools, values=BIG)
    for name in ("pdgate-gateway", "pdgate-prefill", "pdgate-decode"):
        assert find(docs, "PodDisruptionBudget", name)["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# -- engines: drain on SIGTERM, keep compiled kernels ------------------------------------------------


def test_engines_drain_requests_in_flight_within_the_grace_period(tools: Tools):
    docs = render(tools)
    for pool in ("prefill", "decode"):
        c = vllm(docs, pool)
        grace = find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        drain = int(flag(c["args"], "--shutdown-timeout"))
        assert drain == grace - sleep - 15 == 90  # 120 - 15 - 15 with the defaults
    docs = render(tools, "--set", "engines.shutdownTimeoutSeconds=30")
    assert flag(vllm(docs, "decode")["args"], "--shutdown-timeout") == "30"
    # 0: vLLM's own default (abort in-flight requests): no flag at all
    assert (
        "--shutdown-timeout" not in vllm(render(tools, "--set", "engines.shutdownTimeoutSeconds=0"), "decode")["args"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "engines.shutdownTimeoutSeconds=110"], "must fit in prefill.terminationGracePeriodSeconds (120)"),
        (["--set", "decode.extraArgs={--shutdown-timeout,5}"], "the chart sets it from engines.shutdownTimeoutSeconds"),
        (
            ["--set", "engines.compileCache.type=pvc"],
            "engines.compileCache.type pvc needs engines.compileCache.claimName",
        ),
        # the computed drain would be 0: the user must choose to abort, not get it silently
        (["--set", "prefill.terminationGracePeriodSeconds=25"], "leaves no time for vLLM to drain"),
        (["--kube-version", "1.29.0"], "set preflight.test.execPolicy=false"),
    ],
)
def test_drain_and_cache_settings_that_cannot_work_are_refused(tools: Tools, args, message):
    assert message in refused(tools, *args)


def test_compiled_kernels_live_on_a_volume_that_outlives_the_container(tools: Tools):
    docs = render(tools)
    c = vllm(docs, "decode")
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["compile-cache"] == "/compile-cache"
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert env[var].startswith("/compile-cache")
    pod = find(docs, "Deployment", "pdgate-decode")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["compile-cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
    # the scheduler counts it on the node's disk, beside the model cache's 200Gi
    assert c["resources"]["requests"]["ephemeral-storage"] == "220Gi"
    docs = render(tools, "--set", "engines.compileCache.type=hostPath")
    volumes = {v["name"]: v for v in find(docs, "Deployment", "pdgate-decode")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["compile-cache"]["hostPath"] == {
        "path": "/var/lib/pdgate/compile-cache",
        "type": "DirectoryOrCreate",
    }
    docs = render(tools, "--set", "engines.compileCache.type=none")
    c = vllm(docs, "decode")
    assert "compile-cache" not in {m["name"] for m in c["volumeMounts"]}
    assert "VLLM_CACHE_ROOT" not in {e["name"] for e in c["env"]}


# -- the NLB ---------------------------------------------------------------------------------------------


def test_the_nlb_checks_ready_and_lets_streams_finish(tools: Tools):
    docs = render(tools, values=BIG)
    a = find(docs, "Service", "pdgate-gateway")["metadata"]["annotations"]
    p = "service.beta.kubernetes.io/aws-load-balancer-healthcheck-"
    assert a[p + "path"] == "/ready" and a[p + "protocol"] == "HTTP" and a[p + "port"] == "traffic-port"
    delay = int(a["service.beta.kubernetes.io/aws-load-balancer-target-group-attributes"].split("=")[1])
    grace = find(docs, "Deployment", "pdgate-gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert delay >= grace  # the NLB keeps a draining target's connections as long as the gateway drains
    # the example's own annotations stay, and a user's annotation wins over the chart's
    assert a["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"
    escaped = (p + "path").replace(".", "\\.")
    docs = render(tools, "--set-string", f"gateway.service.annotations.{escaped}=/health", values=BIG)
    assert find(docs, "Service", "pdgate-gateway")["metadata"]["annotations"][p + "path"] == "/health"
    # an NLB through the AWS Load Balancer Controller, with ip targets
    assert a["service.beta.kubernetes.io/aws-load-balancer-type"] == "external"
    assert a["service.beta.kubernetes.io/aws-load-balancer-nlb-target-type"] == "ip"
    # a user's own target group attributes keep the deregistration delay beside them
    tga = "service.beta.kubernetes.io/aws-load-balancer-target-group-attributes"
    escaped = tga.replace(".", "\\.")
    docs = render(
        tools, "--set-string", f"gateway.service.annotations.{escaped}=preserve_client_ip.enabled=true", values=BIG
    )
    merged = find(docs, "Service", "pdgate-gateway")["metadata"]["annotations"][tga]
    assert merged == f"preserve_client_ip.enabled=true,deregistration_delay.timeout_seconds={grace}"
    # a ClusterIP Service carries no load balancer annotations
    assert "annotations" not in find(render(tools), "Service", "pdgate-gateway")["metadata"]
    message = refused(tools, "--set", "gateway.service.awsHealthCheck.deregistrationDelaySeconds=20", values=BIG)
    assert "below the gateway's grace period" in message


# -- the examples ----------------------------------------------------------------------------------------


def test_two_node_example_runs_one_engine_per_pool_without_a_spare_node(tools: Tools):
    docs = render(tools, "-f", str(TWO), values=BIG)
    for pool in ("prefill", "decode"):
        dep = find(docs, "Deployment", f"pdgate-{pool}")
        assert dep["spec"]["replicas"] == 1
        assert dep["spec"]["strategy"] == {"type": "Recreate"}  # no surge: an upgrade needs no third p5
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    assert {d["metadata"]["name"] for d in of_kind(docs, "PodDisruptionBudget")} == {"pdgate-gateway"}


def _install_check(tools: Tools, tmp_path: Path, state: dict, *args: str) -> subprocess.CompletedProcess:
    """``helm template --dry-run=server`` (what ``helm install`` renders with) against a stand-in API
    server holding namespace llm's claims and Secrets in ``state``; everything else is forbidden."""
    port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: fake, user: u, namespace: llm}}]\ncurrent-context: c\n"
    )
    group = ProcGroup(tmp_path)
    try:
        argv = [sys.executable, "-m", "tests.helm.fake_kube_api", str(port), "llm", json.dumps(state)]
        api = group.start("kube-api", argv, cwd=ROOT)
        api.wait_http(f"http://127.0.0.1:{port}/version")
        cmd = [str(tools.helm), "template", "pdgate", str(CHART), "-n", "llm", "--dry-run=server", *args]
        env = {"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    finally:
        group.stop_all()


READY = {"claims": ["models-fsx"], "secrets": {"hf-token": ["HF_TOKEN"], "pdgate-api-keys": ["api-keys"]}}


def test_install_names_a_missing_claim_or_secret_instead_of_leaving_pods_waiting(tools: Tools, tmp_path: Path):
    out = _install_check(tools, tmp_path, {**READY, "claims": []}, "-f", str(BIG))
    assert out.returncode != 0
    assert 'PersistentVolumeClaim "models-fsx" does not exist in namespace llm' in out.stderr
    out = _install_check(tools, tmp_path, {**READY, "secrets": {"pdgate-api-keys": ["api-keys"]}}, "-f", str(BIG))
    assert 'Secret "hf-token" (model.hfTokenSecret) does not exist in namespace llm' in out.stderr
    out = _install_check(
        tools, tmp_path, {**READY, "secrets": {"hf-token": ["token"], "pdgate-api-keys": ["api-keys"]}}, "-f", str(BIG)
    )
    assert (
        'Secret "hf-token" (model.hfTokenSecret) in namespace llm has no key "HF_TOKEN" (it has: token)' in out.stderr
    )
    out = _install_check(tools, tmp_path, READY, "-f", str(BIG))
    assert out.returncode == 0, out.stderr
    assert "kind: Deployment" in out.stdout


def test_a_deployer_with_namespace_rights_only_installs_without_references(tools: Tools, tmp_path: Path):
    """Reading the Namespace object (or anything outside it) is forbidden here: the checks never need it."""
    out = _install_check(tools, tmp_path, {})
    assert out.returncode == 0, out.stderr


def test_the_70b_example_preloads_the_weights_once(tools: Tools):
    docs = render(tools, values=BIG)
    [job] = [d for d in of_kind(docs, "Job") if "preload" in d["metadata"]["name"]]
    assert job["metadata"]["annotations"]["helm.sh/hook"].startswith("pre-install")
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in job["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["models-fsx"]
    # Meta's original checkpoint (as large as the weights, never read by vLLM) stays on the hub
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--exclude", "original/*"] and '"$@"' in command[2]


# -- helm test: exec narrowed to the preflight -------------------------------------------------------------


def _policy(docs: list[dict]) -> tuple[dict, celpy.Runner, celpy.Runner]:
    [policy] = of_kind(docs, "ValidatingAdmissionPolicy")
    env = celpy.Environment()
    [cond] = policy["spec"]["matchConditions"]
    [rule] = policy["spec"]["validations"]
    return policy, env.program(env.compile(cond["expression"])), env.program(env.compile(rule["expression"]))


def _allowed(rule: celpy.Runner, pod: str, command: list[str], container: str = "vllm", ns: str = "llm") -> bool:
    act = {
        "request": celpy.json_to_cel({"namespace": ns, "name": pod}),
        "object": celpy.json_to_cel({"kind": "PodExecOptions", "container": container, "command": command}),
    }
    return bool(rule.evaluate(act))


def test_the_test_pods_exec_right_reaches_only_the_preflight_in_engine_pods(tools: Tools):
    docs = render(tools)
    policy, cond, rule = _policy(docs)
    ops = policy["spec"]["matchConstraints"]["resourceRules"][0]
    assert ops["operations"] == ["CONNECT"] and ops["resources"] == ["pods/exec"]
    [binding] = of_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] and binding["spec"]["validationActions"] == [
        "Deny"
    ]
    # the policy applies to the test's own ServiceAccount, and only to it
    [pod] = [d for d in of_kind(docs, "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    account = f"system:serviceaccount:llm:{pod['spec']['serviceAccountName']}"
    assert cond.evaluate({"request": celpy.json_to_cel({"userInfo": {"username": account}})})
    assert not cond.evaluate(
        {"request": celpy.json_to_cel({"userInfo": {"username": "system:serviceaccount:llm:default"}})}
    )
    # every exec the rendered test script makes is allowed...
    script = pod["spec"]["containers"][0]["args"][-1] if pod["spec"]["containers"][0].get("args") else ""
    script = script or " ".join(pod["spec"]["containers"][0]["command"])
    execs = re.findall(r'kubectl -n "\$NS" exec "\$\w+" -c (\w+) -- (python3 \S+ \w+)', script)
    assert {sub.split()[2] for _, sub in execs} >= {"serve", "pull"}
    for container, command in execs:
        for engine in ("pdgate-prefill-7d9f-abcde", "pdgate-decode-7d9f-fghij"):
            assert _allowed(rule, engine, [*command.split(), "--backend", "UCX"], container)
    # ...and nothing else: another pod, another container, a shell, another namespace
    preflight = ["python3", "/opt/pdgate/preflight/preflight.py", "pull"]
    assert not _allowed(rule, "pdgate-gateway-5c6d-xyz12", preflight)
    assert not _allowed(rule, "other-app-decode-1", preflight)
    assert not _allowed(rule, "pdgate-decode-7d9f-fghij", preflight, container="preflight")
    assert not _allowed(rule, "pdgate-decode-7d9f-fghij", ["sh", "-c", "cat /var/run/secrets/token"])
    assert not _allowed(rule, "pdgate-decode-7d9f-fghij", ["python3", "-c", "import os"])
    assert not _allowed(rule, "pdgate-decode-7d9f-fghij", preflight, ns="other")


def test_exec_policy_can_be_left_out_and_the_test_image_comes_from_any_registry(tools: Tools):
    docs = render(
        tools,
        "--set",
        "preflight.test.execPolicy=false",
        "--set",
        "preflight.test.image.registry=123456789012.dkr.ecr.us-east-1.amazonaws.com/docker-hub",
    )
    assert not of_kind(docs, "ValidatingAdmissionPolicy")
    [pod] = [d for d in of_kind(docs, "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert (
        pod["spec"]["containers"][0]["image"]
        == "123456789012.dkr.ecr.us-east-1.amazonaws.com/docker-hub/alpine/k8s:1.32.3"
    )
    [pod] = [d for d in of_kind(render(tools), "Pod") if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert pod["spec"]["containers"][0]["image"] == "docker.io/alpine/k8s:1.32.3"


def test_notes_say_an_internal_nlb_answers_only_inside_the_vpc(tools: Tools, tmp_path: Path):
    notes = render_notes(tools, tmp_path / "big", BIG)
    assert "internal NLB" in notes and "port-forward" in notes
    small = render_notes(tools, tmp_path / "small", ROOT / "deploy" / "values-small.yaml")
    assert "internal NLB" not in small  # a ClusterIP Service: no load balancer to speak of


# -- where the guide's pods land: the GPU nodes' taints, the preload Job on a CPU node -------------------

GUIDE = ROOT / "deploy" / "eks" / "README.md"
MULTI = ROOT / "deploy" / "values-llama-3.1-405b-multinode.yaml"
# The taint the guide says some clusters already have; the GPU examples tolerate it too.
EFA_TAINT = {"key": "vpc.amazonaws.com/efa", "effect": "NoSchedule"}


def _yaml_blocks(text: str) -> list[dict]:
    """Every YAML document of the guide's fenced yaml blocks and bash heredocs (<<'YAML' ... YAML)."""
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S) + re.findall(r"<<'YAML'\n(.*?)\nYAML\n", text, re.S)
    return [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict)]


def _guide_taints() -> list[dict]:
    """The taints the guide puts on GPU nodes: its eksctl sketch's node groups and its Karpenter NodePool."""
    taints = []
    for doc in _yaml_blocks(GUIDE.read_text()):
        for group in doc.get("managedNodeGroups", []):
            taints += group.get("taints", [])
        if doc.get("kind") == "NodePool":
            taints += doc["spec"]["template"]["spec"].get("taints", [])
    return taints


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' rule: the effect (empty: any), the key (empty with Exists: any), the value unless Exists."""
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("key") and t["key"] != taint["key"]:
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


def _pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod the release creates, by a readable name: Deployments, LeaderWorkerSet templates, Jobs, Pods."""
    specs = {}
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("Deployment", "Job"):
            specs[f"{kind}/{name}"] = d["spec"]["template"]["spec"]
        elif kind == "LeaderWorkerSet":
            for role in ("leaderTemplate", "workerTemplate"):
                specs[f"{kind}/{name}/{role}"] = d["spec"]["leaderWorkerTemplate"][role]["spec"]
        elif kind == "Pod":
            specs[f"{kind}/{name}"] = d["spec"]
    return specs


@pytest.mark.parametrize(
    "files",
    [[BIG], [BIG, TWO], [MULTI]],
    ids=["70b", "70b-two-nodes", "405b-multinode"],
)
def test_engines_tolerate_the_guides_gpu_taints_and_nothing_else_lands_there(tools: Tools, files: list[Path]):
    guide = _guide_taints()
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in guide
    assert "`nvidia.com/gpu=true:NoSchedule`" in GUIDE.read_text()  # the prose says the same taint
    extra = [a for f in files[1:] for a in ("-f", str(f))]
    docs = render(tools, *extra, values=files[0])
    specs = _pod_specs(docs)
    engines = {k: v for k, v in specs.items() if re.search(r"/pdgate-(prefill|decode)(/|$)", k)}
    assert len(engines) == (4 if files == [MULTI] else 2), sorted(specs)
    for name, spec in engines.items():
        for taint in (*guide, EFA_TAINT):
            assert _tolerates(spec.get("tolerations"), taint), (name, taint)
        assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge", name
    # the gateway, both Redis, the preload Job and the test pod stay off the tainted GPU nodes
    others = {k: v for k, v in specs.items() if k not in engines}
    assert {"Deployment/pdgate-gateway", "Job/pdgate-model-preload", "Pod/pdgate-preflight-test"} <= set(others)
    for name, spec in others.items():
        for taint in guide:
            assert not _tolerates(spec.get("tolerations"), taint), (name, taint)


def test_the_guides_device_plugin_values_tolerate_its_gpu_taints():
    """Step 2: a device plugin that does not tolerate the GPU nodes' taint advertises nothing."""
    [plugin] = [d for d in _yaml_blocks(GUIDE.read_text()) if set(d) == {"tolerations"}]
    for taint in (*_guide_taints(), EFA_TAINT):
        assert _tolerates(plugin["tolerations"], taint), taint


@pytest.mark.parametrize("values", [BIG, MULTI], ids=["70b", "405b-multinode"])
def test_the_preload_job_runs_on_a_cpu_node_with_the_engine_image(tools: Tools, values: Path):
    """The guide (step 6, "Where the preload Job runs"): no placement, the engine image, 4 CPU / 16 GiB."""
    docs = render(tools, values=values)
    spec = find(docs, "Job", "pdgate-model-preload")["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity"} & set(spec)
    [c] = spec["containers"]
    specs = _pod_specs(docs)
    decode = specs.get("Deployment/pdgate-decode") or specs["LeaderWorkerSet/pdgate-decode/leaderTemplate"]
    assert c["image"] == decode["containers"][0]["image"]  # the engine image (model.preload.image empty)
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    guide = GUIDE.read_text()
    section = guide[guide.index("### Where the preload Job runs") :]
    section = section[: section.index("\n## ")]
    assert "4 CPU / 16 GiB" in section and "security group" in section and "CPU node" in section
    # the per-example table counts it in the CPU room of both examples that preload
    row = next(line for line in guide.splitlines() if line.startswith(f"| `{values.name}` |"))
    assert "the preload Job (4 CPU / 16 GiB" in row
