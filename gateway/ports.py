"""Free TCP ports for processes started a moment later (the demo's engines, the test suites').

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range every
outgoing connection draws its local port from: between choosing it and the child binding it, a
connection can take it ("Address already in use"). Ports below that range are only ever taken by
an explicit bind, and this process never hands out the same one twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    lo, hi = _ephemeral_range()
    start, stop = (10000, lo) if lo > 11000 else (hi + 1, 65535)
    for _ in range(200):
        port = random.randrange(start, stop)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # a crowded range: let the kernel choose
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]  # (host, port, ...): typeshed says Any
        return chosen
