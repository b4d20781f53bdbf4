"""The trio engine with tiny random-weight models: correctness, aborts, deadlines, backpressure.

Rules: every test runs under a timeout (`fail_after`); time-driven behaviour (deadlines, stalls)
runs on `idle_jump_clock` only where the test polls (its short sleeps are the nearest timers, so a
step that is slow in real time cannot jump the clock far), else in real time.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.prompt import ChatMessage
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.step import SchedulerOutput
from loom.core.tenancy import Tenancy
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine, RunnerFactory
from loom.engine.request_stream import RequestStream
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.support.faults import calling_before_each_step, failing_at
from tests.support.greedy import reference_tokens

GREEDY = SamplingParams(temperature=0)
CRASHED = "the engine crashed (RuntimeError); see the server log"


@asynccontextmanager
async def serving(
    loaded: LoadedModel, make_runner: RunnerFactory = ModelRunner, **config: Any
) -> AsyncIterator[Engine]:
    engine = Engine(EngineConfig(**config), lambda: loaded, make_runner=make_runner)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()


async def collect(
    engine: Engine, prompt: Any, sampling: SamplingParams = GREEDY, **kwargs: Any
) -> list[RequestOutput]:
    outputs = []
    async with engine.generate(prompt, sampling, **kwargs) as stream:
        async for output in stream:
            outputs.append(output)
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def assert_idle(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_running, stats.num_waiting, stats.num_paused) == (0, 0, 0)


async def run_against_reference(loaded: LoadedModel, **config: Any) -> Engine:
    """16 concurrent greedy requests, random prompt lengths and arrival times."""
    rng = random.Random(5)
    cases = [
        (
            [rng.randrange(512) for _ in range(rng.randint(1, 40))],
            rng.randint(4, 24),
            rng.uniform(0, 0.05),
        )
        for _ in range(16)
    ]
    expected = [reference_tokens(loaded.model, p, n) for p, n, _ in cases]
    got: dict[int, list[int]] = {}
    async with serving(loaded, **config) as engine:

        async def one(i: int) -> None:
            prompt, max_tokens, delay = cases[i]
            await trio.sleep(delay)
            sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
            outputs = await collect(engine, prompt, sampling)
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            got[i] = tokens_of(outputs)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, i)
        assert [got[i] for i in range(16)] == expected
        assert_idle(engine)
        return engine


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_engine_sixteen_concurrent_greedy_requests_match_generate(family: str) -> None:
    engine = await run_against_reference(tiny_model(family))
    assert engine.stats().num_preemptions == 0


async def test_engine_matches_generate_under_preemption_and_chunked_prefill() -> None:
    engine = await run_against_reference(
        tiny_model("llama"),
        cache=CacheConfig(block_size=4, num_blocks=24),  # 92 slots for 16 requests of up to 64
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16),
    )
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefills > 0


async def test_engine_streams_text_and_usage_for_text_and_chat_prompts(
    smollm2_tokenizer: Any,
) -> None:
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    async with serving(loaded) as engine:
        with trio.fail_after(60):
            sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            outputs = await collect(engine, "Hello there", sampling)
            final = outputs[-1]
            assert final.usage is not None
            assert final.usage.prompt_tokens == len(smollm2_tokenizer.encode("Hello there"))
            assert final.usage.completion_tokens == 12 == len(tokens_of(outputs))
            assert final.timings is not None
            assert final.timings.ttft_ms is not None
            chat = [ChatMessage(role="user", content="Hi")]
            chat_outputs = await collect(engine, chat, sampling)
            expected_prompt = smollm2_tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
            )
            assert chat_outputs[-1].usage is not None
            assert chat_outputs[-1].usage.prompt_tokens == len(expected_prompt["input_ids"])


async def test_engine_utf8_stream_joins_to_the_full_decode(smollm2_tokenizer: Any) -> None:
    """Random weights over a byte-level vocabulary emit split multi-byte characters often."""
    loaded = tiny_model("qwen2", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    async with serving(loaded) as engine:
        with trio.fail_after(60):
            for seed, prompt in enumerate(["東京は", "Emoji 🦀🐍 and ✨", "naïve café"]):
                sampling = SamplingParams(
                    temperature=1.5, seed=seed, max_tokens=40, ignore_eos=True
                )
                outputs = await collect(engine, prompt, sampling)
                text = "".join(o.text for o in outputs)
                full = smollm2_tokenizer.decode(tokens_of(outputs), skip_special_tokens=True)
                # Random tokens also make invalid byte runs, which decode to U+FFFD for good;
                # equality shows none was added or lost by splitting the stream.
                assert text == full


async def test_engine_stop_string_on_the_last_allowed_token_wins_over_length(
    smollm2_tokenizer: Any,
) -> None:
    """The token that reaches max_tokens also completes a stop string: the text is cut before
    the stop string and the finish says so, as vLLM reports it."""
    loaded = tiny_model("qwen2", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    async with serving(loaded) as engine:
        with trio.fail_after(60):
            plain = await collect(engine, "Once upon a time", sampling)
            text = "".join(o.text for o in plain)
            assert plain[-1].text  # the last token adds text: a stop string can end in it
            # The shortest tail of the text found nowhere earlier in it.
            stop = next(text[-k:] for k in range(1, 5) if text.find(text[-k:]) == len(text) - k)
            with_stop = attrs.evolve(sampling, stop=(stop,))
            stopped = await collect(engine, "Once upon a time", with_stop)
    assert tokens_of(stopped) == tokens_of(plain)
    assert "".join(o.text for o in stopped) == text[: -len(stop)]
    assert stopped[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert engine.stats().finished == {"length": 1, "stop_sequence": 1}


class FailingDecode:
    """SmolLM2's tokenizer, whose `decode` raises for any ids that hold `poison`."""

    def __init__(self, tokenizer: Any, poison: int) -> None:
        self.tokenizer, self.poison = tokenizer, poison

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        if self.poison in ids:
            raise RuntimeError("injected decode fault")
        return str(self.tokenizer.decode(ids, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


async def run_until_crash(
    engine: Engine, prompt: list[int], sampling: SamplingParams
) -> tuple[list[RequestOutput], list[BaseException]]:
    """Run `engine` with one request until the engine crashes (RuntimeError): the request's
    outputs, and the errors its stream raised."""
    outputs: list[RequestOutput] = []
    errors: list[BaseException] = []

    async def run_engine(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with pytest.RaisesGroup(RuntimeError, flatten_subgroups=True):
            await engine.run(task_status=task_status)

    async def consume(stream: RequestStream) -> None:
        try:
            async for output in stream.outputs():
                outputs.append(output)
        except EngineDeadError as exc:
            errors.append(exc)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_engine)
            nursery.start_soon(consume, engine.submit(prompt, sampling))
    return outputs, errors


async def test_engine_crash_while_detokenising_still_ends_the_stream(
    smollm2_tokenizer: Any,
) -> None:
    """Detokenising a request's token crashes the engine: the request, unfinished, is ended by
    the engine's stop, and its consumer gets an ERROR finish naming the crash."""
    tokenizer = FailingDecode(smollm2_tokenizer, poison=7)
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=tokenizer)
    engine = Engine(EngineConfig(), lambda: loaded)
    outputs, errors = await run_until_crash(engine, [7, 7], SamplingParams(max_tokens=5))
    assert errors == []
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert outputs[-1].error == CRASHED
    assert_idle(engine)


async def test_engine_crash_after_a_finish_still_ends_its_stream() -> None:
    """The scheduler finishes a request (max_tokens), then the engine crashes before its
    stream is ended (here in the metrics of its end): its consumer still gets the error."""
    engine = Engine(EngineConfig(), lambda: tiny_model("llama"))

    def ended(request: Any, now: float) -> None:
        raise RuntimeError("injected metrics fault")

    engine.metrics.ended = ended  # type: ignore[method-assign]
    outputs, errors = await run_until_crash(engine, [1, 2], SamplingParams(max_tokens=3))
    assert len(outputs) == 2  # the deltas before the last token
    assert [str(e) for e in errors] == [CRASHED]
    assert_idle(engine)


async def test_engine_seed_gives_the_same_tokens_whatever_the_batch_mates() -> None:
    loaded = tiny_model("llama")
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    async with serving(loaded) as engine:
        with trio.fail_after(60):
            alone = tokens_of(await collect(engine, [5, 6, 7], seeded))
            together: list[int] = []

            async def the_seeded() -> None:
                together.extend(tokens_of(await collect(engine, [5, 6, 7], seeded)))

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    mate = SamplingParams(temperature=0.8, max_tokens=25)
                    nursery.start_soon(collect, engine, [9 + i] * (3 + i), mate)
                nursery.start_soon(the_seeded)
    assert together == alone
    assert len(set(alone)) > 3


async def test_engine_rejects_what_could_never_fit_at_admission() -> None:
    async with serving(
        tiny_model("llama"), cache=CacheConfig(block_size=4, num_blocks=201)
    ) as engine:
        with trio.fail_after(30):
            too_long = SamplingParams(max_tokens=100)
            with pytest.raises(
                InvalidRequestError,
                match=r"\+ max_tokens \(100\) exceeds the context length of 512",
            ):
                await collect(engine, [1] * 500, too_long)
            with pytest.raises(InvalidRequestError, match=r"token_ids must be in \[0, 512\)"):
                await collect(engine, [1, 512])
            with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
                await collect(engine, [])
            with pytest.raises(InvalidRequestError, match="text prompts need a tokenizer"):
                await collect(engine, "no tokenizer here")
            assert_idle(engine)
    async with serving(
        tiny_model("llama"), cache=CacheConfig(block_size=4, num_blocks=11)
    ) as engine:
        with pytest.raises(InvalidRequestError, match="context length of 40 tokens"):
            await collect(engine, [1] * 30, SamplingParams(max_tokens=11))


async def test_engine_a_long_text_being_tokenised_holds_up_no_one(smollm2_tokenizer: Any) -> None:
    """Admission tokenises text off its own path: a request sent while a long text is being
    tokenised (then refused, beyond the context) is served first."""
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    order: list[str] = []

    async def long_text(engine: Engine) -> None:
        with pytest.raises(InvalidRequestError, match="exceeds the context length"):
            await collect(engine, "word " * 200_000, GREEDY)  # ~0.7 s of tokenising
        order.append("long text refused")

    async def short(engine: Engine) -> None:
        await collect(engine, [1, 2], SamplingParams(temperature=0, max_tokens=3))
        order.append("short served")

    async with serving(loaded, max_prompt_chars=2_000_000) as engine:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_text, engine)
                await trio.sleep(0.05)
                nursery.start_soon(short, engine)
    assert order == ["short served", "long text refused"]


