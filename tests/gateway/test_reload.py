"""The config watcher: in-place edits, ConfigMap symlink swaps, invalid edits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import yaml

from gateway.config import GatewayConfig
from gateway.config.reload import ConfigWatcher, read_snapshot, version_of
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
            f.write(whole[len(half) :])
        await until(lambda: rec.applied)
        rounds = w.rounds
        await until(lambda: w.rounds >= rounds + 2)  # what a later check could still apply
        assert rec.applied == [(300, version_of(whole))]
    finally:
        await w.stop()


# -- the files a config names (issue 27): watched, versioned and applied with it ------------------


class KeysRecorder:
    """Records the API keys each applied config holds, read as ``apply`` would: from its pins."""

    def __init__(self) -> None:
        self.applied: list[tuple[list[str], str]] = []
        self.configs: list[GatewayConfig] = []
        self.results: list[tuple[str, str]] = []

    async def apply(self, cfg: GatewayConfig, version: str) -> None:
        keys = [e.key for e in cfg.key_entries()]  # raises ValueError for a keys file that does not load
        self.applied.append((keys, version))
        self.configs.append(cfg)

    def result(self, result: str, message: str) -> None:
        self.results.append((result, message))


def with_keys(keys_file: Path) -> dict:
    return {**config(100), "auth": {"api_keys_file": str(keys_file)}}


def replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_a_key_removed_from_the_keys_file_is_a_new_version_applied_whole(tmp_path):
    """The keys live in another directory than the config (a Secret mount): removing a key there
    reloads, with a version that differs from the config file's alone."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "secrets").mkdir()
    keys = tmp_path / "secrets" / "api-keys"
    keys.write_text("sk-a\nsk-b\n")
    path = tmp_path / "etc" / "pdgate.yaml"
    first = write(path, with_keys(keys))
    start = read_snapshot(path)
    assert start.version != version_of(first)  # the keys are part of the version
    rec = KeysRecorder()
    w = ConfigWatcher(path, start.version, rec.apply, rec.result, poll_s=5.0, settle_s=0.2)
    w.start()
    try:
        assert keys in w.watched
        await asyncio.sleep(0.3)  # the file watcher registers asynchronously and says nothing when it has
        replace_text(keys, "sk-a\n")
        await until(lambda: rec.applied, timeout=4.0, what="the keys file's edit, before the 5 s poll")
        assert rec.applied[0][0] == ["sk-a"] and w.version == rec.applied[0][1] != start.version
        # what was applied is what was validated: a later edit of the file changes nothing in it
        keys.write_text("sk-z\n")
        assert [e.key for e in rec.configs[0].key_entries()] == ["sk-a"]
        await until(lambda: len(rec.applied) == 2, timeout=10)
        assert rec.applied[1][0] == ["sk-z"]
    finally:
        await w.stop()


