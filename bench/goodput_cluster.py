"""The processes of a goodput run (:mod:`bench.goodput`): simulated engines, the routers in front of
them (pdgate in each of its configurations, vllm-router installed on first use into a venv of its
own), and the :class:`Cluster` that holds them and splits the engines between the P/D pools.

Kept apart from the runner because :mod:`bench.fairness`, :mod:`bench.streams` and
:mod:`bench.overhead` start the same engines, gateways and vllm-router.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from engine_model.profile import engine_settings
from gateway.demo import cache_dir
from tests.procs import Proc, ProcGroup, free_port

MODEL = "bench"
VLLM_ROUTER_VERSION = "0.1.17"
CONFIGS = (
    "colocated-rr",
    "colocated-prefix-load",
    "colocated-2k",
    "pd-always",
    "pd-threshold",
    "pd-cost-model",
    "vllm-router-pd",
)
PD_CONFIGS = {"pd-always", "pd-threshold", "pd-cost-model", "vllm-router-pd"}
PEER_CONFIGS = {"colocated-rr", "vllm-router-pd"}
SMALL_CHUNK = 2048  # colocated-2k's engines: smaller prefill chunks, less stall for running streams


def vllm_router_binary(explicit: str | None = None) -> Path:
    """vllm-router from PyPI in a venv of its own in the cache folder (built once)."""
    if explicit:
        return Path(explicit)
    venv = cache_dir() / f"vllm-router-{VLLM_ROUTER_VERSION}-venv"
    exe = venv / "bin" / "vllm-router"
    if not exe.exists():
        print(f"installing vllm-router {VLLM_ROUTER_VERSION} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER_VERSION}"],
            check=True,
        )
    return exe


# ---------------------------------------------------------------------------- cluster
@dataclass
class Cluster:
    group: ProcGroup
    engines: list[str]
    time_scale: float
    n_prefill: int  # how many of the engines the P/D configurations use as the prefill pool
    small_chunk: list[str] = field(default_factory=list)  # colocated-2k's own engines
    routers: dict[str, tuple[Proc, str]] = field(default_factory=dict)

    @property
    def prefill(self) -> list[str]:
        return self.engines[: self.n_prefill]

    @property
    def decode(self) -> list[str]:
        return self.engines[self.n_prefill :]

    def reset(self, timeout: float = 120.0) -> None:
        """Wait until every engine is idle (no running, waiting or held requests), then empty
        their prefix caches, so each run starts from the same state."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10) as c:
            for url in self.engines + self.small_chunk:
                while True:
                    st = c.get(url + "/sim/state").json()
                    if not (st["running"] or st["waiting"] or st["kv_loading"] or st["held"]):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{url} did not go idle: {st}")
                    time.sleep(0.2)
                ok = c.post(url + "/reset_prefix_cache").json()
                if not ok.get("success"):
                    raise RuntimeError(f"{url}: prefix cache reset refused")


def start_engines(
    group: ProcGroup,
    n: int,
    profile: str,
    time_scale: float,
    tokenizer: Path,
    extra: tuple[str, ...] = (),
    tag: str = "",
) -> list[str]:
    urls = []
    procs = []
    for i in range(n):
        port, kv_port = free_port(), free_port()
        argv = [
            sys.executable, "-m", "sim", "--role", "both", "--host", "127.0.0.1", "--port", str(port),
            "--kv-port", str(kv_port), "--model", MODEL, "--tokenizer", str(tokenizer),
            "--max-model-len", "32768", "--profile", profile, "--time-scale", str(time_scale), *extra,
        ]  # fmt: skip
        procs.append((group.start(f"engine{tag}-{i}", argv, env={"VLLM_SERVER_DEV_MODE": "1"}), port))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, port in procs:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
    return urls


def pdgate_config(
    name: str, cluster: Cluster, tokenizer: Path, profile: str, port: int, end: str | None = None
) -> dict[str, Any]:
    """The gateway's YAML for one configuration. Times the gateway learns or is told are wall
    times: the cost model's prefill speed and KV link are divided by the time scale."""
    pd = name in PD_CONFIGS
    eng = engine_settings(profile, end=end)
    scale = cluster.time_scale
    decider: dict[str, Any] = {"name": "token_threshold", "threshold": 1_000_000_000}
    if name == "pd-always":
        decider = {"name": "token_threshold", "threshold": 1}
    elif name == "pd-threshold":
        decider = {"name": "token_threshold", "threshold": 4096}
    elif name == "pd-cost-model":
        decider = {
            "name": "cost_model",
            "kv_bytes_per_token": int(eng.get("kv_bytes_per_token", 327680)),
            "kv_bandwidth_gbps": effective_link_gbps(eng) / scale,
            "prefill_tokens_per_s": 1 / (float(eng.get("prefill_time_per_token") or 1e-4) * scale),
            "pd_overhead_s": (float(eng.get("kv_transfer_latency", 0.0)) + 0.005) * scale,
            "itl_budget_s": 0.05 * scale,  # the SLO's 50 ms, in wall time
            "prefill_chunk_tokens": int(eng.get("max_num_batched_tokens", 8192)),
        }
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning", "workers": 1},
        "models": [{"name": MODEL, "tokenizer": str(tokenizer), "max_model_len": 32768}],
        "pools": {
            "prefill": {"endpoints": cluster.prefill if pd else []},
            "decode": {
                "endpoints": cluster.decode
                if pd
                else cluster.small_chunk
                if name == "colocated-2k"
                else cluster.engines
            },
        },
        "routing": {"decider": decider},
        "timeouts": {"prefill_s": 900, "decode_first_byte_s": 900, "decode_idle_s": 900},
    }


def effective_link_gbps(eng: dict[str, Any]) -> float:
    """The KV link the cost model is told: the profile's bandwidth with its per-block cost
    (NIXL descriptors) folded in, as Gbit/s of KV bytes."""
    bits = float(eng.get("kv_bytes_per_token", 327680)) * 8
    per_token = bits / (float(eng.get("kv_bandwidth_gbps") or 400) * 1e9)
    per_token += float(eng.get("kv_transfer_time_per_block", 0.0)) / int(eng.get("block_size", 16))
    return bits / per_token / 1e9


def start_routers(
    cluster: Cluster,
    configs: list[str],
    tokenizer: Path,
    profile: str,
    logs: Path,
    vllm_router: Path | None,
    end: str | None = None,
) -> None:
    waits = []
    for name in configs:
        port = free_port()
        if name in PEER_CONFIGS:
            assert vllm_router is not None
            argv = [str(vllm_router), "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--max-concurrent-requests", "4096", "--queue-size", "4096",
                    "--request-timeout-secs", "900", "--log-level", "warning"]  # fmt: skip
            if name == "colocated-rr":
                argv += ["--policy", "round_robin", "--worker-urls", *cluster.engines]
            else:
                argv += ["--vllm-pd-disaggregation"]
                for u in cluster.prefill:
                    argv += ["--prefill", u]
                for u in cluster.decode:
                    argv += ["--decode", u]
            proc = cluster.group.start(name, argv)
            waits.append((proc, f"http://127.0.0.1:{port}/health"))
        else:
            path = logs / f"{name}.yaml"
            path.write_text(yaml.safe_dump(pdgate_config(name, cluster, tokenizer, profile, port, end)))
            proc = cluster.group.start(name, [sys.executable, "-m", "gateway", "serve", "--config", str(path)])
            waits.append((proc, f"http://127.0.0.1:{port}/ready"))
        cluster.routers[name] = (proc, f"http://127.0.0.1:{port}/v1/completions")
    for proc, url in waits:
        proc.wait_http(url, timeout=120)