async def test_engine_refuses_the_excess_when_the_queue_is_full() -> None:
    async with serving(tiny_model("llama"), max_waiting_requests=2) as engine:
        first = engine.submit([1, 2, 3], GREEDY)
        second = engine.submit([1, 2, 3], GREEDY)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
            engine.submit([1, 2, 3], GREEDY)
        engine.abort(first.request_id)
        engine.abort(second.request_id)


async def test_engine_shares_the_waiting_queue_between_tenants_by_weight() -> None:
    """Alone, tenant a may fill the queue; b, below its share, takes the places of a's newest
    (each ends REFUSED, why named); at its share, each is refused while the other waits."""
    a, b = Tenancy(tenant="a"), Tenancy(tenant="b")
    config = {"max_waiting_requests": 4, "scheduler": SchedulerConfig(max_num_seqs=1)}
    async with serving(tiny_model("llama"), **config) as engine, trio.open_nursery() as readers:
        with trio.fail_after(30):
            running = engine.submit([1] * 5, SamplingParams(max_tokens=400), tenancy=a)
            readers.start_soon(read_all, running)
            await engine.until(lambda: engine.stats().num_running == 1)
            queued = [engine.submit([2] * 3, GREEDY, tenancy=a) for _ in range(4)]
            await trio.testing.wait_all_tasks_blocked()  # some admitted, or all: either way
            taken = [engine.submit([3] * 3, GREEDY, tenancy=b) for _ in range(2)]
            for pushed_out in (queued[3], queued[2]):
                assert "a tenant below its share took" in await refusal(pushed_out)
            with pytest.raises(EngineOverloadedError, match="tenant 'b' holds 2 of"):
                engine.submit([3] * 3, GREEDY, tenancy=b)
            with pytest.raises(EngineOverloadedError, match="tenant 'a' holds 2 of"):
                engine.submit([2] * 3, GREEDY, tenancy=a)
            for stream in [running, *queued[:2], *taken]:
                engine.abort(stream.request_id)
            await engine.until(lambda: not engine.stats().num_running + engine.stats().num_waiting)
            assert_idle(engine)  # every block freed, the refused ones' included