async def test_an_invalid_keys_file_is_rejected_and_the_running_keys_stay(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-a\n")
    path = tmp_path / "pdgate.yaml"
    write(path, with_keys(keys))
    rec = KeysRecorder()
    w = ConfigWatcher(path, read_snapshot(path).version, rec.apply, rec.result, poll_s=0.2, settle_s=0.2)
    w.start()
    try:
        running = w.version
        replace_text(keys, "sk-a\nsk-a\n")  # a key twice: the file does not load
        await until(lambda: rec.results, timeout=10)
        assert rec.results[-1][0] == "rejected" and "listed twice" in rec.results[-1][1]
        assert w.version == running and not rec.applied
        rounds = w.rounds
        await until(lambda: w.rounds >= rounds + 2)
        assert len(rec.results) == 1  # a rejected version is not re-reported on every poll
        keys.unlink()  # gone: rejected too (it cannot be read), still the same running version
        await until(lambda: len(rec.results) == 2, timeout=10)
        assert "cannot read" in rec.results[-1][1] and w.version == running
        replace_text(keys, "sk-b\n")
        await until(lambda: rec.applied, timeout=10)
        assert rec.applied[-1][0] == ["sk-b"]
    finally:
        await w.stop()


async def test_a_secret_volumes_symlink_swap_of_the_keys_file_reloads(tmp_path):
    """Kubernetes mounts a Secret as FILE -> ..data/FILE; an update swaps ``..data``."""
    secret = tmp_path / "secret"
    secret.mkdir()

    def publish(name: str, text: str) -> None:
        (secret / name).mkdir()
        (secret / name / "api-keys").write_text(text)
        link = secret / "..data_tmp"
        link.symlink_to(name)
        os.replace(link, secret / "..data")

    publish("..2026_1", "sk-old\n")
    (secret / "api-keys").symlink_to("..data/api-keys")
    path = tmp_path / "pdgate.yaml"
    write(path, with_keys(secret / "api-keys"))
    rec = KeysRecorder()
    w = ConfigWatcher(path, read_snapshot(path).version, rec.apply, rec.result, poll_s=5.0, settle_s=0.2)
    w.start()
    try:
        await asyncio.sleep(0.3)  # the file watcher registers asynchronously
        publish("..2026_2", "sk-new\n")
        await until(lambda: rec.applied, timeout=4.0, what="the swap's event, before the 5 s poll")
        assert rec.applied == [(["sk-new"], w.version)]
    finally:
        await w.stop()


async def test_the_watcher_follows_the_files_the_config_names_now(tmp_path):
    """A config that moves its keys to another directory: edits there are watched from then on."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "keys").write_text(f"sk-{d}\n")
    path = tmp_path / "pdgate.yaml"
    write(path, with_keys(tmp_path / "a" / "keys"))
    rec = KeysRecorder()
    w = ConfigWatcher(path, read_snapshot(path).version, rec.apply, rec.result, poll_s=5.0, settle_s=0.2)
    w.start()
    try:
        await asyncio.sleep(0.3)
        write(path, with_keys(tmp_path / "b" / "keys"))
        await until(lambda: rec.applied, timeout=4.0)
        assert rec.applied[-1][0] == ["sk-b"] and tmp_path / "b" / "keys" in w.watched
        await asyncio.sleep(0.5)  # the watch restarts on the new directory
        replace_text(tmp_path / "b" / "keys", "sk-b2\n")
        await until(lambda: len(rec.applied) == 2, timeout=4.0, what="an edit in the new directory, before the poll")
        assert rec.applied[-1][0] == ["sk-b2"]
    finally:
        await w.stop()


async def test_a_template_file_and_the_admin_token_file_are_versioned_too(tmp_path):
    template, token = tmp_path / "chat.jinja", tmp_path / "admin-token"
    template.write_text("{{ messages }}\n")
    token.write_text("t1")
    path = tmp_path / "pdgate.yaml"
    data = config(100)
    data["models"][0]["chat_template"] = str(template)
    data["admin"] = {"token_file": str(token)}
    write(path, data)
    seen = []

    async def apply(cfg: GatewayConfig, version: str) -> None:
        seen.append((cfg.tokenizer_model(cfg.models[0]).chat_template, cfg.admin_token()))

    w = ConfigWatcher(path, read_snapshot(path).version, apply, lambda *_: None, poll_s=0.2, settle_s=0.2)
    w.start()
    try:
        replace_text(template, "{{ messages | length }}\n")
        await until(lambda: seen, timeout=10)
        assert seen[-1] == ("{{ messages | length }}\n", "t1")  # the template's text, as the tokenizer gets it
        replace_text(token, "t2")
        await until(lambda: len(seen) == 2, timeout=10)
        assert seen[-1][1] == "t2"
    finally:
        await w.stop()


async def test_a_directory_never_quiet_is_still_polled(tmp_path):
    """A log written next to the config under load (every write an event): the watch never times
    out, and a change whose event was lost (a full inotify queue) must still be found by the poll.
    The lost event is played by a watcher that starts behind the file: no event will ever come."""
    path = tmp_path / "pdgate.yaml"
    raw = write(path, config(200))
    rec = Recorder()
    w = ConfigWatcher(path, "behind", rec.apply, rec.result, poll_s=0.5, settle_s=0.1)
    stop = asyncio.Event()

    async def noisy_log() -> None:
        with open(tmp_path / "gateway.log", "ab") as log:  # noqa: ASYNC230 - tiny writes, the point
            while not stop.is_set():
                log.write(b"an access line\n")
                log.flush()
                await asyncio.sleep(0.02)

    writer = asyncio.create_task(noisy_log())
    w.start()
    try:
        await until(lambda: rec.applied, timeout=10, what="a poll while the directory is busy")
        assert rec.applied == [(200, version_of(raw))]
    finally:
        stop.set()
        await writer
        await w.stop()
