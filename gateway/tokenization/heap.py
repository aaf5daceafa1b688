"""Give the C heap's freed memory back to the system once a tokenizer has loaded.

Loading a large tokenizer goes through a few hundred MB of short-lived C allocations: transformers
reading ``tokenizer.json`` and building its Rust tokenizer, the fast path's checks over every code
point and the tiktoken ranks. glibc's allocator keeps what was freed for reuse rather than returning
it, so each worker kept ~400 MB of resident memory for a Llama 3 tokenizer that holds ~130.
``malloc_trim(0)`` hands the free pages back (measured in docs/benchmarks.md, "Worker memory"). It
is glibc's public API; elsewhere (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    fn = getattr(libc, "malloc_trim", None)  # glibc only
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def trim() -> bool:
    """Return the heap's free pages to the system; True where the C library can (glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