async def refusal(stream: RequestStream) -> str:
    """Why a queued request was refused: still being admitted, its stream fails; queued in the
    scheduler, it ends REFUSED."""
    try:
        outputs = [o async for o in stream.outputs()]
    except EngineOverloadedError as exc:
        return str(exc)
    assert outputs[-1].finish_reason is FinishReason.REFUSED
    return outputs[-1].error or ""


async def read_all(stream: RequestStream) -> None:
    async for _ in stream.outputs():
        pass


async def test_engine_refuses_a_backlog_of_queued_prompt_tokens() -> None:
    config = {"max_waiting_tokens": 10, "scheduler": SchedulerConfig(max_num_seqs=1)}
    async with serving(tiny_model("llama"), **config) as engine, trio.open_nursery() as readers:
        with trio.fail_after(30):
            # The only slot: a request that runs, read as it goes (a paused one would yield it).
            running = engine.submit([1] * 5, SamplingParams(temperature=0, max_tokens=400))
            readers.start_soon(read_all, running)
            await engine.until(lambda: engine.stats().num_running == 1)
            queued = engine.submit([2] * 6, GREEDY)
            await engine.until(lambda: engine.stats().num_waiting == 1)
            async with engine.generate([3] * 6, GREEDY) as refused:
                with pytest.raises(EngineOverloadedError, match="max_waiting_tokens=10"):
                    await refused.__anext__()
            engine.abort(queued.request_id)
            engine.abort(running.request_id)


