"""Fixtures for the real-engine suite: a real vLLM prefill engine and decode engine (CPU, NIXL),
and the real gateway in front of them. One engine pair for the package: it costs ~60 s to start,
so the modules that need it share it. Modules run in file order, so it starts after
``test_kv_events.py`` (whose own engine must not share the two cores with two busy-spinning ones).

The decode engine also publishes its KV cache events (ZMQ, on a wildcard address: vLLM connects
instead of binding for any other address) with a fixed ``PYTHONHASHSEED``, so a gateway can follow
its prefix cache; ``VLLM_SERVER_DEV_MODE`` gives it ``/reset_prefix_cache``.

Nothing here skips on its own: if the venv cannot be built or an engine does not come up, the
tests fail with the reason. ``PDGATE_SKIP_REALVLLM=1`` skips the suite on purpose (local runs).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.otlp import Collector
from tests.procs import Proc, ProcGroup, free_port

from . import engines as E
from . import guide
from .lora import make_adapter

THRESHOLD = 512  # the gateway's token_threshold decider: P/D from this many prompt tokens
# The engines' PYTHONHASHSEED, the seed of their prefix-cache block hashes: the guide's.
HASH_SEED = guide.command("engine decode").env["PYTHONHASHSEED"]


def pytest_configure(config: pytest.Config) -> None:
    """The venv build's progress is shown past pytest's capture (engines.ensure_venv)."""
    E.CAPTURE = config.pluginmanager.getplugin("capturemanager")


@dataclass
class Pair:
    prefill: E.Engine
    decode: E.Engine
    model_dir: Path
    group: ProcGroup
    kv_events: str  # the decode engine's KV event publisher, as a subscriber connects to it
    kv_events_replay: str
    collector: Collector  # both engines export their request spans here (OTLP/HTTP)
    adapters: dict[str, Path]  # tiny LoRA adapters: adpA loaded at start on both, adpB loadable


ADAPTER = "adpA"  # loaded by both engines at start (--lora-modules)
LOADABLE = "adpB"  # on disk only: dynamic loading puts it on the engines the gateway picks


@dataclass
class Gateway:
    proc: Proc
    port: int
    config_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="package")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    venv, model_dir = E.venv_and_model()
    work = tmp_path_factory.mktemp("realvllm")
    group = ProcGroup(work)
    collector = Collector()
    pair = None
    try:
        p_core, d_core = E.engine_cores()
        adapters = {
            name: make_adapter(model_dir, work / "adapters" / name, seed)
            for seed, name in enumerate((ADAPTER, LOADABLE))
        }
        # LoRA on both engines (tests/realvllm/test_lora_real.py): one adapter at start, room for two
        # in a batch, runtime loading allowed (vLLM's /v1/load_lora_adapter).
        lora_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
        lora_args += ["--lora-modules", f"{ADAPTER}={adapters[ADAPTER]}"]
        lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        # vLLM joins the trace context it is sent and exports one span per request; every 0.2 s.
        tracing_args = ["--otlp-traces-endpoint", collector.url]
        tracing_env = {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        # Both engines as docs/one-node.md starts them (tests/realvllm/guide.py), plus tracing here,
        # and dev mode on the decode engine for /reset_prefix_cache.
        pub, replay = free_port(), free_port()
        prefill = E.start_guide_engine(
            group,
            "prefill",
            venv,
            model_dir,
            work,
            p_core,
            extra_args=tracing_args + lora_args,
            extra_env={**tracing_env, **lora_env},
        )
        decode = E.start_guide_engine(
            group,
            "decode",
            venv,
            model_dir,
            work,
            d_core,
            events_port=pub,
            replay_port=replay,
            extra_args=tracing_args + lora_args,
            extra_env={"VLLM_SERVER_DEV_MODE": "1", **tracing_env, **lora_env},
        )
        events = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        pair = Pair(prefill, decode, model_dir, group, *events, collector, adapters)
        failure = None
        try:
            E.wait_ready([prefill, decode])
        except E.SetupError as err:
            failure = str(err)
        if failure:
            pytest.fail(f"real vLLM engines did not start: {failure}", pytrace=False)
        for eng in (prefill, decode):
            E.pin_engine(eng)
        yield pair
    finally:
        group.stop_all()
        collector.stop()
        if pair is not None:
            pair.prefill.http.close()
            pair.decode.http.close()


def start_gateway(pair: Pair, name: str, command: tuple[str, ...] = ("serve",), **overrides: object) -> Gateway:
    """The real gateway in front of the pair (``overrides`` replace top-level config sections;
    ``command``: ``pdgate``'s, ``("epp", ...)`` for the endpoint picker); returns once it sees both
    engines healthy. Stop it with ``gw.proc.stop()``."""
    port = free_port()
    server = {"host": "127.0.0.1", "workers": 1, **overrides.pop("server", {}), "port": port}
    cfg = {
        "server": server,
        "models": [{"name": E.MODEL_NAME, "tokenizer": str(pair.model_dir), "max_model_len": E.MAX_MODEL_LEN}],
        "pools": {
            "prefill": {"endpoints": [pair.prefill.url]},
            "decode": {"endpoints": [pair.decode.url]},
        },
        "routing": {"decider": {"name": "token_threshold", "threshold": THRESHOLD}},
        # The engines take these cores by design: a gateway starved of CPU here is not an overloaded one.
        "admission": {"max_loop_lag_ms": 0},
        **overrides,
    }
    path = pair.group.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [sys.executable, "-m", "gateway", *command, "--config", str(path)]
    proc = pair.group.start(name, argv, cwd=str(E.REPO))
    gw = Gateway(proc, port, path)
    try:
        proc.wait_http(gw.url + "/ready", timeout=90)
        # /ready needs only a decode engine; these tests need the prefill pool up too.
        ok = E.wait_until(
            lambda: httpx.get(gw.url + "/ready", timeout=5).json()["pools"]["prefill"]["healthy"] == 1,
            timeout=30,
        )
        assert ok, f"the gateway never saw the prefill engine healthy:\n{proc.log_tail()}"
    except BaseException:
        proc.stop()
        raise
    return gw


@pytest.fixture(scope="module")
def gateway(vllm_pair: Pair) -> Iterator[Gateway]:
    # These tests are about the handshake and the API: a repeated long prompt must take the P/D
    # path again, not go direct because the prefix index remembers it.
    routing = {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}}
    gw = start_gateway(vllm_pair, "gateway", routing=routing)
    try:
        yield gw
    finally:
        gw.proc.stop()
