"""gateway/tokenization/heap.py: a loaded tokenizer's freed C memory goes back to the system."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from gateway.tokenization import heap

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_trim_reports_whether_the_c_library_can() -> None:
    assert heap.trim() is GLIBC


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_back() -> None:
    # Many small C allocations freed out of order stay in glibc's free lists; the trim returns them.
    code = """
import ctypes, sys
from gateway.tokenization import heap
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) // 1024
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1000) for _ in range(300_000)]  # ~300 MB below the mmap threshold
for p in blocks:
    ctypes.memset(p, 1, 1000)
keep = blocks[-1]  # the heap's top stays in use: free() alone cannot shrink it
for p in blocks[:-1]:
    libc.free(p)
before = rss()
heap.trim()
print(before, rss())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, done.stdout.split())
    assert before > 250 and after < before - 200, done.stdout