async def test_engine_deadline_passing_in_the_queue() -> None:
    config = {"scheduler": SchedulerConfig(max_num_seqs=1)}
    async with serving(tiny_model("llama"), **config) as engine, trio.open_nursery() as readers:
        with trio.fail_after(60):
            # The only slot: a request that runs for 400 steps, read as it goes.
            blocker = engine.submit([1] * 5, SamplingParams(temperature=0, max_tokens=400))
            readers.start_soon(read_all, blocker)
            await engine.until(lambda: engine.stats().num_running == 1)
            late = await collect(engine, [4, 5], GREEDY, deadline=trio.current_time() + 0.05)
            assert len(late) == 1
            assert late[0].finish_reason is FinishReason.DEADLINE
            assert late[0].error == "the deadline passed while queued"
            assert late[0].token_ids == ()
            assert engine.stats().num_running == 1  # the blocker was still running
            engine.abort(blocker.request_id)
        await engine.until(lambda: engine.stats().num_running == 0)
        assert_idle(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "overlapped"])
async def test_engine_deadline_passing_mid_decode(
    idle_jump_clock: trio.abc.Clock, ahead: bool
) -> None:
    steps = SchedulerConfig(async_scheduling=ahead)
    async with serving(tiny_model("llama"), output_buffer_size=3, scheduler=steps) as engine:
        with trio.fail_after(60):
            sampling = SamplingParams(temperature=0, max_tokens=400)
            deadline = trio.current_time() + 1.0
            stream = engine.submit([1, 2], sampling, deadline=deadline)
            await engine.until(lambda: engine.stats().num_paused)
            await trio.sleep_until(deadline + 0.5)  # (the clock jumps: no time passes else)
            outputs = stream.take()
            assert len(tokens_of(outputs)) == 3  # the deadline passed after 3 tokens
            assert outputs[-1].finish_reason is FinishReason.DEADLINE
            assert outputs[-1].error == "the deadline passed mid-decode"
            assert_idle(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "overlapped"])
