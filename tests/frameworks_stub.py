"""Stand-in ML frameworks for tests that prove the gateway never imports one.

``install(folder, log)`` writes packages named torch, tensorflow and jax, each with installed-package
metadata (so transformers' availability checks take them for real installs, as they take a real
PyTorch), whose import appends the importing stack to ``log`` and then fails. Put ``folder`` first on
``PYTHONPATH`` of the process under test: an empty ``log`` afterwards means nothing imported them.
"""

from __future__ import annotations

from pathlib import Path

VERSIONS = {"torch": "2.9.0", "tensorflow": "2.20.0", "jax": "0.7.0"}

_INIT = """import traceback
with open({log!r}, "a", encoding="utf-8") as f:
    f.write("{name} imported from:\\n" + "".join(traceback.format_stack()) + "\\n")
raise ImportError("stand-in {name}: this process must not import it")
"""


def install(folder: Path, log: Path) -> dict[str, str]:
    """The stand-ins under ``folder``; returns the environment that puts them first on the path."""
    import os

    for name, version in VERSIONS.items():
        pkg = folder / name
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(_INIT.format(log=str(log), name=name))
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(name + "\n")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}
