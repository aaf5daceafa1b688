"""Imported at start-up by every Python process of a test engine (``engines.engine_env`` puts this
folder on ``PYTHONPATH``; vLLM spawns its workers with a fresh interpreter, which inherits it).

It asks Linux for permission to use Intel AMX tile data in this process. vLLM 0.32's CPU attention
backend picks its AMX kernel whenever the CPU has AMX (and the dtype is bf16, the block size a
multiple of 32) but never asks for that permission itself: it relies on an earlier AMX matmul
(oneDNN asks lazily, the first time it uses AMX, e.g. for a prefill) having asked. On an engine
whose first forward pass is a 1-token step - the decode engine of a P/D pair, whose prompt KV
arrives over NIXL - none has, and the kernel's first tile instruction (``tilezero``) kills the
worker with SIGILL ("VllmWorker-0 died unexpectedly", no traceback). The permission is per
process, inherited by fork, reset by exec.
"""

import ctypes
import platform
import sys


def _request_amx_permission() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    # Returns -1 (EINVAL), harmlessly, on CPUs or kernels without AMX.
    ctypes.CDLL(None).syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)


_request_amx_permission()
