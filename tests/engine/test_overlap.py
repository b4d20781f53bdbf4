"""The engine's loop one step ahead (overlapped scheduling) against the serial loop, with the
tiny model and the simulated one: the same tokens and finishes under preemption, chunked
prefill, stop tokens and an abort; the token a request computes in the step after its last is
never emitted; every block free once the requests have ended.

Rules: loopback-free (the engine alone), a timeout on every test, greedy or seeded sampling only
(the same tokens whatever shares the batch, so the two loops must agree)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import attrs
import pytest
import trio

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.request_output import FinishReason
from loom.core.sampling_params import SamplingParams
from loom.core.step import SchedulerOutput
from loom.model.launched import Launched
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.model.sampler import Masks
from loom.model.sim import SimRunner, load_sim
from tests.conftest import tiny_model
from tests.engine.test_engine import assert_idle, collect, serving
from tests.support.faults import calling_before_each_step

NUM_REQUESTS = 10
ABORTED = 0  # this request's consumer leaves after ABORT_AFTER outputs
ABORT_AFTER = 3


class WaitingRunner(ModelRunner):
    """Its steps' outputs come as a GPU's do: not ready at the launch, so that the loop waits
    for each in a thread (on a CPU the output is there at once, and is taken at once)."""

    def launch(self, output: SchedulerOutput, masks: Masks | None = None) -> Launched:
        launched = super().launch(output, masks)
        return Launched(launched.output, ready=lambda: False)


MODELS: dict[str, tuple[Callable[[], LoadedModel], type[ModelRunner]]] = {
    "tiny": (lambda: tiny_model("llama"), ModelRunner),
    "tiny-waiting": (lambda: tiny_model("llama"), WaitingRunner),
    "sim": (lambda: load_sim("sim:step_ms=1,seq_ms=0,token_ms=0,vocab=512"), SimRunner),
}


@attrs.frozen
class Case:
    prompt: list[int]
    sampling: SamplingParams


def cases() -> list[Case]:
    """Random prompts and lengths; every third request sampled at temperature 0.8, seeded."""
    rng = random.Random(11)
    found = []
    for i in range(NUM_REQUESTS):
        max_tokens = rng.randint(6, 24)
        sampling = (
            SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens)
            if i % 3 == 2
            else SamplingParams(temperature=0, max_tokens=max_tokens)
        )
        found.append(Case([rng.randrange(1, 512) for _ in range(rng.randint(1, 20))], sampling))
    return found


@attrs.frozen
class Run:
    tokens: dict[int, list[int]]
    finishes: dict[int, FinishReason | None]  # None: its consumer left
    request_ids: dict[int, str]  # the engine's
    steps: list[SchedulerOutput]  # every step launched, in order
    num_preemptions: int


async def run(model: str, *, ahead: bool, stops: dict[int, int], abort: bool) -> Run:
    """Every case through an engine with a small pool (preemptions) and a small token budget
    (chunked prompts), the requests submitted together."""
    load, base = MODELS[model]
    steps: list[SchedulerOutput] = []
    runner = calling_before_each_step(steps.append, base)
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, FinishReason | None] = {}
    request_ids: dict[int, str] = {}
    async with serving(
        load(),
        runner,
        cache=CacheConfig(block_size=4, num_blocks=24),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=16, max_num_seqs=8, async_scheduling=ahead
        ),
    ) as engine:

        async def one(i: int, case: Case) -> None:
            stop = (stops[i],) if i in stops else ()
            sampling = attrs.evolve(case.sampling, stop_token_ids=stop)
            tokens[i], finishes[i] = [], None
            async with engine.generate(case.prompt, sampling) as outputs:
                async for output in outputs:
                    tokens[i] += output.token_ids
                    request_ids[i] = output.request_id
                    finishes[i] = output.finish_reason
                    if abort and i == ABORTED and len(tokens[i]) >= ABORT_AFTER:
                        return  # leaving the block aborts the request

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i, case in enumerate(cases()):
                    nursery.start_soon(one, i, case)
            await engine.until(lambda: engine.stats().num_running == 0)
        assert_idle(engine)
        return Run(tokens, finishes, request_ids, steps, engine.stats().num_preemptions)


def until_stop(tokens: list[int], stop: int | None) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize("model", list(MODELS))
async def test_overlap_gives_the_serial_loop_s_tokens_finishes_and_aborts(model: str) -> None:
    serial = await run(model, ahead=False, stops={}, abort=False)
    assert serial.num_preemptions > 0
    assert not any(s.pending_token for step in serial.steps for s in step.sequences)
    # Stop tokens mid-output for half the requests: each one's token past its middle.
    stops = {i: serial.tokens[i][len(serial.tokens[i]) // 2] for i in range(1, NUM_REQUESTS, 2)}
    ahead = await run(model, ahead=True, stops=stops, abort=True)
    assert ahead.num_preemptions > 0
    for i in range(NUM_REQUESTS):
        if i == ABORTED:  # what it read of its tokens, then nothing
            assert ahead.tokens[i] == serial.tokens[i][: len(ahead.tokens[i])]
            assert len(ahead.tokens[i]) >= ABORT_AFTER
            assert ahead.finishes[i] is None
            continue
        expected = until_stop(serial.tokens[i], stops.get(i))
        assert ahead.tokens[i] == expected, i
        stopped = len(expected) < len(serial.tokens[i])
        assert ahead.finishes[i] is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    # The steps ran ahead: a pending token in most decode steps, and requests that stopped
    # computed a token in the step after their last, which was never emitted.
    assert sum(any(s.pending_token for s in step.sequences) for step in ahead.steps) > 10
    rows = Counter(s.request_id for step in ahead.steps for s in step.sequences if s.sampling)
    unsent = [rows[ahead.request_ids[i]] - len(ahead.tokens[i]) for i in stops]
    assert min(unsent) >= 0
    assert sum(unsent) > 0


@pytest.mark.parametrize("capacity", [1, 2])
async def test_overlap_never_puts_more_in_a_full_buffer(capacity: int) -> None:
    """A consumer that reads nothing: its request pauses with exactly `capacity` outputs in
    the buffer (no step ahead adds one), and gives every token once it reads."""
    ahead = SchedulerConfig(async_scheduling=True)
    async with serving(tiny_model("llama"), output_buffer_size=capacity, scheduler=ahead) as engine:
        with trio.fail_after(60):
            sampling = SamplingParams(temperature=0, max_tokens=40)
            stream = engine.submit([1, 2, 3], sampling)
            await engine.until(lambda: engine.stats().num_paused == 1)
            await trio.sleep(0.2)  # (steps a loop ahead would have taken)
            assert len(stream.buffer) == capacity
            outputs = [output async for output in stream.outputs()]
            assert sum(len(o.token_ids) for o in outputs) == 40
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            await engine.until(lambda: engine.stats().num_running == 0)
            assert_idle(engine)


@pytest.mark.parametrize(("model", "overlaps"), [("tiny", False), ("sim", True)])
async def test_overlap_by_default_where_a_step_leaves_the_cpu_free(
    model: str, overlaps: bool
) -> None:
    """Unset, steps overlap with the simulated model (its steps sleep, as a GPU's leave the
    CPU), not with a model computing on the CPU (its forward takes every core)."""
    load, base = MODELS[model]
    steps: list[SchedulerOutput] = []
    async with serving(load(), calling_before_each_step(steps.append, base)) as engine:
        with trio.fail_after(60):
            outputs = await collect(engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    assert sum(len(o.token_ids) for o in outputs) == 8
    assert any(s.pending_token for step in steps for s in step.sequences) is overlaps
