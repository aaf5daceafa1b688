"""The commands of docs/one-node.md, as the real-vLLM suite runs them.

The guide's blocks marked ``<!-- tested: NAME -->`` are read from the page, so what a user copies
is what the suite starts. What the suite changes, and why, is all here:

- ports: free ones instead of 8100/8200/5600/5601/5557/5558/8000 (tests run side by side);
- ``python`` is the cached CPU venv's, ``"$MODEL"`` the tiny model the suite builds, served as
  ``tiny`` (``--served-model-name``), and ``--max-model-len`` the tiny model's;
- added for a 2-core test machine: ``--enforce-eager`` (no compile step), ``--dtype float32``
  (greedy answers stay equal across engines; see engines.engine_argv), ``--host 127.0.0.1``, a
  smaller CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``), one core per engine, offline hub flags;
- ``PYTHONHASHSEED`` stays the guide's.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "one-node.md"
_BLOCK = re.compile(r"<!-- tested: (?P<name>[\w -]+?) -->\s*\n```bash\n(?P<body>.*?)\n```", re.S)
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass
class Command:
    env: dict[str, str]  # the NAME=value words before the program
    argv: list[str]

    def flag(self, name: str) -> str:
        """The word after ``name`` (KeyError when the flag is absent)."""
        try:
            return self.argv[self.argv.index(name) + 1]
        except ValueError:
            raise KeyError(name) from None

    def set_flag(self, name: str, value: str) -> None:
        self.argv[self.argv.index(name) + 1] = value


def blocks(text: str | None = None) -> dict[str, str]:
    """Every tested block of the guide by name: its shell text."""
    text = GUIDE.read_text(encoding="utf-8") if text is None else text
    return {m["name"].strip(): m["body"] for m in _BLOCK.finditer(text)}


def parse(body: str) -> Command:
    """One shell command as the guide writes it: comment lines, backslash-newlines, leading
    ``NAME=value`` assignments; the words as bash would split them (no expansion: ``"$MODEL"``
    stays ``$MODEL``)."""
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("#")]
    words = shlex.split("\n".join(lines).replace("\\\n", " "))
    env: dict[str, str] = {}
    while words and _ENV.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return Command(env, words)


def command(name: str) -> Command:
    found = blocks()
    if name not in found:
        raise KeyError(f"{GUIDE.name} has no block marked '<!-- tested: {name} -->' (found: {sorted(found)})")
    return parse(found[name])


def engine_command(
    role: str,
    *,
    python: Path,
    model_dir: Path,
    served_name: str,
    max_model_len: int,
    port: int,
    side_channel_port: int,
    events_port: int | None = None,
    replay_port: int | None = None,
) -> Command:
    """The guide's ``engine ROLE`` command with the suite's ports, program and model."""
    cmd = command(f"engine {role}")
    program = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "$MODEL"]
    assert cmd.argv[:5] == program, f"unexpected engine command in {GUIDE.name}: {cmd.argv[:5]}"
    cmd.argv[:5] = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd.set_flag("--port", str(port))
    cmd.set_flag("--max-model-len", str(max_model_len))
    cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    if "--kv-events-config" in cmd.argv:
        events = json.loads(cmd.flag("--kv-events-config"))
        assert events_port is not None and replay_port is not None, f"the guide's {role} engine publishes KV events"
        events["endpoint"] = f"tcp://*:{events_port}"
        events["replay_endpoint"] = f"tcp://*:{replay_port}"
        cmd.set_flag("--kv-events-config", json.dumps(events))
    cmd.argv += ["--served-model-name", served_name, "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32"]
    return cmd


def gateway_command(
    *, model_dir: Path, served_name: str, port: int, prefill_url: str, decode_url: str, events_port: int
) -> Command:
    """The guide's gateway command with the suite's ports and model (``pdgate`` as ``python -m gateway``)."""
    cmd = command("gateway")
    assert cmd.argv[:2] == ["pdgate", "serve"], f"unexpected gateway command in {GUIDE.name}: {cmd.argv[:2]}"
    cmd.set_flag("--port", str(port))
    cmd.set_flag("--model", served_name)
    cmd.set_flag("--prefill", prefill_url)
    i = cmd.argv.index("--decode")
    cmd.argv[i + 1 : i + 3] = [decode_url, str(events_port)]
    cmd.argv += ["--tokenizer", str(model_dir), "--host", "127.0.0.1", "--workers", "1"]
    return cmd
