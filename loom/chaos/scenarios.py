"""The scenarios of `loom chaos`: each runs its clients against the server and says what it saw.

Each scenario knows which outcomes its clients may have (loom/chaos/clients.py): any other one
(INTERNAL, UNKNOWN, an exception a client did not expect) is a problem. Some check more: the
overload scenario counts its refusals exactly, the deadline sweep wants its ample deadlines met,
the slow and stopped readers measure what they cost a well-behaved client (its TTFT and ITL
against those on the idle server: figures, never a verdict, as timing on a shared machine is).
"""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from loom.bench.fronts import one_request
from loom.bench.metrics import RequestTiming
from loom.chaos.clients import (
    Behaviour,
    Target,
    kill_clients,
    request,
    stream_once,
)
from loom.chaos.http_clients import http_stream_once

DEADLINES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 60.0)  # the last one is ample
PROBE = (1, 2, 3)  # the well-behaved request: greedy, 16 tokens, EOS ignored
PROBE_TOKENS = 16
CANCEL_TOKENS = 256  # a cancelling client's stream: far more than its few messages carry


@attrs.frozen(kw_only=True)
class Settings:
    clients: int = 200  # per scenario (some run a fraction of them)
    concurrency: int = 64  # clients at once
    max_tokens: int = 32  # per request
    overload_factor: int = 3  # the burst, in queue limits
    stop_for: float = 1.0  # seconds a stopped reader reads nothing
    # Tokens a stopped reader asks for, with 20 logprobs each (a few hundred bytes a message):
    # enough to fill its 64 KiB HTTP/2 window and the server's buffer, so that it pauses.
    stop_tokens: int = 600
    attack_frames: int = 100_000  # rapid-reset pairs, control-flood frames
    hold_connections: int = 50  # slowloris and header-fragments connections
    hold_wait: float = 15.0  # seconds they wait for the server to close them
    seed: int = 0


@attrs.define
class Result:
    name: str
    clients: int = 0
    outcomes: Counter[str] = attrs.field(factory=Counter)
    problems: list[str] = attrs.field(factory=list)
    figures: dict[str, float] = attrs.field(factory=dict)
    seconds: float = 0.0

    def expect(self, allowed: set[str]) -> None:
        for outcome, count in sorted(self.outcomes.items()):
            if outcome not in allowed:
                self.problems.append(f"{count} clients ended {outcome}")


@attrs.define
class Run:
    """What a scenario works with."""

    target: Target
    settings: Settings
    baseline: RequestTiming  # the well-behaved request on the idle server
    on_client: Callable[[], object] = lambda: None  # the progress bar
    server: subprocess.Popen[str] | None = None  # when chaos launched the server itself

    def message(self, rng: random.Random, max_tokens: int = 0, prompt_len: int = 0) -> Any:
        vocab = self.target.info.vocab_size
        return request(rng, vocab, max_tokens or self.settings.max_tokens, prompt_len)

    def long_message(self, rng: random.Random, max_tokens: int) -> Any:
        """A message asking for `max_tokens`, or as many as fit beside its prompt (at most 24
        tokens) in the model's length."""
        return self.message(rng, min(max_tokens, self.target.info.max_model_len - 24))

    async def crowd(
        self, result: Result, calls: list[tuple[Any, Behaviour]], *, at_once: bool = False
    ) -> None:
        """Run the calls, `concurrency` at a time (or all `at_once`), counting their outcomes
        into `result`."""
        slots = asyncio.Semaphore(len(calls) if at_once else self.settings.concurrency)

        async def one(message: Any, behaviour: Behaviour) -> None:
            async with slots:
                result.outcomes[await call(self.target, message, behaviour)] += 1
                self.on_client()

        result.clients += len(calls)
        await asyncio.gather(*(one(m, b) for m, b in calls))

    async def beside(self, result: Result, work: Awaitable[None]) -> None:
        """`work`, and a well-behaved client once it is under way: its cost in figures."""
        task = asyncio.ensure_future(work)
        await asyncio.sleep(0.2)
        during = await well_behaved(self.target)
        await task
        result.figures.update(cost(self.baseline, during))


async def call(target: Target, message: Any, behaviour: Behaviour) -> str:
    """One client's call through the target's front, behaving as told: its outcome."""
    if target.api == "openai":
        return await http_stream_once(target, message, behaviour)
    return await stream_once(target, message, behaviour)


async def well_behaved(target: Target) -> RequestTiming:
    """The probe request on a connection of its own, each token's arrival timed."""
    async with target.channel() as channel:
        return await one_request(channel, PROBE, PROBE_TOKENS)


def cost(idle: RequestTiming, during: RequestTiming) -> dict[str, float]:
    """A well-behaved client's TTFT and mean ITL beside the crowd, as multiples of the idle's."""
    if not (idle.ok and during.ok):
        return {}  # its failure shows in the invariants' probe
    figures = {"ttft_s": during.ttft, "ttft_vs_idle": during.ttft / idle.ttft}
    if during.itls and idle.itls:
        mean = statistics.fmean(during.itls)
        figures |= {"itl_s": mean, "itl_vs_idle": mean / statistics.fmean(idle.itls)}
    return figures


