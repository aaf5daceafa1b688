"""Workloads for the planner and the fleet simulator: request classes with their length ranges,
shared prefixes and SLOs, or a trace of real requests; arrivals at any rate from one seed.

A workload file (YAML or JSON)::

    classes:
      - {name: chat, share: 0.7, prompt: [100, 1500], output: [50, 400], ttft_s: 1.0, itl_p90_s: 0.05}
      - {name: long, share: 0.3, prompt: [4096, 16384], output: [256, 1024], ttft_s: 3.0, itl_p90_s: 0.05}
    # optional, per class: itl_p99_s (the tail SLO, default 0.1), shared_prefix: tokens every request
    # of the class starts with, prefix_groups: how many distinct such prefixes (default 1)

or a trace (``--trace FILE.jsonl``): one request per line, ``{"t": seconds, "prompt_tokens": n,
"output_tokens": m, "class": "chat"}``; its classes' SLOs come from a workload file, or from the
defaults of ``chat`` (TTFT 1 s) and ``long`` (3 s) by prompt length. A trace replayed at another
rate is compressed or stretched in time.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_model.fleet import Job
from engine_model.yamlfile import read_yaml

MAX_CLASSES = 32
MAX_TRACE_LINES = 1_000_000


@dataclass(frozen=True)
class Klass:
    name: str
    share: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    ttft_s: float
    itl_p90_s: float
    itl_p99_s: float = 0.100
    shared_prefix: int = 0
    prefix_groups: int = 1

    def __post_init__(self) -> None:
        for label, (lo, hi) in (("prompt", self.prompt), ("output", self.output)):
            if not 1 <= lo <= hi:
                raise ValueError(f"class {self.name}: {label} must be [low, high] with 1 <= low <= high")
        if self.share <= 0 or self.ttft_s <= 0 or self.itl_p90_s <= 0 or self.itl_p99_s <= 0:
            raise ValueError(f"class {self.name}: share and SLOs must be positive")
        if self.shared_prefix < 0 or self.prefix_groups < 1:
            raise ValueError(f"class {self.name}: shared_prefix >= 0 and prefix_groups >= 1")


PRESETS: dict[str, tuple[Klass, ...]] = {
    "chat": (Klass("chat", 1.0, (100, 1500), (50, 400), 1.0, 0.05),),
    "long": (Klass("long", 1.0, (4096, 16384), (256, 1024), 3.0, 0.05),),
    "mix": (
        Klass("chat", 0.7, (100, 1500), (50, 400), 1.0, 0.05),
        Klass("long", 0.3, (4096, 16384), (256, 1024), 3.0, 0.05),
    ),
    "rag": (Klass("rag", 1.0, (6000, 12000), (100, 300), 2.0, 0.05, shared_prefix=4000, prefix_groups=20),),
}


@dataclass(frozen=True)
class Workload:
    classes: tuple[Klass, ...] = ()
    trace: tuple[tuple[float, int, int, str], ...] = ()  # (t, prompt, output, class name)

    @property
    def mean_rate(self) -> float | None:
        """A trace's own request rate (None for a class mix: any rate)."""
        if len(self.trace) < 2 or self.trace[-1][0] <= self.trace[0][0]:
            return None
        return (len(self.trace) - 1) / (self.trace[-1][0] - self.trace[0][0])

    def jobs(self, rate: float, duration_s: float, seed: int = 0) -> list[Job]:
        """Poisson arrivals at ``rate`` req/s for ``duration_s`` (a trace: replayed at ``rate``)."""
        if rate <= 0 or duration_s <= 0:
            raise ValueError("rate and duration must be positive")
        if self.trace:
            return self._trace_jobs(rate, duration_s)
        rng = random.Random(seed)
        shares = [k.share for k in self.classes]
        out: list[Job] = []
        t = 0.0
        while True:
            t += rng.expovariate(1.0)  # unit-rate gaps, scaled: the same requests at every rate
            if t / rate > duration_s:
                return out
            k = rng.choices(self.classes, shares)[0]
            group = rng.randrange(k.prefix_groups) + 1 if k.shared_prefix else 0
            out.append(
                Job(
                    arrival_s=t / rate,
                    prompt_tokens=rng.randint(*k.prompt),
                    output_tokens=rng.randint(*k.output),
                    ttft_slo_s=k.ttft_s,
                    itl_p90_slo_s=k.itl_p90_s,
                    itl_p99_slo_s=k.itl_p99_s,
                    klass=k.name,
                    prefix=(zlib.crc32(f"{k.name}/{group}".encode()) % 100_000 + 1, k.shared_prefix)
                    if group
                    else (0, 0),
                )
            )

    def _trace_jobs(self, rate: float, duration_s: float) -> list[Job]:
        own = self.mean_rate or rate
        t0 = self.trace[0][0]
        slo = {k.name: k for k in self.classes}
        out = []
        for t, prompt, output, name in self.trace:
            at = (t - t0) * own / rate
            if at > duration_s:
                break
            k = slo.get(name) or _default_class(prompt)
            out.append(Job(at, prompt, output, k.ttft_s, k.itl_p90_s, k.itl_p99_s, klass=name or k.name))
        return out


