"""The simulated model: deterministic tokens, named parameter errors, and one server holding
2,000 concurrent streams on two cores."""

from __future__ import annotations

import asyncio
import random

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel

from loom.bench.serving import launched_process
from loom.client.calls import server_stats
from loom.core.config import CacheConfig
from loom.core.sampling_params import SamplingParams
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model.sim import SimRunner, load_sim
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, run_client

STREAMS = 2000
STREAMS_PER_CHANNEL = 25  # under --max-streams-per-connection (32)


def sequence(token_ids: tuple[int, ...], computed: int = 0) -> ScheduledSequence:
    sampling = SamplingInput(
        params=SamplingParams(max_tokens=4), num_output_tokens=0, eos_token_ids=()
    )
    return ScheduledSequence(
        request_id="r",
        token_ids=token_ids,
        num_computed_tokens=computed,
        block_table=(1,),
        sampling=sampling,
    )


def test_sim_tokens_follow_the_sequence_and_nothing_else() -> None:
    runner = SimRunner(load_sim("sim:step_ms=0,seq_ms=0,vocab=100"), CacheConfig(num_blocks=9))
    assert (runner.vocab_size, runner.num_blocks) == (100, 9)
    one = runner.execute_model(SchedulerOutput(sequences=(sequence((5, 6, 7)),)))
    again = runner.execute_model(SchedulerOutput(sequences=(sequence((7,), computed=2),)))
    assert one.token_ids == again.token_ids == ((31 * 7 + 17 * 3 + 7) % 100,)
    other = runner.execute_model(SchedulerOutput(sequences=(sequence((8,), computed=2),)))
    assert other.token_ids != one.token_ids


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sim:speed=1", "unknown parameter 'speed'"),
        ("sim:vocab=x", "vocab takes a int, got 'x'"),
        ("sim:blocks=1", "blocks must be at least 2, got 1"),
        ("sim:step_ms=-1", "step_ms must be at least 0.0, got -1"),
    ],
)
def test_sim_refuses_a_bad_parameter_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_sim(spec)


async def many_streams(port: int, count: int) -> tuple[list[object], int]:
    """`count` streams at once, 8 prompt + 16 generated tokens each: each one's token count,
    or the status it was refused with; and the most requests the server ran at once."""
    rng = random.Random(0)
    channels = [Channel(HOST, port) for _ in range(-(-count // STREAMS_PER_CHANNEL))]

    async def one(i: int) -> object:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[rng.randrange(1, 30000) for _ in range(8)]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        )
        try:
            stub = LoomStub(channels[i // STREAMS_PER_CHANNEL])
            responses = await stub.Generate(request, timeout=300)
        except GRPCError as exc:
            return exc.status
        last = responses[-1]
        return sum(len(r.delta.token_ids) for r in responses[:-1]) + len(last.final.delta.token_ids)

    most_running = 0

    async def watch() -> None:
        nonlocal most_running
        while True:
            most_running = max(most_running, (await server_stats(HOST, port)).num_running)
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    try:
        return list(await asyncio.gather(*(one(i) for i in range(count)))), most_running
    finally:
        watcher.cancel()
        for channel in channels:
            channel.close()


def test_sim_server_holds_two_thousand_concurrent_streams() -> None:
    serve = ["--model", "sim:step_ms=100,seq_ms=0.001,token_ms=0", "--max-num-seqs", "2048"]
    serve += ["--max-num-batched-tokens", "16384", "--max-waiting-requests", "4096"]
    with launched_process(serve) as (port, _):
        outcomes, most_running = run_client(many_streams, port, STREAMS)
        stats = run_client(server_stats, HOST, port)
    completed = [o for o in outcomes if o == 16]
    refused = [o for o in outcomes if o == Status.RESOURCE_EXHAUSTED]
    assert len(completed) + len(refused) == STREAMS  # nothing else: no INTERNAL, no hang
    assert len(completed) == STREAMS  # the queue holds them all
    assert most_running >= STREAMS // 2, most_running  # at once, not one after another
    assert stats.num_free_blocks == stats.num_total_blocks
    assert dict(stats.finished) == {"length": STREAMS}
