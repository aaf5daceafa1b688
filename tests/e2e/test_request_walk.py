"""One request's walk, socket to engine and back, touches the packages in the order that
docs/architecture.md draws them (its "A request's journey" diagram)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.procs import ProcGroup, free_port, wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _drawn_order() -> list[str]:
    """The modules the diagram names, top to bottom (``tokenization/``: any module of it)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("## A request's journey through the packages", 1)[1].split("```")[1]
    order = []
    for line in diagram.splitlines():
        if m := re.search(r"\b((?:http|request|engines|fairness|tokenization|ops)/[a-z0-9_]*(?:\.py)?)", line):
            order.append("gateway." + m.group(1).removesuffix(".py").replace("/", ".").rstrip("."))
    return order


def _matches(drawn: str, module: str) -> bool:
    return module == drawn or module.startswith(drawn + ".")


def test_a_request_walks_the_packages_in_the_drawn_order(tokenizer_dir, tmp_path):
    drawn = _drawn_order()
    assert drawn[:3] == ["gateway.http.server", "gateway.http.app", "gateway.request.relay"], drawn
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    try:
        # tokens 20 ms apart (0.3 s for 16): the answer does not all come in the first read, which
        # would leave nothing to splice
        prefill, decode = c.start_sim("prefill"), c.start_sim("decode", "--decode-time-per-token", "0.02")
        out, port = tmp_path / "walk.json", free_port()
        flags = ["--prefill", prefill.url, "--decode", decode.url, "--model", "tiny"]
        flags += ["--tokenizer", str(tokenizer_dir), "--threshold", "64", "--max-model-len", "4096", "--workers", "1"]
        group.start("walk", [sys.executable, "-m", "tests.e2e.request_walk", str(out), str(port), "--", *flags])
        assert wait_for(out.exists, timeout=120), "the walk wrote nothing"
        walk = json.loads(out.read_text())
    finally:
        group.stop_all()
    assert walk["status"] == 200 and walk["path"] == "pd" and walk["chunks"] > 2, walk
    modules = walk["modules"]
    # the drawn steps, as a subsequence of the walk: each entered after the one drawn above it
    at, entered = 0, []
    for step in drawn:
        hit = next((i for i in range(at, len(modules)) if _matches(step, modules[i])), None)
        assert hit is not None, f"{step} is not entered after {entered[-1:]}: {_unique(modules)}"
        entered.append(step)
        at = hit + 1


def _unique(modules: list[str]) -> list[str]:
    return list(dict.fromkeys(modules))