def _default_class(prompt_tokens: int) -> Klass:
    return PRESETS["long"][0] if prompt_tokens >= 4096 else PRESETS["chat"][0]


def _pair(v: Any, where: str) -> tuple[int, int]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
        raise ValueError(f"{where} must be [low, high] in tokens")
    return int(v[0]), int(v[1])


def from_dict(doc: Any) -> Workload:
    if not isinstance(doc, dict) or not isinstance(doc.get("classes"), list) or not doc["classes"]:
        raise ValueError("a workload needs a non-empty 'classes' list")
    if len(doc["classes"]) > MAX_CLASSES:
        raise ValueError(f"at most {MAX_CLASSES} classes")
    classes = []
    for i, c in enumerate(doc["classes"]):
        if not isinstance(c, dict):
            raise ValueError(f"classes[{i}] must be a mapping")
        unknown = set(c) - {"name", "share", "prompt", "output", "ttft_s", "itl_p90_s", "itl_p99_s",
                            "shared_prefix", "prefix_groups"}  # fmt: skip
        if unknown:
            raise ValueError(f"classes[{i}]: unknown keys {sorted(unknown)}")
        for key in ("ttft_s", "itl_p90_s"):
            if key not in c:
                raise ValueError(f"classes[{i}]: missing {key}")
        classes.append(
            Klass(
                name=str(c.get("name", f"class{i}")),
                share=_number(c.get("share", 1.0), f"classes[{i}].share"),
                prompt=_pair(c.get("prompt"), f"classes[{i}].prompt"),
                output=_pair(c.get("output"), f"classes[{i}].output"),
                ttft_s=_number(c["ttft_s"], f"classes[{i}].ttft_s"),
                itl_p90_s=_number(c["itl_p90_s"], f"classes[{i}].itl_p90_s"),
                itl_p99_s=_number(c.get("itl_p99_s", 0.1), f"classes[{i}].itl_p99_s"),
                shared_prefix=_integer(c.get("shared_prefix", 0), f"classes[{i}].shared_prefix"),
                prefix_groups=_integer(c.get("prefix_groups", 1), f"classes[{i}].prefix_groups"),
            )
        )
    return Workload(classes=tuple(classes))


def _number(v: Any, where: str) -> float:
    # float("abc") or float([1]) would raise with no location (or a TypeError: a traceback)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{where} must be a number, got {v!r}")
    return float(v)


def _integer(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where} must be an integer, got {v!r}")
    return v


def load(spec: str) -> Workload:
    """A preset name (``chat``, ``long``, ``mix``, ``rag``) or a YAML/JSON workload file."""
    if spec in PRESETS:
        return Workload(classes=PRESETS[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"workload {spec!r}: not a file, and not one of {', '.join(PRESETS)}")
    doc = read_yaml(path, "workload")
    try:
        return from_dict(doc)
    except ValueError as err:
        raise ValueError(f"workload {path}: {err}") from None


def load_trace(path: str, slos: Workload | None = None) -> Workload:
    """A JSONL trace (see the module docstring); ``slos``: a workload whose classes name the SLOs."""
    rows: list[tuple[float, int, int, str]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if n > MAX_TRACE_LINES:
                raise ValueError(f"{path}: more than {MAX_TRACE_LINES} requests")
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                row = (float(r["t"]), int(r["prompt_tokens"]), int(r["output_tokens"]), str(r.get("class", "")))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: needs t, prompt_tokens, output_tokens ({e})") from e
            if row[1] < 1 or row[2] < 1 or row[0] < 0:
                raise ValueError(f"{path}:{n}: token counts must be >= 1 and t >= 0")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort()
    return Workload(classes=slos.classes if slos else (), trace=tuple(rows))
