"""The gRPC server in-process (trio + its asyncio thread) with real grpclib clients over 127.0.0.1.

Rules: port 0; every test under `fail_after`; clients run on their own asyncio loops in worker
threads (or in their own processes where the behaviour is about processes).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest
from grpclib.reflection.v1.reflection_grpc import ServerReflectionStub
from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest
from transformers import AutoTokenizer

from loom.chaos.clients import KILLED_CLIENT
from loom.client.channel import SMALL_WINDOWS
from loom.core.config import SchedulerConfig
from loom.core.sampling_params import SamplingParams
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.loader import LoadedModel
from loom.server.config import ServerConfig
from loom.server.supervisor import Supervisor
from loom.server.traffic import DrainPhase
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.conftest import tiny_model
from tests.support.faults import calling_before_each_step, failing_at
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import (
    HOST,
    NOT_SERVING,
    SERVING,
    generate,
    greedy,
    health,
    in_asyncio,
    model_info,
    server_stats,
    token_ids,
    wait_all_blocks_free,
    wait_paused,
    wait_running,
)
from tests.support.server_harness import loading, serving


async def test_server_streams_carry_the_engine_tokens_for_many_concurrent_streams(
    tiny_chat: LoadedModel,
) -> None:
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + 2 * i)] for i in range(8)]
    expected = [reference_tokens(tiny_chat.model, p, 16) for p in prompts]
    async with serving(tiny_chat) as (_, port):
        results: dict[int, list[pb.GenerateResponse]] = {}

        async def one(i: int) -> None:
            results[i] = await in_asyncio(generate, port, greedy(prompts[i], 16))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
            for i in range(8):
                assert token_ids(results[i]) == expected[i]
                final = results[i][-1].final
                assert final.finish_reason == pb.FINISH_REASON_LENGTH
                assert final.usage.prompt_tokens == len(prompts[i])
                assert final.usage.completion_tokens == 16
                assert all(r.HasField("delta") for r in results[i][:-1])
            await wait_all_blocks_free(port)


async def test_server_streams_text_for_text_and_chat_prompts(
    tiny_chat: LoadedModel, smollm2_tokenizer: Any
) -> None:
    sampling = pb.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            text = await in_asyncio(
                generate, port, pb.GenerateRequest(text="Hello", sampling=sampling)
            )
            ids = token_ids(text)
            joined = "".join((r.delta if r.HasField("delta") else r.final.delta).text for r in text)
            assert joined == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
            logprobs = [
                lp
                for r in text
                for lp in (r.delta if r.HasField("delta") else r.final.delta).logprobs
            ]
            assert [lp.chosen.token_id for lp in logprobs] == ids
            assert all(len(lp.top) == 2 for lp in logprobs)
            chat = pb.GenerateRequest(
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")]),
                sampling=sampling,
            )
            responses = await in_asyncio(generate, port, chat)
            expected = smollm2_tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
            )
            assert responses[-1].final.usage.prompt_tokens == len(expected["input_ids"])
            info = await in_asyncio(model_info, port)
            assert (info.model, info.max_model_len, info.vocab_size) == ("tiny-llama", 512, 49152)
            assert (info.dtype, info.device, info.block_size) == ("float32", "cpu", 16)
            limits = (info.max_num_seqs, info.max_waiting_requests, info.max_waiting_tokens)
            assert limits == (64, 256, 1 << 20)
            assert (info.output_buffer_size, info.stall_timeout) == (64, 30.0)


def chat(messages: list[tuple[str, str]]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role=role, content=content) for role, content in messages]
        )
    )


BAD_REQUESTS = [
    (pb.GenerateRequest(text=""), "prompt text must not be empty"),
    (pb.GenerateRequest(), "prompt is required"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt must not be empty"),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
        "temperature must be in",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)),
        r"top_p must be in \(0, 1\], got 1.5",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=-3)),
        r"max_tokens must be in \[1, \d+\], got -3",
    ),
    (
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1] * 500), sampling=pb.SamplingParams(max_tokens=100)
        ),
        "exceeds the context length of 512 tokens",
    ),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 49152])),
        r"token_ids must be in \[0, 49152\)",
    ),
    # The tiny model's context is 512 tokens: 16 characters a token make 8192.
    (pb.GenerateRequest(text="x" * 9000), "prompt has 9000 characters.*max_prompt_chars=8192"),
    (chat([("x" * 5000, "hi"), ("user", "y" * 4000)]), "prompt has 9006 characters"),
    (chat([("user", "")] * 600), "messages has 600 items; the context length is 512"),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=range(65))),
        "stop_token_ids holds at most 64 ids",
    ),
    (pb.GenerateRequest(text="hi", request_id="r" * 129), "request_id has 129 characters"),
]


async def test_server_answers_bad_input_with_invalid_argument_and_keeps_serving(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            for request, message in BAD_REQUESTS:
                with pytest.raises(GRPCError, match=message) as info:
                    await in_asyncio(generate, port, request)
                assert info.value.status is Status.INVALID_ARGUMENT
            assert len(token_ids(await in_asyncio(generate, port, greedy([1, 2], 5)))) == 5
            stats = await wait_all_blocks_free(port)
            assert dict(stats.finished) == {"length": 1}


async def test_server_refuses_an_oversized_message_before_reading_it(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            huge = pb.GenerateRequest(text="x" * (5 << 20))  # 5 MiB: over the 4 MiB default
            with pytest.raises(GRPCError, match="the limit is max_request_bytes=4194304") as info:
                await in_asyncio(generate, port, huge)
            assert info.value.status is Status.RESOURCE_EXHAUSTED
            assert len(token_ids(await in_asyncio(generate, port, greedy([1, 2], 5)))) == 5


async def test_server_refuses_exactly_the_excess_when_the_queue_is_full(
    tiny_chat: LoadedModel,
) -> None:
    queue_limit = 4
    gate = threading.Event()  # the first step waits for it: everything else queues meanwhile
    config = {"max_waiting_requests": queue_limit, "scheduler": SchedulerConfig(max_num_seqs=1)}
    runner = calling_before_each_step(lambda _: gate.wait(30))
    async with serving(tiny_chat, make_runner=runner, **config) as (server, port):
        with trio.fail_after(60):
            blocker = server.engine.submit([5, 6], SamplingParams(temperature=0, max_tokens=5))
            await wait_running(port)
            outcomes: list[object] = []

            async def one(i: int) -> None:
                try:
                    outcomes.append(
                        token_ids(await in_asyncio(generate, port, greedy([i + 1, 2], 6)))
                    )
                except GRPCError as exc:
                    outcomes.append(exc.status)

            async with trio.open_nursery() as nursery:
                for i in range(3 * queue_limit):
                    nursery.start_soon(one, i)
                while len(outcomes) < 2 * queue_limit:  # noqa: ASYNC110
                    await trio.sleep(0.02)
                gate.set()  # the blocker's step ends; the queued requests run after it
            refused = [o for o in outcomes if o is Status.RESOURCE_EXHAUSTED]
            completed = [o for o in outcomes if isinstance(o, list) and len(o) == 6]
            assert (len(refused), len(completed)) == (2 * queue_limit, queue_limit)
            assert len([o async for o in blocker.outputs()]) == 5
            await wait_all_blocks_free(port)


async def test_server_health_and_reflection_answer_a_grpclib_client(tiny_chat: LoadedModel) -> None:
    async def reflect(port: int) -> tuple[list[str], bytes]:
        async with Channel(HOST, port) as channel:
            stub = ServerReflectionStub(channel)
            async with stub.ServerReflectionInfo.open() as stream:
                await stream.send_message(ServerReflectionRequest(list_services=""))
                listed = await stream.recv_message()
                await stream.send_message(
                    ServerReflectionRequest(file_containing_symbol="loom.v1.Loom")
                )
                described = await stream.recv_message()
                await stream.end()
            assert listed is not None
            assert described is not None
            names = [s.name for s in listed.list_services_response.service]
            return names, described.file_descriptor_response.file_descriptor_proto[0]

    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            assert await in_asyncio(health, port) == SERVING
            assert await in_asyncio(health, port, "loom.v1.Loom") == SERVING
            names, descriptor = await in_asyncio(reflect, port)
            assert {"loom.v1.Loom", "grpc.health.v1.Health"} <= set(names)
            assert b"loom/v1/loom.proto" in descriptor
            assert b"GenerateRequest" in descriptor


async def test_server_is_not_serving_while_the_model_loads(tiny_chat: LoadedModel) -> None:
    with trio.fail_after(30):
        async with loading(tiny_chat) as (_, port, release):
            assert await in_asyncio(health, port) == NOT_SERVING
            for call in (partial(generate, port, greedy([1], 2)), partial(server_stats, port)):
                with pytest.raises(GRPCError, match="the model is still loading") as info:
                    await in_asyncio(call)
                assert info.value.status is Status.UNAVAILABLE
            release.set()
            while await in_asyncio(health, port) != SERVING:  # noqa: ASYNC110
                await trio.sleep(0.02)
            assert len(token_ids(await in_asyncio(generate, port, greedy([1], 2)))) == 2


async def test_server_drained_while_the_model_loads_never_serves(tiny_chat: LoadedModel) -> None:
    """SIGTERM during loading: once loaded, health still says NOT_SERVING and calls get
    UNAVAILABLE (not INTERNAL), over a connection the client opened before (a health Watch
    keeps it busy, so the drain does not send it away); a new connection is refused."""
    with trio.fail_after(30):
        async with loading(tiny_chat) as (server, port, release):
            loaded, connected = threading.Event(), threading.Event()
            probes: list[object] = []
            async with trio.open_nursery() as nursery:
                probe = partial(probe_across_the_load, port, loaded, connected, probes)
                nursery.start_soon(in_asyncio, probe)
                await trio.to_thread.run_sync(connected.wait, 10)
                nursery.start_soon(server.drain)
                await trio.sleep(0.1)
                release.set()
                await wait_engine_loaded(server)
                while server.drainer is None or server.drainer.phase is not DrainPhase.REFUSING:  # noqa: ASYNC110
                    await trio.sleep(0.02)  # the grace: calls still served (no event for it)
                loaded.set()  # the probe's calls reach the endpoint after it entered the phase
            assert probes == [NOT_SERVING, NOT_SERVING, Status.UNAVAILABLE, "refused"]


async def probe_across_the_load(
    port: int, loaded: threading.Event, connected: threading.Event, probes: list[object]
) -> None:
    async with Channel(HOST, port) as channel, HealthStub(channel).Watch.open() as watch:
        await watch.send_message(HealthCheckRequest(), end=True)
        await watch.recv_message()
        check = HealthStub(channel).Check
        probes.append(int((await check(HealthCheckRequest())).status))
        connected.set()
        await asyncio.to_thread(loaded.wait, 10)
        probes.append(int((await check(HealthCheckRequest())).status))
        try:
            await LoomStub(channel).Generate(greedy([1], 2))
        except GRPCError as exc:
            probes.append(exc.status)
        try:
            async with Channel(HOST, port) as fresh:
                await HealthStub(fresh).Check(HealthCheckRequest())
        except ConnectionRefusedError:
            probes.append("refused")
        await watch.cancel()


async def wait_engine_loaded(server: Supervisor) -> None:
    while not server.engine.loaded:  # noqa: ASYNC110 (engine state, no event for it)
        await trio.sleep(0.02)


async def test_server_refuses_text_the_model_has_no_embedding_for(smollm2_tokenizer: Any) -> None:
    """A tokenizer with more tokens than the model's embedding: a text prompt that makes one
    is INVALID_ARGUMENT, and the engine serves on (it used to crash the step for everyone)."""
    small = tiny_model("llama", vocab_size=512, tokenizer=smollm2_tokenizer)
    async with serving(small) as (_, port):
        with trio.fail_after(60):
            with pytest.raises(GRPCError, match="beyond this model's vocabulary of 512") as info:
                await in_asyncio(generate, port, pb.GenerateRequest(text="Hello, world"))
            assert info.value.status is Status.INVALID_ARGUMENT
            assert len(token_ids(await in_asyncio(generate, port, greedy([1, 2], 4)))) == 4


async def test_server_a_chat_the_template_refuses_is_invalid_argument(
    smollm2_tokenizer: Any, tiny_folder: Path
) -> None:
    strict = AutoTokenizer.from_pretrained(tiny_folder)  # a copy: its template is changed here
    strict.chat_template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles are user and assistant') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=strict)
    async with serving(loaded) as (_, port):
        with trio.fail_after(60):
            bad = chat([("wizard", "hi")])
            with pytest.raises(GRPCError, match="roles are user and assistant") as info:
                await in_asyncio(generate, port, bad)
            assert info.value.status is Status.INVALID_ARGUMENT
            good = chat([("user", "hi")])
            good.sampling.max_tokens = 3
            assert len(token_ids(await in_asyncio(generate, port, good))) >= 1


async def test_server_frees_blocks_when_a_client_resets_or_closes_mid_stream(
    tiny_chat: LoadedModel,
) -> None:
    async def cancel_after_three(port: int) -> int:
        async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
            await stream.send_message(greedy([3, 4], 400), end=True)
            for _ in range(3):
                await stream.recv_message()
            await stream.cancel()  # RST_STREAM
            return 3

    async def close_channel_after_three(port: int) -> int:
        channel = Channel(HOST, port)
        stream = LoomStub(channel).Generate.open()
        await stream.__aenter__()
        await stream.send_message(greedy([5, 6], 400), end=True)
        for _ in range(3):
            await stream.recv_message()
        channel.close()  # the connection goes; the stream is never finished
        return 3

    expected = reference_tokens(tiny_chat.model, [9, 9, 9], 40)
    async with serving(tiny_chat, output_buffer_size=4) as (_, port):
        with trio.fail_after(60):
            for leaver in (cancel_after_three, close_channel_after_three):
                healthy: list[int] = []

                async def healthy_stream(healthy: list[int] = healthy) -> None:
                    healthy.extend(
                        token_ids(await in_asyncio(generate, port, greedy([9, 9, 9], 40)))
                    )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(healthy_stream)
                    await in_asyncio(leaver, port)
                stats = await wait_all_blocks_free(port)
                assert healthy == expected
            assert dict(stats.finished) == {"aborted": 2, "length": 2}


async def test_server_client_deadline_ends_the_request_and_frees_blocks(
    tiny_chat: LoadedModel,
) -> None:
    async def slow_reader(port: int) -> BaseException:
        # Small windows and 20 logprobs a token: flow control holds the server back after
        # ~190 tokens, so the request is still running at its deadline however fast the
        # machine (with a large window a fast one wrote all 400 tokens in under 0.5 s).
        async with Channel(HOST, port, config=SMALL_WINDOWS) as channel:
            try:
                async with LoomStub(channel).Generate.open(timeout=0.5) as stream:
                    await stream.send_message(greedy([3, 4], 400, logprobs=20), end=True)
                    async for _ in stream:
                        await asyncio.sleep(0.2)
            except (TimeoutError, GRPCError, StreamTerminatedError) as exc:
                return exc
        raise AssertionError("the stream ended normally")

    async with serving(tiny_chat, output_buffer_size=2) as (_, port):
        with trio.fail_after(60):
            error = await in_asyncio(slow_reader, port)
            # grpclib's client reports its own deadline as asyncio.TimeoutError; the server
            # side as DEADLINE_EXCEEDED, or (its trailers queued behind a full window) as a
            # reset stream.
            assert isinstance(error, asyncio.TimeoutError | StreamTerminatedError) or (
                isinstance(error, GRPCError) and error.status is Status.DEADLINE_EXCEEDED
            )
            stats = await wait_all_blocks_free(port)
            assert set(dict(stats.finished)) <= {"deadline", "aborted"}


async def test_server_aborts_a_client_that_stops_reading_while_others_keep_going(
    tiny_chat: LoadedModel,
) -> None:
    async def never_reads(port: int, stop: threading.Event) -> str:
        try:
            async with (
                Channel(HOST, port, config=SMALL_WINDOWS) as channel,
                LoomStub(channel).Generate.open() as stream,
            ):
                # Logprobs make each message a few hundred bytes: the 64 KiB window fills fast.
                await stream.send_message(greedy([3, 4], 480, logprobs=20), end=True)
                await asyncio.to_thread(stop.wait, 60)
        except StreamTerminatedError:
            return "reset"
        return "not reset"

    stop = threading.Event()
    expected = reference_tokens(tiny_chat.model, [8, 8], 30)
    async with serving(tiny_chat, output_buffer_size=4, stall_timeout=8.0) as (_, port):
        with trio.fail_after(60):
            outcome: list[str] = []

            async def stalled_client() -> None:
                outcome.append(await in_asyncio(never_reads, port, stop))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stalled_client)
                await wait_paused(port)
                healthy = token_ids(await in_asyncio(generate, port, greedy([8, 8], 30)))
                assert healthy == expected
                stats = await wait_all_blocks_free(port)
                assert dict(stats.finished) == {"length": 1, "stalled": 1}
                stop.set()
            assert outcome == ["reset"]  # RST_STREAM: the blocked send was given up


async def test_server_frees_blocks_when_a_client_process_is_killed(tiny_chat: LoadedModel) -> None:
    expected = reference_tokens(tiny_chat.model, [9, 9], 60)
    async with serving(tiny_chat, output_buffer_size=4) as (_, port):
        with trio.fail_after(60):
            command = [sys.executable, "-c", KILLED_CLIENT, HOST, str(port), "400"]
            client = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
            healthy: list[int] = []
            try:
                assert client.stdout is not None
                first = await client.stdout.receive_some()
                assert first.startswith(b"token")  # mid-stream (the newline may come apart)

                async def healthy_stream() -> None:
                    healthy.extend(token_ids(await in_asyncio(generate, port, greedy([9, 9], 60))))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(healthy_stream)
                    client.kill()  # SIGKILL
                    assert await client.wait() == -9
            finally:
                client.kill()
                await client.wait()
                if client.stdout is not None:
                    await client.stdout.aclose()
            stats = await wait_all_blocks_free(port)
            assert healthy == expected
            assert dict(stats.finished) == {"aborted": 1, "length": 1}


async def test_server_engine_crash_fails_live_streams_with_unavailable(
    tiny_chat: LoadedModel,
) -> None:
    engine = Engine(EngineConfig(), lambda: tiny_chat, make_runner=failing_at(20))
    server = Supervisor(engine, ServerConfig(port=0))
    errors: list[GRPCError] = []
    with trio.fail_after(30), pytest.RaisesGroup(RuntimeError, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.run)
            try:
                await in_asyncio(generate, port, greedy([1, 2], 400))
            except GRPCError as exc:
                errors.append(exc)
    (error,) = errors
    assert error.status is Status.UNAVAILABLE
    assert error.message == "the engine crashed (RuntimeError); see the server log"


async def test_server_request_id_is_a_label_two_clients_may_share(
    tiny_chat: LoadedModel,
) -> None:
    """The engine keys requests by its own ids: two live streams with one client id each get
    their own tokens, and each Final echoes the id its client sent."""
    prompts = ([4, 4], [5, 6, 7])
    expected = [reference_tokens(tiny_chat.model, p, 30) for p in prompts]
    async with serving(tiny_chat, output_buffer_size=2) as (_, port):
        results: dict[int, list[pb.GenerateResponse]] = {}

        async def one(i: int) -> None:
            request = greedy(list(prompts[i]), 30)
            request.request_id = "same"
            results[i] = await in_asyncio(generate, port, request)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
            for i in range(2):
                assert token_ids(results[i]) == expected[i]
                assert results[i][-1].final.request_id == "same"
            stats = await wait_all_blocks_free(port)
            assert dict(stats.finished) == {"length": 2}


async def test_server_closes_the_connections_still_open_when_it_stops(
    tiny_chat: LoadedModel,
) -> None:
    """grpclib cancels the calls of a closing server but leaves its sockets open."""
    async with serving(tiny_chat) as (_, port):
        client = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(10):
            assert await client.receive_some(1024)  # the server's HTTP/2 settings: accepted
    with trio.fail_after(10):
        while await client.receive_some(1024):  # b"" once the server's end is closed
            pass
    await client.aclose()