async def kill(run: Run) -> Result:
    result = Result("kill")
    count = max(1, run.settings.clients // 20)
    killed = await kill_clients(run.target, count, max_tokens=400)
    result.clients = count
    result.outcomes["killed"] = killed
    if killed != count:
        result.problems.append(f"{count - killed} of {count} client processes did not die so")
    return result


async def cancel(run: Run) -> Result:
    """Clients that cancel after a few messages. Their streams are long (`CANCEL_TOKENS`): a
    server behind on its sends packs what piled up into one message, and a short stream could
    end in fewer messages than a client waits for ("ok", not a cancel)."""
    rng, result = random.Random(run.settings.seed), Result("cancel")
    tokens = max(CANCEL_TOKENS, run.settings.max_tokens)
    calls = [
        (run.long_message(rng, tokens), Behaviour(leave="cancel", after=rng.randint(0, 4)))
        for _ in range(run.settings.clients)
    ]
    await run.crowd(result, calls)
    result.expect({"cancelled", "ok"})
    return result


async def reset(run: Run) -> Result:
    rng, result = random.Random(run.settings.seed + 1), Result("reset")
    calls = [
        (run.message(rng), Behaviour(leave=rng.choice(["drop", "reset"]), after=rng.randint(0, 4)))
        for _ in range(run.settings.clients)
    ]
    await run.crowd(result, calls)
    result.expect({"dropped", "reset", "ok"})
    return result


async def slow_readers(run: Run) -> Result:
    rng, result = random.Random(run.settings.seed + 2), Result("slow-readers")
    calls = [
        (run.message(rng), Behaviour(interval=rng.uniform(0.02, 0.1)))
        for _ in range(max(1, run.settings.clients // 4))
    ]
    await run.beside(result, run.crowd(result, calls))
    result.expect({"ok"})
    return result


async def stopped_readers(run: Run) -> Result:
    """Readers that stop (for `stop_for` s, small windows), then read on. Past the server's
    stall_timeout it ends them: RESOURCE_EXHAUSTED, or, when its send to the full window is
    what it gives up, a reset stream (StreamTerminatedError; over HTTP, the connection
    closed)."""
    rng, result = random.Random(run.settings.seed + 3), Result("stopped-readers")
    behaviour = Behaviour(leave="stop", stop_for=run.settings.stop_for)
    calls = []
    for _ in range(max(1, run.settings.clients // 4)):
        message = run.long_message(rng, run.settings.stop_tokens)
        message.sampling.logprobs = 20
        calls.append((message, attrs.evolve(behaviour, after=rng.randint(0, 2))))
    await run.beside(result, run.crowd(result, calls))
    result.expect({"ok", "RESOURCE_EXHAUSTED", "StreamTerminatedError", "closed by the server"})
    return result


async def deadlines(run: Run) -> Result:
    """Deadlines swept from far too short to ample: ample ones are met."""
    rng, result = random.Random(run.settings.seed + 4), Result("deadlines")
    sweep = [
        DEADLINES[i % len(DEADLINES)] for i in range(max(len(DEADLINES), run.settings.clients))
    ]
    ample = Result("ample")
    calls = [(run.message(rng), Behaviour(timeout=t)) for t in sweep if t < DEADLINES[-1]]
    ample_calls = [(run.message(rng), Behaviour(timeout=t)) for t in sweep if t == DEADLINES[-1]]
    await asyncio.gather(run.crowd(result, calls), run.crowd(ample, ample_calls))
    result.expect({"ok", "DEADLINE_EXCEEDED", "client timeout"})
    for outcome, count in ample.outcomes.items():
        if outcome != "ok":
            result.problems.append(
                f"{count} clients with an ample {DEADLINES[-1]:g} s deadline ended {outcome}"
            )
    result.outcomes += ample.outcomes
    result.clients += ample.clients
    return result


async def drain(run: Run) -> Result:
    """SIGTERM while streams are in flight: they complete, a new call is refused (the port
    closes at once; UNAVAILABLE on a connection still open), the process exits 0 (only
    against a server chaos launched)."""
    rng, result = random.Random(run.settings.seed + 5), Result("drain")
    assert run.server is not None
    calls = [(run.message(rng), Behaviour()) for _ in range(max(1, run.settings.clients // 4))]
    crowd = asyncio.ensure_future(run.crowd(result, calls))
    await run.target.stats_until(lambda stats: stats.num_running, 60)
    run.server.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)
    late = await call(run.target, run.message(rng), Behaviour(timeout=10))
    await crowd
    result.expect({"ok"})
    # Not served: the port closed, UNAVAILABLE, or (a call sent just as the drain began) ended
    # by the drain's graceful GOAWAY, on which grpclib's client drops the call it has sent.
    if late not in ("UNAVAILABLE", "ConnectionRefusedError", "StreamTerminatedError"):
        result.problems.append(f"a call made while draining ended {late}, not refused")
    code = await asyncio.to_thread(run.server.wait, 60)
    if code != 0:
        result.problems.append(f"the server exited {code} after SIGTERM, not 0")
    return result


async def timed_scenario(run: Run, scenario: Callable[[Run], Awaitable[Result]]) -> Result:
    start = time.perf_counter()
    result = await scenario(run)
    result.seconds = time.perf_counter() - start
    return result
