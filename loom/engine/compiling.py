"""Compiling a request's constraint for admission (loom/engine/admission.py), on the deep-stack
compile threads of loom/model/grammar.py, under the time limits of ConstraintConfig.

A compile cannot be interrupted: one past its time limit is abandoned (its request refused)
and runs to its end on its thread; it is then not cached, and remembered as too slow. At most
MAX_PENDING_COMPILES distinct constraints wait on compiles at once, so a flood of slow ones
cannot queue every later request behind them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import trio

from loom.core.constraint import Constraint, Matcher
from loom.core.errors import EngineOverloadedError, InvalidRequestError
from loom.engine.config import EngineConfig
from loom.model.grammar import Grammars

T = TypeVar("T")
# Distinct constraints compiling at once, queued ones included. Copies of one wait on the same
# compile (the first compiles, the rest are cache hits; after a time-out, refused at once).
MAX_PENDING_COMPILES = 8


async def compiled(
    grammars: Grammars, constraint: Constraint | None, config: EngineConfig
) -> Matcher | None:
    """The constraint's matcher, or why not: invalid, too slow to compile (now, or when
    it was last asked for), or too many compiling already (RESOURCE_EXHAUSTED)."""
    if constraint is None:
        return None
    timeout = config.constraints.constraint_compile_timeout
    too_slow = InvalidRequestError(
        f"{constraint.kind.value} did not compile within constraint_compile_timeout={timeout}s"
    )
    if constraint in grammars.too_slow:
        raise too_slow
    pending = grammars.pending
    if constraint not in pending and len(pending) >= MAX_PENDING_COMPILES:
        raise EngineOverloadedError(
            f"{len(pending)} constraints are compiling; the limit is "
            f"{MAX_PENDING_COMPILES} (a compile past its time limit runs to its end)"
        )
    pending[constraint] += 1
    try:
        # Once per engine, off the compile threads (which a slow compile may hold) and
        # outside the time limit: the tokenizer as llguidance sees it (half a second).
        await trio.to_thread.run_sync(grammars.prepare)
        with trio.move_on_after(timeout):  # the compile is abandoned, not stopped
            deadline = time.monotonic() + timeout
            return await run_on(grammars.compiling, grammars.compile, constraint, deadline)
    finally:
        pending[constraint] -= 1
        if not pending[constraint]:
            del pending[constraint]
    raise too_slow


async def run_on(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on one of `executor`'s threads; a cancel stops the wait, not `fn`."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # abandoned, and trio is gone
            token.run_sync_soon(done.set)

    future = executor.submit(fn, *args)
    future.add_done_callback(wake)
    await done.wait()
    return future.result()
