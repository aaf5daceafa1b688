"""Keep ML frameworks (PyTorch, TensorFlow, JAX) out of the gateway's processes.

The gateway only tokenizes and renders chat templates; it never runs a model. But transformers
imports PyTorch whenever it finds it installed (``transformers.generation`` imports torch as soon as
``AutoTokenizer`` is imported), and most engine images and ML workstations have it: each worker then
held ~720 MB with Meta's Llama 3 tokenizer instead of ~270 MB, for nothing (docs/benchmarks.md,
"Worker memory").

``keep_out`` marks the frameworks' top-level packages as not importable in this process, the way
the import system documents it: a ``None`` entry in ``sys.modules`` halts the import with
``ModuleNotFoundError``, and ``importlib.util.find_spec`` answers ``None``, so transformers' own
availability checks see no framework and take their framework-free paths. It must run before
transformers is first imported (its availability checks are cached); ``ModelTokenizer.load`` calls
it first. A tokenizer whose own code (``trust_remote_code``) imports one of them fails to load with
``FrameworkNeeded``, which names the model and the package.
"""

from __future__ import annotations

import sys

# Top-level packages only: their submodules cannot be imported without them.
FRAMEWORKS = ("torch", "tensorflow", "jax", "flax", "keras", "mlx", "paddle")


class FrameworkNeeded(RuntimeError):
    """A tokenizer's own code imports an ML framework, which the gateway keeps out."""


def keep_out() -> bool:
    """Make the ML frameworks unimportable here (idempotent); True when they are kept out.

    Not once transformers is imported: it has cached which frameworks it found, and would then
    import one it believes is there (a process that imported it on purpose, such as a test that
    builds a model, keeps its frameworks). A framework already imported stays too."""
    if "transformers" in sys.modules and not _kept_out():
        return False
    for name in FRAMEWORKS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None: "not importable" (import system)
    return True


def _kept_out() -> bool:
    return any(name in sys.modules and sys.modules[name] is None for name in FRAMEWORKS)


def blocked(err: BaseException) -> str | None:
    """The framework a load failed on, when it failed because ``keep_out`` keeps it out."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            top = cause.name.partition(".")[0]
            if top in FRAMEWORKS and sys.modules.get(top, ...) is None:
                return top
        cause = cause.__cause__ or cause.__context__
    return None


def loaded() -> list[str]:
    """The frameworks this process has imported (none, in a gateway)."""
    return [name for name in FRAMEWORKS if sys.modules.get(name) is not None]
