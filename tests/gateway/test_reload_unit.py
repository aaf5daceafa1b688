"""The config watcher: in-place edits, ConfigMap symlink swaps, invalid edits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import yaml

from gateway.config import GatewayConfig
from gateway.reload import ConfigWatcher, version_of
from tests.waiting import until


def config(threshold: int) -> dict:
    return {
        "models": [{"name": "m", "tokenizer": "t", "max_model_len": 100}],
        "pools": {"decode": {"endpoints": ["http://127.0.0.1:9"]}},
        "routing": {"decider": {"name": "token_threshold", "threshold": threshold}},
    }


class Recorder:
    def __init__(self) -> None:
        self.applied: list[tuple[int, str]] = []
        self.results: list[tuple[str, str]] = []

    async def apply(self, cfg: GatewayConfig, version: str) -> None:
        threshold = cfg.routing.decider.params.get("threshold", 4096)  # the default, when the section is missing
        if threshold == 13:
            raise ValueError("unlucky threshold")  # what apply does for an unusable policy
        self.applied.append((threshold, version))

    def result(self, result: str, message: str) -> None:
        self.results.append((result, message))


def write(path: Path, data: dict) -> bytes:
    raw = yaml.safe_dump(data).encode()
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return raw


async def test_in_place_edit_invalid_edit_and_same_content(tmp_path):
    path = tmp_path / "pdgate.yaml"
    first = write(path, config(100))
    rec = Recorder()
    w = ConfigWatcher(path, version_of(first), rec.apply, rec.result, poll_s=0.2)
    w.start()
    try:
        raw = write(path, config(200))
        await until(lambda: rec.applied)
        assert rec.applied == [(200, version_of(raw))] and w.version == version_of(raw)

        path.write_text("models: [oops")  # YAML syntax error
        await until(lambda: any(r == "rejected" for r, _ in rec.results))
        assert "YAML syntax error" in rec.results[-1][1] and "line" in rec.results[-1][1]
        assert w.version == version_of(raw) and w.last_error

        write(path, config(13))  # valid YAML, refused by apply
        await until(lambda: "unlucky" in rec.results[-1][1])

        n, rounds = len(rec.results), w.rounds
        await until(lambda: w.rounds >= rounds + 2)  # it polls again: a rejected version is not re-reported
        assert len(rec.results) == n
        write(path, config(300))
        await until(lambda: rec.applied[-1][0] == 300)
        assert w.last_error is None
    finally:
        await w.stop()


async def test_configmap_symlink_swap(tmp_path):
    """Kubernetes mounts a ConfigMap as FILE -> ..data/FILE, ..data -> ..<timestamp>/; an update
    writes a new timestamped directory and atomically renames a new ..data symlink over the old."""
    def publish(name: str, data: dict) -> bytes:
        d = tmp_path / name
        d.mkdir()
        raw = yaml.safe_dump(data).encode()
        (d / "pdgate.yaml").write_bytes(raw)
        tmp_link = tmp_path / "..data_tmp"
        tmp_link.symlink_to(name)
        os.replace(tmp_link, tmp_path / "..data")
        return raw

    first = publish("..2026_11_29_1", config(100))
    (tmp_path / "pdgate.yaml").symlink_to("..data/pdgate.yaml")
    rec = Recorder()
    w = ConfigWatcher(tmp_path / "pdgate.yaml", version_of(first), rec.apply, rec.result, poll_s=5.0)
    w.start()
    try:
        await asyncio.sleep(0.3)  # the file watcher registers asynchronously and says nothing when it has
        raw = publish("..2026_11_29_2", config(777))
        await until(lambda: rec.applied, timeout=4.0)  # before the 5 s poll: the swap's event did it
        assert rec.applied == [(777, version_of(raw))]
    finally:
        await w.stop()


async def test_a_file_caught_half_written_is_never_applied(tmp_path):
    """A writer that pauses after a valid YAML prefix: the prefix is a config of its own (here the
    decider section is missing, so the default threshold would apply) and must not be served."""
    path = tmp_path / "pdgate.yaml"
    first = write(path, config(100))
    rec = Recorder()
    w = ConfigWatcher(path, version_of(first), rec.apply, rec.result, poll_s=0.1, settle_s=0.5)
    w.start()
    try:
        whole = yaml.safe_dump(config(300), sort_keys=False).encode()
        half = whole[: whole.index(b"routing:")]
        assert yaml.safe_load(half)  # valid YAML on its own
        with open(path, "wb") as f:  # noqa: ASYNC230 - a plain rewrite, not atomic, paused half-way
            f.write(half)
            f.flush()
            await asyncio.sleep(0.3)
            f.write(whole[len(half):])
        await until(lambda: rec.applied)
        rounds = w.rounds
        await until(lambda: w.rounds >= rounds + 2)  # what a later check could still apply
        assert rec.applied == [(300, version_of(whole))]
    finally:
        await w.stop()
