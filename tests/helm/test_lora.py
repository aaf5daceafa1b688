"""LoRA adapters in the chart (lora.*): vLLM's LoRA flags on both engine pools, the adapters' files
from a PVC (read-only) or copied from S3 by an init container, runtime loading on the engines and in
the gateway, and the gateway's catalogue: every adapter's path is one string, the same in the
engines' --lora-modules and the gateway's models[].adapters (vLLM hashes it into the adapter's KV
blocks). Rendered offline with helm, checked against the Kubernetes schemas and the gateway's own
config validator; settings that cannot work together are refused with the reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.cli import main as pdgate
from gateway.config import load_config
from gateway.http.reconfigure import validate

from .conftest import CHART, KUBE_VERSION, ROOT, Tools
from .test_chart import find, helm_template, render

SMALL = ROOT / "deploy" / "values-small.yaml"
MULTI = ROOT / "deploy" / "values-llama-3.1-405b-multinode.yaml"
EXAMPLE = ROOT / "deploy" / "values-lora.yaml"
POOLS = ("prefill", "decode")
RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]

# Adapters from a claim, loaded at start only (no runtime loading).
PVC = {
    "lora": {
        "enabled": True,
        "maxLoras": 2,
        "maxLoraRank": 32,
        "source": {"pvc": {"claimName": "adapters-fsx", "subPath": "llama-70b"}},
        "adapters": [
            {"name": "support", "maxRank": 16},
            {"name": "billing"},
            {"name": "team/legal", "path": "/adapters/legal/v2", "maxRank": 32},
        ],
    }
}
# Adapters copied from S3, runtime loading on, one adapter left to the gateway, one path that
# vLLM's name=path form cannot carry.
S3 = {
    "lora": {
        "enabled": True,
        "maxCpuLoras": 8,
        "dynamicLoading": True,
        "mountPath": "/var/lora",
        "source": {
            "s3": {"uri": "s3://my-adapters/llama-70b", "region": "us-west-2", "extraArgs": ["--exclude", "*.bin"]}
        },
        "adapters": [
            {"name": "support", "maxRank": 16},
            {"name": "legal", "path": "/var/lora/legal-v2", "preload": False},
            {"name": "odd", "path": "/var/lora/rank=8,v2"},
        ],
        "refreshSeconds": 30,
        "loadTimeoutSeconds": 45.5,
        "maxAdaptersPerEngine": 6,
    }
}


def values_file(tmp_path: Path, values: dict, name: str = "lora.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return path


def pod(docs: list[dict], pool: str) -> dict:
    return find(docs, "Deployment", f"pdgate-{pool}")["spec"]["template"]["spec"]


def vllm(spec: dict) -> dict:
    [c] = spec["containers"]
    return c


def env(c: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def lora_modules(args: list[str]) -> dict[str, str]:
    """--lora-modules as vLLM 0.32 reads it (LoRAParserAction): the items after the one flag, each
    name=path when it has "=" and no ",", else JSON."""
    assert args.count("--lora-modules") == 1  # a second flag would replace the first's list
    items = []
    for item in args[args.index("--lora-modules") + 1 :]:
        if item.startswith("-"):
            break
        items.append(item)
    out = {}
    for item in items:
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
        else:
            d = json.loads(item)
            name, path = d["name"], d["path"]
        out[name] = path
    return out


def gateway_config(docs: list[dict], tmp_path: Path, capsys) -> dict:
    """The rendered gateway config, after the gateway's own validator accepted it."""
    text = find(docs, "ConfigMap", "pdgate-gateway")["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    validate(load_config(path))
    assert pdgate(["check-config", str(path), "--no-tokenizers"]) == 0, capsys.readouterr().err
    return yaml.safe_load(text)


def kubernetes_validate(tools: Tools, stdout: str, tmp_path: Path) -> None:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(stdout)
    check = subprocess.run(
        [str(tools.kubernetes_validate), "--strict", "-k", KUBE_VERSION, str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "ERROR" not in check.stdout + check.stderr


def lint(tools: Tools, *files: Path) -> None:
    cmd = [str(tools.helm), "lint", "--strict", str(CHART)]
    for f in files:
        cmd += ["-f", str(f)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


def refused(tools: Tools, *args: str) -> str:
    out = helm_template(tools, *args)
    assert out.returncode != 0, "rendered, but should have been refused"
    return out.stderr


def test_lora_is_off_by_default(tools: Tools, tmp_path, capsys):
    docs = render(tools)
    cfg = gateway_config(docs, tmp_path, capsys)
    assert "lora" not in cfg and "adapters" not in cfg["models"][0]
    for pool in POOLS:
        spec = pod(docs, pool)
        c = vllm(spec)
        assert not {"--enable-lora", "--max-loras", "--max-lora-rank", "--lora-modules"} & set(c["args"])
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env(c)
        assert "lora-adapters" not in {v["name"] for v in spec["volumes"]}
        assert "initContainers" not in spec


def test_adapters_from_a_pvc_read_only_loaded_at_start(tools: Tools, tmp_path, capsys):
    values = values_file(tmp_path, PVC)
    lint(tools, values)
    out = helm_template(tools, values=values)
    assert out.returncode == 0, out.stderr
    kubernetes_validate(tools, out.stdout, tmp_path)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cfg = gateway_config(docs, tmp_path, capsys)
    want = {"support": "/adapters/support", "billing": "/adapters/billing", "team/legal": "/adapters/legal/v2"}
    # the gateway's catalogue: the same names and path strings, with the ranks given
    assert cfg["models"][0]["adapters"] == [
        {"name": "support", "path": "/adapters/support", "max_rank": 16},
        {"name": "billing", "path": "/adapters/billing"},
        {"name": "team/legal", "path": "/adapters/legal/v2", "max_rank": 32},
    ]
    assert cfg["lora"] == {
        "discover": True,
        "refresh_s": 10,
        "dynamic_loading": False,
        "load_timeout_s": 60,
        "max_adapters_per_engine": 0,
    }
    for pool in POOLS:
        spec = pod(docs, pool)
        c = vllm(spec)
        args = c["args"]
        assert "--enable-lora" in args
        assert flag(args, "--max-loras") == "2" and flag(args, "--max-lora-rank") == "32"
        assert "--max-cpu-loras" not in args  # vLLM's default: maxLoras
        assert lora_modules(args) == want
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env(c)  # no runtime loading
        # the claim, read-only, at mountPath (a folder of it: subPath); no copy step
        [vol] = [v for v in spec["volumes"] if v["name"] == "lora-adapters"]
        assert vol == {
            "name": "lora-adapters",
            "persistentVolumeClaim": {"claimName": "adapters-fsx", "readOnly": True},
        }
        [mount] = [m for m in c["volumeMounts"] if m["name"] == "lora-adapters"]
        assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True, "subPath": "llama-70b"}
        assert "initContainers" not in spec
        # the model cache's disk request is unchanged: the adapters are not on the node's disk
        assert c["resources"]["requests"]["ephemeral-storage"] == "220Gi"  # model 200 + compile cache 20


def test_adapters_from_s3_copied_at_start_with_runtime_loading(tools: Tools, tmp_path, capsys):
    values = values_file(tmp_path, S3)
    lint(tools, values)
    out = helm_template(tools, values=values)
    assert out.returncode == 0, out.stderr
    kubernetes_validate(tools, out.stdout, tmp_path)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cfg = gateway_config(docs, tmp_path, capsys)
    assert cfg["models"][0]["adapters"] == [
        {"name": "support", "path": "/var/lora/support", "max_rank": 16},
        {"name": "legal", "path": "/var/lora/legal-v2"},
        {"name": "odd", "path": "/var/lora/rank=8,v2"},
    ]
    assert cfg["lora"] == {
        "discover": True,
        "refresh_s": 30,
        "dynamic_loading": True,
        "load_timeout_s": 45.5,
        "max_adapters_per_engine": 6,
    }
    for pool in POOLS:
        spec = pod(docs, pool)
        c = vllm(spec)
        args = c["args"]
        assert "--enable-lora" in args
        assert flag(args, "--max-loras") == "4" and flag(args, "--max-cpu-loras") == "8"
        assert flag(args, "--max-lora-rank") == "16"
        # preload false: only the gateway lists it (and loads it); "=" and "," in a path: the JSON form
        assert lora_modules(args) == {"support": "/var/lora/support", "odd": "/var/lora/rank=8,v2"}
        assert '{"name":"odd","path":"/var/lora/rank=8,v2"}' in args
        assert env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        # the prefix is copied into an emptyDir before vLLM starts, with the pod's own identity
        [vol] = [v for v in spec["volumes"] if v["name"] == "lora-adapters"]
        assert vol == {"name": "lora-adapters", "emptyDir": {"sizeLimit": "20Gi"}}
        [mount] = [m for m in c["volumeMounts"] if m["name"] == "lora-adapters"]
        assert mount == {"name": "lora-adapters", "mountPath": "/var/lora", "readOnly": True}
        [sync] = [i for i in spec["initContainers"] if i["name"] == "lora-sync"]
        assert sync["image"] == "amazon/aws-cli:2.17.29"
        assert sync["command"] == [
            "aws",
            "s3",
            "sync",
            "s3://my-adapters/llama-70b",
            "/var/lora",
            "--no-progress",
            "--exclude",
            "*.bin",
        ]
        assert sync["volumeMounts"] == [{"name": "lora-adapters", "mountPath": "/var/lora"}]
        assert env(sync) == {"AWS_REGION": "us-west-2"}  # no credentials: IRSA / Pod Identity
        assert sync["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert sync["resources"]["limits"] == {"memory": "1Gi"}
        # the copy is on the node's disk too: the scheduler counts it with the model and compile caches
        assert c["resources"]["requests"]["ephemeral-storage"] == "240Gi"


def test_static_s3_adapters_without_runtime_loading(tools: Tools, tmp_path, capsys):
    values = {"lora": {**S3["lora"], "dynamicLoading": False, "adapters": [{"name": "support"}]}}
    docs = render(tools, values=values_file(tmp_path, values))
    cfg = gateway_config(docs, tmp_path, capsys)
    assert cfg["lora"]["dynamic_loading"] is False
    for pool in POOLS:
        c = vllm(pod(docs, pool))
        assert lora_modules(c["args"]) == {"support": "/var/lora/support"}
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env(c)


def test_adapters_without_a_source_keep_their_own_paths(tools: Tools, tmp_path, capsys):
    """No volume: a Hugging Face repo id or a path the pool's extraVolumes provide, used as given."""
    values = {"lora": {"enabled": True, "adapters": [{"name": "sql", "path": "org/llama-sql-lora"}]}}
    docs = render(tools, values=values_file(tmp_path, values))
    cfg = gateway_config(docs, tmp_path, capsys)
    assert cfg["models"][0]["adapters"] == [{"name": "sql", "path": "org/llama-sql-lora"}]
    for pool in POOLS:
        spec = pod(docs, pool)
        assert lora_modules(vllm(spec)["args"]) == {"sql": "org/llama-sql-lora"}
        assert "lora-adapters" not in {v["name"] for v in spec["volumes"]}


def test_multi_node_engines_get_the_adapters_on_every_pod(tools: Tools, tmp_path):
    """Each node's workers load the adapter from their own pod's disk: leader and workers alike."""
    values = values_file(tmp_path, S3)
    out = helm_template(tools, "-f", str(MULTI), "-f", str(values))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for pool in POOLS:
        lws = find(docs, "LeaderWorkerSet", f"pdgate-{pool}")["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            spec = lws[role]["spec"]
            c = vllm(spec)
            assert "--enable-lora" in c["args"] and "lora-sync" in [i["name"] for i in spec["initContainers"]]
            assert env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
            assert {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "lora-adapters"} == {"/var/lora"}


def test_example_adds_adapters_to_the_small_install(tools: Tools, tmp_path, capsys):
    """deploy/values-lora.yaml on top of values-small.yaml (alone it is checked with every example)."""
    lint(tools, SMALL, EXAMPLE)
    out = helm_template(tools, "-f", str(SMALL), "-f", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    kubernetes_validate(tools, out.stdout, tmp_path)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cfg = gateway_config(docs, tmp_path, capsys)
    model = cfg["models"][0]
    assert model["name"] == "qwen2.5-1.5b"
    paths = {a["name"]: a["path"] for a in model["adapters"]}
    assert cfg["lora"]["dynamic_loading"] is True
    sa = find(docs, "ServiceAccount", "pdgate-engines")
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    for pool in POOLS:
        spec = pod(docs, pool)
        assert spec["serviceAccountName"] == "pdgate-engines"  # the S3 copy's credentials
        c = vllm(spec)
        modules = lora_modules(c["args"])
        assert modules == {k: paths[k] for k in ("support", "billing")}  # legal: loaded on demand
        assert env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        # the load endpoints are behind the engines' NetworkPolicy
        find(docs, "NetworkPolicy", f"pdgate-{pool}")


def test_invalid_max_lora_rank_is_refused_with_the_ranks_vllm_accepts(tools: Tools):
    err = refused(tools, "--set", "lora.enabled=true", "--set", "lora.maxLoraRank=24")
    assert "values don't meet the specifications of the schema" in err
    assert (
        "lora.maxLoraRank: lora.maxLoraRank must be one of the following: 1, 8, 16, 32, 64, 128, 256, 320, 512" in err
    )
    # the template says it too where the schema is skipped
    err = refused(tools, "--set", "lora.enabled=true", "--set", "lora.maxLoraRank=24", "--skip-schema-validation")
    assert "lora.maxLoraRank 24 is not a rank vLLM accepts: one of 1, 8, 16, 32, 64, 128, 256, 320, 512" in err
    # the schema and the template know the same ranks
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["lora"]["properties"]["maxLoraRank"]["enum"] == RANKS


@pytest.mark.parametrize("rank", RANKS)
def test_every_rank_vllm_accepts_renders(tools: Tools, rank):
    docs = render(tools, "--set", "lora.enabled=true", "--set", f"lora.maxLoraRank={rank}")
    assert flag(vllm(pod(docs, "decode"))["args"], "--max-lora-rank") == str(rank)


ON = ["--set", "lora.enabled=true"]
CLAIM = [*ON, "--set", "lora.source.pvc.claimName=adapters"]
DYNAMIC = [*CLAIM, "--set", "lora.dynamicLoading=true"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [*ON, "--set", "lora.maxLoras=4", "--set", "lora.maxCpuLoras=2"],
            "lora.maxCpuLoras 2 is below lora.maxLoras 4",
        ),
        (
            [*CLAIM, "--set", "lora.source.s3.uri=s3://bucket/adapters"],
            "lora.source: pvc.claimName and s3.uri are both set",
        ),
        (
            [*ON, "--set", "lora.adapters[0].name=support"],
            "lora.adapters[0] (support) has no path and lora.source mounts nothing",
        ),
        (
            [*CLAIM, "--set", "lora.adapters[0].name=support", "--set", "lora.adapters[0].maxRank=64"],
            "lora.adapters[0] (support): maxRank 64 is above lora.maxLoraRank 16",
        ),
        (
            [*CLAIM, "--set", "lora.adapters[0].name=legal", "--set", "lora.adapters[0].preload=false"],
            "lora.adapters[0] (legal): preload false needs lora.dynamicLoading",
        ),
        (
            [*CLAIM, "--set", "lora.adapters[0].name=a", "--set", "lora.adapters[1].name=a"],
            "lora.adapters: two adapters are named a",
        ),
        (
            [*CLAIM, "--set", "lora.adapters[0].name=llama-3.3-70b"],
            "lora.adapters[0]: llama-3.3-70b is model.name",
        ),
        (
            [*CLAIM, "--set", "prefill.extraArgs={--max-lora-rank=64}"],
            "prefill.extraArgs sets --max-lora-rank: with lora.enabled the chart sets it from lora.*",
        ),
        (
            [*CLAIM, "--set", "decode.extraArgs={--lora-modules,x=/y}"],
            "decode.extraArgs sets --lora-modules",
        ),
        (
            [*DYNAMIC, "--set", "decode.extraArgs={--api-server-count,2}"],
            "decode.extraArgs sets --api-server-count 2: vLLM refuses runtime LoRA loading",
        ),
        (
            [*DYNAMIC, "--set", "prefill.extraArgs={-asc=4}"],
            "prefill.extraArgs sets --api-server-count 4",
        ),
        (
            [*DYNAMIC, "--set", "decode.extraArgs={--data_parallel_size=2}"],
            "decode.extraArgs sets --data-parallel-size 2, and vLLM then runs that many API servers",
        ),
    ],
)
def test_settings_that_cannot_work_together_are_refused(tools: Tools, args, message):
    err = refused(tools, *args)
    assert message in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "lora.adapters[0].name=bad name"], "lora.adapters.0.name: Does not match pattern"),
        (["--set", "lora.mountPath=/adapters/"], "lora.mountPath: Does not match pattern"),
        (["--set", "lora.source.s3.uri=https://bucket/x"], "lora.source.s3.uri"),
        (["--set", "lora.maxLoras=0"], "lora.maxLoras: Must be greater than or equal to 1"),
        (["--set", "lora.adapter[0].name=x"], "Additional property adapter is not allowed"),
    ],
)
def test_schema_rejects_wrong_lora_values(tools: Tools, args, message):
    err = refused(tools, *ON, *args)
    assert "values don't meet the specifications of the schema" in err
    assert message in err, err


def test_runtime_loading_with_one_api_server_is_allowed(tools: Tools):
    """Data parallel engines with an explicit single API server: vLLM allows runtime loading."""
    docs = render(tools, *DYNAMIC, "--set", "decode.extraArgs={-dp,2,--api-server-count,1}")
    assert env(vllm(pod(docs, "decode")))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    # without runtime loading several API servers are the user's choice
    docs = render(tools, *CLAIM, "--set", "decode.extraArgs={--api-server-count,2}")
    assert flag(vllm(pod(docs, "decode"))["args"], "--api-server-count") == "2"
