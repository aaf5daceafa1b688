"""bench/streams.py's instruments on a small run: the lean backend streams what it is asked, each
stream on its own phase at the asked rate, and the lean client counts every event (directly and
through a two-worker gateway)."""

from __future__ import annotations

import sys

import yaml

from bench.streams import _admission, _allowed_cpus, _cpu_list, _parser, _workers
from bench.streams_load import MODEL, run_load
from gateway.config.schema import AdmissionConfig
from tests.procs import ProcGroup, free_port


def test_the_lean_backend_and_client_measure_streams(tmp_path, tokenizer_dir):
    group = ProcGroup(tmp_path)
    try:
        port = free_port()
        group.start(
            "backend",
            [sys.executable, "-m", "bench.streams", "backend", "--port", str(port), "--rate", "100", "--tokens", "10"],
        ).wait_http(f"http://127.0.0.1:{port}/health")
        direct = run_load(f"http://127.0.0.1:{port}", 40, 2, 0.2, 10, 100.0)
        assert direct["errors"] == 0 and direct["streams"] == 40
        assert 5 <= direct["gap_p50_ms"] <= 30  # 10 ms apart, give or take this machine
        assert 0.09 <= direct["duration_p50_s"] <= 0.5
        gw = free_port()
        cfg = {
            "server": {"host": "127.0.0.1", "port": gw, "workers": 2},
            "models": [{"name": MODEL, "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
            "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [f"http://127.0.0.1:{port}"]}},
        }
        (tmp_path / "gw.yaml").write_text(yaml.safe_dump(cfg))
        group.start(
            "gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "gw.yaml")]
        ).wait_http(f"http://127.0.0.1:{gw}/ready", timeout=60)
        through = run_load(f"http://127.0.0.1:{gw}", 40, 2, 0.2, 10, 100.0)
        assert through["errors"] == 0 and through["first_chunk_p50_ms"] is not None
    finally:
        group.stop_all()


def test_core_lists_read_as_taskset_writes_them() -> None:
    import os

    assert _cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert _cpu_list("5") == {5}
    assert _cpu_list(_allowed_cpus(os.getpid())) == os.sched_getaffinity(0)


def test_the_gateway_under_test_gets_the_admission_a_user_gets_unless_asked() -> None:
    """The overload bound and its hold decide how many streams are served and how late: by default
    the run measures the gateway's own defaults, and either can be set for an A/B."""
    defaults = AdmissionConfig()
    assert _admission(_parser().parse_args([])) == {
        "max_loop_lag_ms": defaults.max_loop_lag_ms,
        "overload_hold_s": defaults.overload_hold_s,
    }
    asked = _admission(_parser().parse_args(["--overload-hold-s", "0", "--max-loop-lag-ms", "50"]))
    assert asked == {"max_loop_lag_ms": 50.0, "overload_hold_s": 0.0}


def test_targets_name_their_worker_count_with_migration_on_or_off() -> None:
    assert [_workers(t) for t in ("pdgate", "pdgate-nomig", "pdgate-w4", "pdgate-w8-nomig", "baseline")] == [
        1,
        1,
        4,
        8,
        1,
    ]
