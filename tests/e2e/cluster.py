"""A gateway in front of simulated engines, all real processes on loopback."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from tests.procs import Proc, ProcGroup, free_port, wait_for


@dataclass
class Sim:
    proc: Proc
    port: int
    kv_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[dict]:
        data = httpx.get(self.url + "/sim/requests", timeout=10).json()
        return data["requests"] if isinstance(data, dict) else data

    def clear(self) -> None:
        httpx.delete(self.url + "/sim/requests", timeout=10)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


@dataclass
class Cluster:
    group: ProcGroup
    tokenizer: Path
    model: str = "tiny"
    prefill: list[Sim] = field(default_factory=list)
    decode: list[Sim] = field(default_factory=list)
    gateway: Proc | None = None
    gateway_port: int = 0
    config_path: Path | None = None
    config: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def access_line(self, rid: str) -> dict:
        """The gateway's access log line for request ``rid`` (waits for it to be written)."""
        assert self.gateway is not None
        log_path = self.gateway.log_path

        def found() -> dict | None:
            for line in log_path.read_text().splitlines():
                if line.startswith("{") and f'"request_id":"{rid}"' in line:
                    return json.loads(line)
            return None

        assert wait_for(lambda: found() is not None, timeout=5), f"no access log line for {rid}"
        line = found()
        assert line is not None
        return line

    def start_sim(
        self,
        role: str,
        *extra: str,
        port: int | None = None,
        kv_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Sim:
        port, kv_port = port or free_port(), kv_port or free_port()
        name = f"sim-{role}-{port}"
        proc = self.group.start(
            name,
            [
                sys.executable,
                "-m",
                "sim",
                "--role",
                role,
                "--port",
                str(port),
                "--kv-port",
                str(kv_port),
                "--model",
                self.model,
                "--tokenizer",
                str(self.tokenizer),
                "--max-model-len",
                "4096",
                *extra,
            ],
            env=env,
        )
        sim = Sim(proc, port, kv_port)
        proc.wait_http(sim.url + "/health")
        return sim

    def start_gateway(
        self, threshold: int, env: dict[str, str] | None = None, command: tuple[str, ...] = ("serve",), **overrides
    ) -> None:
        self.gateway_port = free_port()
        # one worker unless a test asks for more (tests/e2e/test_workers.py): most tests read state
        # that a second worker would hold apart, and this machine has few cores
        server = {
            "host": "127.0.0.1",
            "port": self.gateway_port,
            "max_body_bytes": 1_000_000,
            "workers": 1,
            **overrides.pop("server", {}),
        }  # the listening address stays the one chosen here
        server["port"] = self.gateway_port
        cfg = {
            "server": server,
            "models": [{"name": self.model, "tokenizer": str(self.tokenizer), "max_model_len": 4096}],
            "pools": {
                "prefill": {"endpoints": [s.url for s in self.prefill]},
                "decode": {"endpoints": [s.url for s in self.decode]},
            },
            "routing": {"decider": {"name": "token_threshold", "threshold": threshold}},
            "health": {"interval_s": 0.3, "timeout_s": 0.5},
            **overrides,
        }
        path = self.group.log_dir / f"gateway-{self.gateway_port}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.config_path, self.config = path, cfg
        self.gateway = self.group.start(
            "gateway", [sys.executable, "-m", "gateway", *command, "--config", str(path)], env=env
        )
        self.gateway.wait_http(self.url + "/ready", timeout=60)
