"""Fixtures for the simulator's suites: a locally built tokenizer and real sim processes."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.procs import Proc, ProcGroup, free_port
from tests.promtext import sample


@pytest.fixture(scope="session")
def sim_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_model.tinymodel import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("sim-tokenizer"))


metric = sample  # Prometheus text -> one summed sample (tests/promtext.py)


@dataclass
class SimProc:
    proc: Proc
    port: int
    kv_port: int
    role: str
    http: httpx.Client  # shared keep-alive client (a fresh httpx client per call is slow)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return self.http.get(self.url + "/metrics").text

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics(), name, **labels)

    def state(self) -> dict:
        return self.http.get(self.url + "/sim/state").json()

    def requests(self) -> list[dict]:
        return self.http.get(self.url + "/sim/requests").json()["requests"]

    def clear(self) -> None:
        self.http.delete(self.url + "/sim/requests")


def start_sims(group: ProcGroup, specs: dict[str, str], http: httpx.Client) -> dict[str, SimProc]:
    """Start every sim first, then wait for all of them (they boot in parallel)."""
    sims = {}
    for name, argline in specs.items():
        args = shlex.split(argline)
        port, kv_port = free_port(), free_port()
        role = args[args.index("--role") + 1] if "--role" in args else "both"
        proc = group.start(
            name,
            [sys.executable, "-m", "sim", "--port", str(port), "--kv-port", str(kv_port), *args],
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
        )
        sims[name] = SimProc(proc, port, kv_port, role, http)
    for sim in sims.values():
        sim.proc.wait_http(sim.url + "/health", timeout=60)
    return sims


@pytest.fixture(scope="session")
def sims(sim_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Real engines on loopback, shared by the end-to-end tests (each test clears what it reads).

    prefill / decode: the P/D pair; expiring: a prefill engine whose blocks expire after 0.4 s
    (and a small context); tok: role both with the test tokenizer and request-id headers;
    slow: role both with latencies and a single running slot, for disconnects and queueing.
    """
    group = ProcGroup(tmp_path_factory.mktemp("sim-logs"))
    http = httpx.Client(timeout=30)
    try:
        yield start_sims(
            group,
            {
                "prefill": "--role prefill --block-size 16 --engine-id prefill-e2e",
                "decode": "--role decode --kv-handshake-timeout 0.5 --engine-id decode-e2e",
                "expiring": "--role prefill --kv-expiry 0.4 --max-model-len 128 --num-gpu-blocks 64",
                "tok": f"--model tiny --tokenizer {shlex.quote(str(sim_tokenizer_dir))} --enable-request-id-headers",
                "slow": "--max-num-seqs 1 --prefill-time-per-token 0.005 --decode-time-per-token 0.05 "
                "--num-gpu-blocks 256 --max-model-len 2048",
            },
            http,
        )
    finally:
        http.close()
        group.stop_all()