async def test_engine_deadline_passing_during_the_final_step_is_not_a_normal_finish(
    ahead: bool,
) -> None:
    """The last step starts before the deadline and ends after it: the client gets DEADLINE
    (an abort wins over the normal finish), and the token of that step is dropped."""
    deadline_wall: list[float] = []  # trio's clock is perf_counter's, moved: both, same instant

    def slow_final_step(output: SchedulerOutput) -> None:
        (seq,) = output.sequences
        if seq.sampling is not None and seq.sampling.num_output_tokens == 4:
            time.sleep(max(0.0, deadline_wall[0] - time.perf_counter()) + 0.1)

    runner = calling_before_each_step(slow_final_step)
    steps = SchedulerConfig(async_scheduling=ahead)
    async with serving(tiny_model("llama"), make_runner=runner, scheduler=steps) as engine:
        with trio.fail_after(30):
            sampling = SamplingParams(temperature=0, max_tokens=5)
            deadline_wall.append(time.perf_counter() + 3.0)
            deadline = trio.current_time() + 3.0
            outputs = await collect(engine, [1, 2], sampling, deadline=deadline)
        assert len(tokens_of(outputs)) == 4
        assert outputs[-1].finish_reason is FinishReason.DEADLINE
        assert outputs[-1].error == "the deadline passed mid-decode"
        assert_idle(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "overlapped"])
async def test_engine_pauses_a_full_buffer_and_resumes_when_drained(ahead: bool) -> None:
    loaded = tiny_model("llama")
    expected = reference_tokens(loaded.model, [3, 1, 4], 30)
    steps = SchedulerConfig(async_scheduling=ahead)
    async with serving(loaded, output_buffer_size=4, scheduler=steps) as engine:
        with trio.fail_after(60):
            slow = engine.submit([3, 1, 4], SamplingParams(temperature=0, max_tokens=30))
            await engine.until(lambda: engine.stats().num_paused)
            assert len(slow.buffer) == 4  # paused at a full buffer, nothing lost
            fast = await collect(engine, [2, 7], SamplingParams(temperature=0, max_tokens=20))
            assert len(tokens_of(fast)) == 20  # a paused neighbour does not hold others up
            assert engine.stats().num_paused == 1
            got = []
            async for output in slow.outputs():
                got.append(output)
            assert [o.finish_reason for o in got] == [None] * 29 + [FinishReason.LENGTH], got[-1]
            assert tokens_of(got) == expected
            assert got[-1].finish_reason is FinishReason.LENGTH
            assert_idle(engine)


async def test_engine_aborts_a_stalled_consumer_and_frees_its_blocks() -> None:
    """Real time: on a virtual clock that jumps when trio idles, a step that is slow in real
    time (a loaded CI machine) jumped first to the stall timer, then to `fail_after`."""
    async with serving(tiny_model("llama"), output_buffer_size=4, stall_timeout=0.5) as engine:
        with trio.fail_after(60):
            stalled = engine.submit([3, 1, 4], SamplingParams(temperature=0, max_tokens=100))
            healthy = await collect(engine, [2, 7], SamplingParams(temperature=0, max_tokens=50))
            assert healthy[-1].finish_reason is FinishReason.LENGTH
            await engine.until(lambda: engine.stats().finished.get("stalled"))
            outputs = stalled.take()
            assert len(outputs) == 5  # the 4 it left unread, then the end
            assert outputs[-1].finish_reason is FinishReason.STALLED
            assert outputs[-1].error == "the client read nothing for stall_timeout=0.5 s"
            assert_idle(engine)
            assert engine.stats().finished == {"length": 1, "stalled": 1}


