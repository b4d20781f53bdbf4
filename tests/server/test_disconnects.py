"""Every end of a client aborts its request at once (docs/architecture.md, invariant 1): client
processes SIGKILLed at random points of their streams, hundreds of times, and within 2 s of the
last kill the engine has nothing running and every block free. Not eventually: a request left
behind would run its 2,000 tokens (20 s of 10 ms steps).

Rules: port 0; the server in this process (trio), its clients forked by tests/support/killable.py
and killed from a worker thread; the whole test under `fail_after`."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import trio

from loom.engine.engine import Engine
from loom.model.sim import SimRunner, load_sim
from tests.support.grpc_client import HOST
from tests.support.server_harness import serving

ROUNDS = 8
PER_ROUND = 25  # 200 kills in all
KILL_WITHIN = 0.6  # seconds after its start: before it connects, mid-request or mid-stream
MAX_TOKENS = 2000
IDLE_WITHIN = 2.0


def kill_rounds(
    port: int,
    rng: random.Random,
    kinds: tuple[str, ...] = ("grpclib", "h2"),
    http_port: int | None = None,
    rounds: int = ROUNDS,
) -> float:
    """Fork clients (of `kinds`, in turn: tests/support/killable.py) and SIGKILL each at a random
    moment of its first `KILL_WITHIN` seconds, a round at a time; when the last one died."""
    command = [sys.executable, "-m", "tests.support.killable", HOST, str(port)]
    command += [str(http_port)] if http_port is not None else []
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as forks:
        assert forks.stdin is not None
        assert forks.stdout is not None
        assert forks.stdout.readline() == "ready\n"
        for _ in range(rounds):
            kills = []
            for i in range(PER_ROUND):
                forks.stdin.write(f"{kinds[i % len(kinds)]} {MAX_TOKENS}\n")
                forks.stdin.flush()
                pid = int(forks.stdout.readline())
                kills.append((time.monotonic() + rng.uniform(0, KILL_WITHIN), pid))
            for when, pid in sorted(kills):
                time.sleep(max(0.0, when - time.monotonic()))
                with contextlib.suppress(ProcessLookupError):  # it had ended by itself
                    os.kill(pid, signal.SIGKILL)
        last_kill = time.monotonic()
        forks.stdin.close()
        forks.wait(timeout=10)
    return last_kill


def idle(engine: Engine) -> bool:
    stats = engine.stats()
    return (
        stats.num_running + stats.num_waiting + stats.num_paused == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


async def test_disconnects_killed_clients_leave_nothing_running_2_s_after_the_last_kill() -> None:
    sim = load_sim("sim:step_ms=10,seq_ms=0,token_ms=0")
    async with serving(sim, make_runner=SimRunner, stall_timeout=60.0) as (server, port):
        with trio.fail_after(300):
            last_kill = await trio.to_thread.run_sync(kill_rounds, port, random.Random(20))
            while not idle(server.engine) and time.monotonic() - last_kill < 30:  # noqa: ASYNC110
                await trio.sleep(0.01)  # (no event says "idle")
            seconds = time.monotonic() - last_kill
            stats = server.engine.stats()
    print(f"{ROUNDS * PER_ROUND} clients killed; idle {seconds:.2f} s after the last kill;")
    print(f"finished: {dict(stats.finished)}; running {stats.num_running}")
    assert seconds <= IDLE_WITHIN, (seconds, stats)
    assert "length" not in stats.finished  # no request ran to its end
    assert stats.finished.get("aborted", 0) >= ROUNDS * PER_ROUND // 2  # most reached the engine
