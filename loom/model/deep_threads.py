"""Threads with deep stacks, for llguidance's compiles and masks.

llguidance recurses on a grammar's depth as it builds it: a chain of a few thousand Lark rules
overflows a thread's usual 8 MiB stack and kills the process (a segfault, not an exception).
Its threads get a stack far deeper than the deepest grammar within max_constraint_bytes needs
(tests/model/test_grammar.py builds them); it is address space, touched only as deep as a
grammar goes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

GRAMMAR_STACK_BYTES = 1 << 30


def deep_stack_threads(count: int, name: str, nice: int = 0) -> ThreadPoolExecutor:
    """An executor whose `count` threads are started now, each with a GRAMMAR_STACK_BYTES
    stack (a thread's stack size is fixed as it starts: each blocks until all have started)
    and at `nice` (Linux: a thread's own priority)."""
    executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix=name)
    started = threading.Barrier(count + 1)

    def start() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not every platform has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        started.wait()

    previous = threading.stack_size(GRAMMAR_STACK_BYTES)
    try:
        for _ in range(count):  # none is idle yet, so each submit starts a thread
            executor.submit(start)
        started.wait()
    finally:
        threading.stack_size(previous)
    return executor