async def test_engine_abort_is_idempotent_and_safe_for_unknown_ids() -> None:
    async with serving(tiny_model("llama")) as engine:
        engine.abort("never-submitted")
        queued = engine.submit([1, 2, 3], GREEDY)
        engine.abort(queued.request_id)  # still in the admission channel
        engine.abort(queued.request_id)
        outputs = await collect(engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        engine.abort(outputs[-1].request_id)  # already finished
        await trio.sleep(0.05)
        assert_idle(engine)
        assert engine.stats().finished == {"aborted": 1, "length": 1}  # the queued one once


async def test_engine_abort_landing_during_the_final_step_wins() -> None:
    request_ids: list[str] = []

    def abort_during_the_final_step(output: SchedulerOutput) -> None:
        (seq,) = output.sequences
        if seq.sampling is not None and seq.sampling.num_output_tokens == 4:
            # (with steps overlapped, the step before may not be applied yet: let it be)
            four = partial(engine.until, lambda: engine.stats().num_generated_tokens == 4)
            trio.from_thread.run(four)
            trio.from_thread.run_sync(engine.abort, request_ids[0])

    runner = calling_before_each_step(abort_during_the_final_step)
    async with serving(tiny_model("llama"), make_runner=runner) as engine:
        stream = engine.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
        request_ids.append(stream.request_id)
        with trio.fail_after(30):
            outputs = [o async for o in stream.outputs()]
        assert outputs[-1].finish_reason is FinishReason.ABORTED
        assert len(tokens_of(outputs)) == 4
        assert_idle(engine)


async def test_engine_shutdown_ends_every_live_request_with_an_error() -> None:
    engine = Engine(EngineConfig(), lambda: tiny_model("llama"))
    finals: list[RequestOutput] = []

    async def consume(prompt: list[int]) -> None:
        async for output in engine.submit(prompt, SamplingParams(max_tokens=400)).outputs():
            if output.finished:
                finals.append(output)

    with trio.fail_after(30):
        async with trio.open_nursery() as consumers, trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for i in range(4):
                consumers.start_soon(consume, [i + 1] * 3)
            await engine.until(lambda: engine.stats().num_running == 4)  # admitted and running
            nursery.cancel_scope.cancel()
    assert [o.finish_reason for o in finals] == [FinishReason.ERROR] * 4
    assert {o.error for o in finals} == {"the engine stopped"}
    assert_idle(engine)
    with pytest.raises(EngineDeadError, match="the engine stopped"):
        engine.submit([1], GREEDY)
    with pytest.raises(EngineDeadError, match="the engine stopped"):
        await engine.until(lambda: engine.stats().num_running)  # nothing will change it now


async def test_engine_shutdown_ends_requests_submitted_a_moment_before() -> None:
    """Admitted or still in the admission channel, a request's consumer gets an error: a final
    ERROR output, or EngineDeadError from the stream. Never silence."""
    engine = Engine(EngineConfig(), lambda: tiny_model("llama"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            streams = [engine.submit([1, 2, i], GREEDY) for i in range(3)]
            nursery.cancel_scope.cancel()
    for stream in streams:
        if stream.error is not None:
            with pytest.raises(EngineDeadError, match="the engine stopped"):
                stream.take()
        else:
            (final,) = stream.take()
            assert final.finish_reason is FinishReason.ERROR
    assert_idle(engine)


async def test_engine_drain_finishes_admitted_requests_then_returns() -> None:
    engine = Engine(EngineConfig(), lambda: tiny_model("llama"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            stream = engine.submit([1, 2], SamplingParams(temperature=0, max_tokens=30))
            engine.drain()
            with pytest.raises(EngineDeadError, match="draining"):
                engine.submit([1], GREEDY)
        outputs = [o async for o in stream.outputs()]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(outputs)) == 30


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "overlapped"])
async def test_engine_crash_in_a_step_fails_every_consumer_loudly(
    caplog: pytest.LogCaptureFixture, ahead: bool
) -> None:
    """The fifth launch raises (with steps overlapped, while the fourth is being applied)."""
    config = EngineConfig(scheduler=SchedulerConfig(async_scheduling=ahead))
    engine = Engine(config, lambda: tiny_model("llama"), make_runner=failing_at(5))
    finals: list[RequestOutput] = []
    crashes: list[BaseException] = []

    async def run_engine(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await engine.run(task_status=task_status)
        except BaseExceptionGroup as group:
            crashes.append(group)

    async def consume(prompt: list[int]) -> None:
        async for output in engine.submit(prompt, SamplingParams(max_tokens=400)).outputs():
            if output.finished:
                finals.append(output)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_engine)
            for i in range(3):
                nursery.start_soon(consume, [i + 1] * 4)
    (group,) = crashes
    assert group.subgroup(RuntimeError) is not None
    assert [o.finish_reason for o in finals] == [FinishReason.ERROR] * 3
    # Clients learn the kind of fault, not its message (it could hold another client's data);
    # the log has it all.
    assert {o.error for o in finals} == {CRASHED}
    assert "injected fault" in caplog.text
    assert_idle(engine)


ABORT_POINTS = ("never", "queued", "first_output", "mid_decode", "final_step")


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    cases=st.lists(
        st.tuples(
            st.integers(1, 30),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.sampled_from(ABORT_POINTS),
            st.integers(0, 3),  # arrival delay, ms
        ),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.sampled_from([12, 40]),
    ahead=st.booleans(),  # steps overlapped
)
async def test_engine_abort_storm_leaves_every_block_free(
    cases: list[tuple[int, int, str, int]], num_blocks: int, ahead: bool
) -> None:
    config = {
        "cache": CacheConfig(block_size=4, num_blocks=num_blocks),
        "scheduler": SchedulerConfig(max_num_batched_tokens=12, async_scheduling=ahead),
    }
    async with serving(tiny_model("llama"), **config) as engine:

        async def client(prompt_len: int, max_tokens: int, point: str, delay_ms: int) -> None:
            await trio.sleep(delay_ms / 1000)
            sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
            async with engine.generate([7] * prompt_len, sampling) as outputs:
                if point == "queued":
                    return
                received = 0
                async for output in outputs:
                    received += len(output.token_ids)
                    if point == "first_output" or (
                        point == "mid_decode" and received >= max_tokens // 2
                    ):
                        return
                    if point == "final_step" and received == max_tokens - 1:
                        await trio.lowlevel.checkpoint()  # let the final step start, then leave
                        return

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for case in cases:
                    nursery.start_soon(client, *case)
        await trio.sleep(0.01)
        assert_idle(engine)


@pytest.mark.smollm2
async def test_engine_on_smollm2_stops_at_a_stop_string_spanning_tokens(
    smollm2: LoadedModel,
) -> None:
    question = [ChatMessage(role="user", content="What is the capital of France?")]
    async with serving(smollm2, cache=CacheConfig(num_blocks=64)) as engine:
        with trio.fail_after(120):
            plain = await collect(engine, question, SamplingParams(temperature=0, max_tokens=20))
            assert "".join(o.text for o in plain) == "The capital of France is Paris."
            assert plain[-1].finish_reason is FinishReason.STOP
            sampling = SamplingParams(temperature=0, max_tokens=20, stop=("of Fr",))
            stopped = await collect(engine, question, sampling)
            assert "".join(o.text for o in stopped) == "The capital "
            assert stopped[-1].finish_reason is FinishReason.STOP_SEQUENCE
            assert_idle(engine)
