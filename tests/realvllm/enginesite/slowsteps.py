"""A test engine that generates slowly on demand, through vLLM's public logits-processor plugin
interface (``--logits-processors slowsteps:SlowSteps``): while the file named by
``PDGATE_TEST_SLOW_FILE`` exists, every sampling step first sleeps the seconds it holds.

Why not pause the engine from the test process (SIGSTOP/SIGCONT)? On these shared two-core
machines a process that sleeps may wake seconds late while an engine computes (measured: 1-4 s
gaps in a 10 ms ticker, even in a separate process), so a throttle thread let the engine run
unthrottled for seconds and a 1,400-token answer ended before the test could kill it. Here the
engine slows itself, and a late test process only makes it slower. The logits are untouched:
greedy output is the same, slowed or not.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.sample.logits_processor import LogitsProcessor


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.flag = os.environ.get("PDGATE_TEST_SLOW_FILE", "")

    def is_argmax_invariant(self) -> bool:
        return False  # vLLM skips argmax-invariant processors for greedy requests: this one must run

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: Any) -> Any:
        if self.flag:
            try:
                with open(self.flag) as f:
                    delay = float(f.read() or 0)
            except (OSError, ValueError):
                delay = 0.0
            if delay > 0:
                time.sleep(delay)
        return logits
