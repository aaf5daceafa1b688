"""The layout is the architecture (docs/architecture.md): which package of the gateway may import
which, checked on the import graph. A new edge fails here until the page and ``ALLOWED`` say why.

Each entry is a sub-package of ``gateway`` (``(top)``: the modules at its top) and the modules
outside it that it may import (``pkg`` any module of it, ``pkg.module`` that module only)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("http", "request", "engines", "adapters", "tokenization", "fairness", "cluster", "ops", "config", "epp")
ALLOWED: dict[str, set[str]] = {
    # the top: the process's entry points
    "(top)": {
        "http",
        "request",
        "engines",
        "adapters",
        "tokenization",
        "fairness",
        "cluster",
        "ops",
        "config",
        "policies",
        "engine_model",
        "epp.protocol",
    },  # engine_model: `pdgate plan` and the demo's tokenizer; epp.protocol: `pdgate epp` checks addresses
    "http": {
        "request",
        "engines",
        "adapters",
        "tokenization",
        "fairness",
        "cluster",
        "ops",
        "config",
        "context",
        "background",
        "lifecycle",
        "policies",
        "epp.server",  # the assembly adds the endpoint picker's listener when epp.enabled
    },
    "request": {
        "engines",
        "adapters",
        "tokenization",
        "fairness",
        "ops",
        "config",
        "context",
        "background",
        "policies",
        "http.errors",
        "http.auth",
        "http.splice",  # the client connection's body writer (a relay sink)
        "cluster.redis_state",
    },
    "engines": {"config", "background", "policies", "http.errors"},
    "adapters": {"config", "engines"},  # LoRA adapters: the engines' lists and their admin endpoint
    "tokenization": {"config", "http.errors", "request.protocol", "engine_model"},  # vLLM's chat rendering
    "fairness": {"config", "http.errors"},
    "cluster": {
        "engines",
        "fairness",
        "config",
        "background",
        "policies",
        "ops.gcpolicy",
        "ops.requestlog",
        "http.app",
        "http.uvicorn_server",
        "(top).cli",
    },  # http and cli: the supervisor starts the app
    "ops": {
        "engines",
        "fairness",
        "tokenization",
        "config",
        "background",
        "policies",
        "cluster.redis_state",
        "cluster.workerbus",
        "http.auth",
        "http.errors",
        "http.server",
        "engine_model",
    },  # the live planner's model
    "config": {"background", "policies", "engines.discovery", "engine_model"},  # the planner's profile, checked
    # the endpoint picker: the request path up to the engine (request), its engines and errors
    "epp": {"request", "engines.pools", "config", "context", "background", "policies", "http.errors", "http.auth"},
}
TOP_MODULES = {"background", "context", "lifecycle", "cli", "demo", "ports"}
# The top-level packages and what each may import: a DAG with the pure policies at its bottom and
# the engine model that the gateway and the simulator share above them (engine_model.prefix hashes
# blocks with policies.beliefs.blockhash, as the router's prefix index does: one implementation).
TOP_PACKAGES: dict[str, set[str]] = {
    "engine_model": {"policies"},
    "policies": set(),
    "gateway": {"policies", "engine_model"},
    "sim": {"engine_model"},
    "bench": {"gateway", "policies", "engine_model", "sim"},
}


def _imports(path: Path) -> set[str]:
    """What a module imports when it runs (``if TYPE_CHECKING:`` blocks left out: a type named for
    the checker is no dependency of the running code)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _target(name: str) -> str | None:
    """``gateway.engines.pools.Endpoint`` -> ``engines.pools``; ``engine_model.fleet`` -> ``sim``."""
    parts = name.split(".")
    if parts[0] in TOP_PACKAGES and parts[0] != "gateway":
        return parts[0]
    if parts[0] != "gateway" or len(parts) < 2:
        return None
    if parts[1] in SUBPACKAGES:
        return ".".join(parts[1:3]) if len(parts) > 2 else parts[1]
    return parts[1] if parts[1] in TOP_MODULES else None


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT / "gateway").parts
    return rel[0] if len(rel) > 1 else "(top)"


def test_each_package_imports_only_what_the_architecture_allows() -> None:
    wrong = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        pkg = _package(path)
        for name in sorted(_imports(path)):
            target = _target(name)
            if target is None or target.split(".")[0] == pkg:
                continue
            if pkg == "(top)" and target in TOP_MODULES:
                continue
            allowed = ALLOWED[pkg]
            if target in allowed or target.split(".")[0] in allowed:
                continue
            if target in ("context", "background", "lifecycle") and target in allowed:
                continue
            if target in TOP_MODULES and f"(top).{target}" in allowed:
                continue
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == [], "\n".join(wrong)


def test_top_level_packages_import_only_down_the_graph() -> None:
    """``gateway`` and ``sim`` share ``engine_model`` and never import each other; nothing imports
    ``bench``; so the packages have no cycle, which the last assertion checks on the graph itself."""
    wrong, edges = [], {name: set() for name in TOP_PACKAGES}
    for package, allowed in TOP_PACKAGES.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path):
                target = name.split(".")[0]
                if target in TOP_PACKAGES and target != package:
                    edges[package].add(target)
                    if target not in allowed:
                        wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == [], "\n".join(wrong)
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"import cycle: {' -> '.join((*path, package))}"
        if package not in done:
            for target in edges[package]:
                visit(target, (*path, package))
            done.add(package)

    for package in TOP_PACKAGES:
        visit(package, ())


def test_importing_the_gateway_loads_no_simulator_module() -> None:
    """Every module of the gateway imported, in a fresh interpreter: none from ``sim`` or ``bench``
    comes with them (``pdgate sim`` reaches the simulator through an entry point)."""
    code = (
        "import sys, pkgutil, importlib, gateway; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(gateway.__path__, 'gateway.') "
        "if not m.name.endswith('__main__')]; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sim', 'bench'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
