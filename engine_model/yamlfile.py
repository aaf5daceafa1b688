"""A YAML file read for a command line (profiles, workloads): every way it can fail is one
``ValueError`` line naming the file and the place, so the CLIs print it instead of a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: Path, what: str) -> Any:
    """The document in ``path`` (``what``: "profile", "workload", for the message)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not UTF-8 text") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{what} {path}:{where} YAML syntax error: {problem}") from None
