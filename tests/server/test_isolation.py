"""One client can never reach another (docs/architecture.md, invariants 8 and 9): a real server,
real grpclib clients, each scenario one that a hostile or careless client was seen to play.

Rules: port 0; every test under `fail_after`; clients on their own asyncio loops in worker
threads. Where a scenario needs a thread to stand still, the test blocks it on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError
from hyperframe.frame import HeadersFrame, RstStreamFrame

from loom.client.channel import SMALL_WINDOWS
from loom.client.frames import grpc_message
from loom.core.config import SchedulerConfig
from loom.model.loader import LoadedModel
from loom.server.bridge import TrioBridge
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import (
    HOST,
    generate,
    greedy,
    in_asyncio,
    run_client,
    server_stats,
    token_ids,
    wait_all_blocks_free,
    wait_running,
)
from tests.support.server_harness import serving


def labelled(request: pb.GenerateRequest, request_id: str) -> pb.GenerateRequest:
    request.request_id = request_id
    return request


async def test_isolation_a_retry_with_the_id_of_a_request_cancelled_in_admission(
    tiny_chat: LoadedModel,
) -> None:
    """A client cancels request X at once, while admission is busy tokenising a long text, and
    retries with the same id: the retry gets its own tokens, and the engine stays up."""
    expected = reference_tokens(tiny_chat.model, [7, 8, 9], 20)
    long_text = pb.GenerateRequest(text="word " * 200_000)  # ~0.7 s of tokenising

    async def cancel_then_retry(port: int) -> list[pb.GenerateResponse]:
        async with Channel(HOST, port) as channel:
            async with LoomStub(channel).Generate.open() as stream:
                await stream.send_message(labelled(greedy([1, 2, 3], 20), "X"), end=True)
                await stream.cancel()
            return list(await LoomStub(channel).Generate(labelled(greedy([7, 8, 9], 20), "X")))

    async with serving(tiny_chat, max_prompt_chars=2_000_000) as (_, port):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_asyncio, expect_refusal, port, long_text)
                await trio.sleep(0.2)
                retried = await in_asyncio(cancel_then_retry, port)
            assert token_ids(retried) == expected
            assert retried[-1].final.request_id == "X"
            assert retried[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
            await wait_all_blocks_free(port)


async def expect_refusal(port: int, request: pb.GenerateRequest) -> None:
    with pytest.raises(GRPCError) as refused:
        await generate(port, request)
    assert refused.value.status is Status.INVALID_ARGUMENT


async def test_isolation_a_handler_flushing_a_finished_stream_cannot_abort_a_namesake(
    tiny_chat: LoadedModel,
) -> None:
    """Client A's request X has finished in the engine, but its handler is still sending the
    final message to A, who is not reading. Client B starts its own X. When A reads and its
    handler ends, B's X must carry on: a handler aborts its own request, not a name."""
    prompts = ([3, 4], [5, 6, 7])
    expected = [reference_tokens(tiny_chat.model, p, 480) for p in prompts]
    async with serving(tiny_chat, output_buffer_size=1000) as (_, port):  # A never pauses
        with trio.fail_after(60):
            a_tokens, b_tokens = await in_asyncio(a_then_b, port, prompts)
        assert a_tokens == expected[0]
        assert b_tokens == expected[1]
        stats = await wait_all_blocks_free(port)
        assert dict(stats.finished) == {"length": 2}


async def a_then_b(port: int, prompts: tuple[list[int], list[int]]) -> tuple[list[int], ...]:
    b_streaming = asyncio.Event()
    async with (
        Channel(HOST, port, config=SMALL_WINDOWS) as channel,
        LoomStub(channel).Generate.open() as stream,
    ):
        request = labelled(greedy(prompts[0], 480, logprobs=20), "X")
        await stream.send_message(request, end=True)
        await wait_finished(port, "length")  # A's X: done in the engine, not yet read
        b = asyncio.ensure_future(client_b(port, prompts[1], b_streaming))
        await b_streaming.wait()
        a_received = [response async for response in stream]
    return token_ids(a_received), await b


async def client_b(port: int, prompt: list[int], streaming: asyncio.Event) -> list[int]:
    async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
        await stream.send_message(labelled(greedy(prompt, 480), "X"), end=True)
        received = []
        async for response in stream:
            received.append(response)
            streaming.set()
            await asyncio.sleep(0.002)  # still streaming when A's handler ends
        return token_ids(received)


async def wait_finished(port: int, reason: str) -> None:
    async with Channel(HOST, port) as channel:
        stub = LoomStub(channel)
        while reason not in (await stub.GetServerStats(pb.GetServerStatsRequest())).finished:  # noqa: ASYNC110 (remote state)
            await asyncio.sleep(0.02)


async def test_isolation_a_connection_that_reads_nothing_starves_no_one(
    tiny_chat: LoadedModel,
) -> None:
    """One connection opens 64 streams and reads nothing. Another client, on its own
    connection, is served while they are all still open: the server lets a connection have 32
    streams at once, and a paused request gives up its batch slot. Before, the paused requests
    held every slot until the stall timeout."""
    expected = reference_tokens(tiny_chat.model, [8, 8], 30)
    # As many batch slots as one connection may have streams: the cap alone would not do.
    config = {"stall_timeout": 120.0, "scheduler": SchedulerConfig(max_num_seqs=32)}
    async with serving(tiny_chat, **config) as (_, port):
        with trio.fail_after(60):
            alone = await timed_generate(port, greedy([8, 8], 30))
            stop = threading.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_asyncio, many_unread_streams, port, 64, stop)
                await wait_paused_count(port, 32)
                beside = await timed_generate(port, greedy([8, 8], 30))
                stats = await in_asyncio(server_stats, port)
                stop.set()
        assert alone[0] == beside[0] == expected
        assert stats.num_paused == 32  # all still there, not aborted
        print(
            f"first token alone {alone[1] * 1000:.0f} ms, beside 64 unread streams "
            f"{beside[1] * 1000:.0f} ms ({beside[1] / alone[1]:.1f}x)"
        )


async def timed_generate(port: int, request: pb.GenerateRequest) -> tuple[list[int], float]:
    """Tokens, and the seconds to the first of them."""

    async def run() -> tuple[list[int], float]:
        start = time.perf_counter()
        first = None
        ids: list[int] = []
        async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
            await stream.send_message(request, end=True)
            async for response in stream:
                first = first or time.perf_counter() - start
                ids += token_ids([response])
        return ids, first or 0.0

    return await in_asyncio(run)


async def many_unread_streams(port: int, count: int, stop: threading.Event) -> None:
    """`count` streams on one connection, reading nothing until `stop`."""
    async with Channel(HOST, port, config=SMALL_WINDOWS) as channel:
        streams = [LoomStub(channel).Generate.open() for _ in range(count)]

        async def open_one(i: int, stream: object) -> None:
            await stream.__aenter__()  # type: ignore[attr-defined]
            await stream.send_message(greedy([i + 1, 2], 480, logprobs=20), end=True)  # type: ignore[attr-defined]

        openers = [asyncio.ensure_future(open_one(i, s)) for i, s in enumerate(streams)]
        await asyncio.to_thread(stop.wait, 60)
        for opener in openers:
            opener.cancel()
        await asyncio.gather(*openers, return_exceptions=True)


async def wait_paused_count(port: int, count: int) -> None:
    while (await in_asyncio(server_stats, port)).num_paused < count:  # noqa: ASYNC110 (remote state)
        await trio.sleep(0.05)


async def test_isolation_a_handler_cancelled_while_submitting_leaves_no_request_behind(
    tiny_chat: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client cancels while its handler waits for the trio thread to submit (blocked here
    on purpose, until the client has cancelled): once submitted, the request is aborted at
    once, not kept until the stall timeout holding a slot and blocks."""
    async with serving(tiny_chat, output_buffer_size=2, stall_timeout=120.0) as (_, port):
        with trio.fail_after(60):
            submitting = threading.Event()
            watch_submissions(monkeypatch, submitting)
            cancelled = threading.Event()
            client = threading.Thread(
                target=run_client, args=(send_then_cancel, port, submitting, cancelled)
            )
            client.start()
            cancelled.wait(30)  # blocks the engine's trio thread, on purpose
            await trio.to_thread.run_sync(client.join)
            assert submitting.is_set()
            await in_asyncio(wait_finished, port, "aborted")  # in admission or after
            stats = await wait_all_blocks_free(port)
            assert (stats.num_running, stats.num_waiting, stats.num_paused) == (0, 0, 0)
            assert dict(stats.finished) == {"aborted": 1}


def watch_submissions(monkeypatch: pytest.MonkeyPatch, submitting: threading.Event) -> None:
    """Set `submitting` when a handler asks the trio thread to submit (the call itself is
    the real one): the moment the test waits for, rather than a guess at how long it takes."""
    bridge_call = TrioBridge.call

    async def call(bridge: TrioBridge, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__name__", None) == "submit_all":
            submitting.set()
        return await bridge_call(bridge, fn, *args, **kwargs)

    monkeypatch.setattr(TrioBridge, "call", call)


async def send_then_cancel(
    port: int, submitting: threading.Event, cancelled: threading.Event
) -> None:
    async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
        await stream.send_message(greedy([3, 4], 400), end=True)
        await asyncio.to_thread(submitting.wait, 30)  # the handler waits on the trio thread
        await stream.cancel()
        cancelled.set()


async def test_isolation_a_final_message_never_read_is_given_up_after_the_send_timeout(
    tiny_chat: LoadedModel,
) -> None:
    """The request finishes while its handler cannot run (its loop is blocked here on purpose),
    so the handler takes every output, the final one too, in one batch, and then blocks
    sending to a client that reads nothing. It must give up after `send_timeout` (the stall
    timeout) and reset the stream, not wait for the client forever."""
    config = {"output_buffer_size": 1000, "stall_timeout": 2.0}  # never paused; 2 s to read
    async with serving(tiny_chat, **config) as (server, port):
        with trio.fail_after(60):
            outcome: list[str] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: in_asyncio(read_late, port, 8.0, outcome))
                await wait_running(port)
                assert server.io is not None
                server.io.in_loop(lambda: time.sleep(2.0))  # the engine finishes meanwhile
            assert outcome == ["reset"]
            stats = await wait_all_blocks_free(port)
            assert dict(stats.finished) == {"length": 1}


async def read_late(port: int, delay: float, outcome: list[str]) -> None:
    """A request of 300 tokens with logprobs (about 100 KB), read only after `delay` s."""
    async with Channel(HOST, port, config=SMALL_WINDOWS) as channel:
        try:
            async with LoomStub(channel).Generate.open() as stream:
                await stream.send_message(greedy([3, 4], 300, logprobs=20), end=True)
                await asyncio.sleep(delay)
                async for _ in stream:
                    pass
        except StreamTerminatedError:
            outcome.append("reset")
            return
    outcome.append("read it all")


async def test_isolation_a_deadline_already_past_on_arrival_is_deadline_exceeded(
    tiny_chat: LoadedModel,
) -> None:
    """grpclib answers a call whose deadline passes before its handler starts with UNKNOWN
    ("Internal Server Error"; seen in a storm under load, with deadlines of 10 ms). The server
    takes the deadline out of grpclib's hands and answers DEADLINE_EXCEEDED."""
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            trailers = await in_asyncio(
                raw_call, port, GENERATE, grpc_message(greedy([1, 2], 5)), [("grpc-timeout", "1u")]
            )
    assert trailers.get("grpc-status") == str(Status.DEADLINE_EXCEEDED.value), trailers


GENERATE = "/loom.v1.Loom/Generate"
STATS = "/loom.v1.Loom/GetServerStats"


@pytest.mark.parametrize(
    ("path", "data", "headers", "status", "message"),
    [
        (GENERATE, grpc_message(b"\xff\xff\xff"), [], Status.INVALID_ARGUMENT, "does not parse"),
        (
            GENERATE,
            grpc_message(greedy([1], 2), size=500),
            [],
            Status.INVALID_ARGUMENT,
            "cut short",
        ),
        (GENERATE, b"\x00\x00", [], Status.INVALID_ARGUMENT, "cut short"),
        (
            GENERATE,
            grpc_message(greedy([1], 2)),
            [("grpc-timeout", "banana")],
            Status.INVALID_ARGUMENT,
            "grpc-timeout header is malformed",
        ),
        (
            GENERATE,
            grpc_message(greedy([1], 2)),
            [("grpc-timeout", "9" * 400 + "S")],  # a float overflows: gRPC allows 8 digits
            Status.INVALID_ARGUMENT,
            "grpc-timeout header is malformed",
        ),
        (
            GENERATE,
            grpc_message(greedy([1], 2)),
            [("x-key-bin", "a")],  # not base64
            Status.INVALID_ARGUMENT,
            "the request metadata is malformed",
        ),
        (
            GENERATE,
            grpc_message(greedy([1], 2)),
            [("x-key-bin", "é")],  # not ASCII
            Status.INVALID_ARGUMENT,
            "the request metadata is malformed",
        ),
        (
            STATS,  # every service, not only Generate: grpclib would read 4 GiB
            struct.pack(">?I", False, 5 << 20),
            [],
            Status.RESOURCE_EXHAUSTED,
            "max_request_bytes=4194304",
        ),
    ],
)
async def test_isolation_malformed_frames_are_answered_not_dropped_nor_crashed(
    tiny_chat: LoadedModel,
    path: str,
    data: bytes,
    headers: list[tuple[str, str]],
    status: Status,
    message: str,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            trailers = await in_asyncio(raw_call, port, path, data, headers)
            assert trailers.get("grpc-status") == str(status.value), trailers
            assert message in trailers.get("grpc-message", "")
            assert len(token_ids(await in_asyncio(generate, port, greedy([1, 2], 3)))) == 3


async def raw_call(port: int, path: str, data: bytes, headers: list[tuple[str, str]]) -> Any:
    """One call over a bare HTTP/2 connection, sending `data` as it is, whatever the headers
    say (a grpclib client would give up first). The response's headers and trailers."""
    async with bare_connection(port) as (reader, writer, connection):
        return await call_once(reader, writer, connection, port, path, data, headers)


async def call_once(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    connection: h2.connection.H2Connection,
    port: int,
    path: str,
    data: bytes,
    headers: list[tuple[str, str]],
) -> dict[str, str]:
    connection.send_headers(1, request_headers(port, path, headers))
    connection.send_data(1, data, end_stream=True)
    received: dict[str, str] = {}
    ended = False
    while not ended:
        writer.write(connection.data_to_send())
        await writer.drain()
        chunk = await reader.read(65536)
        if not chunk:
            break
        for event in connection.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                received.update(event.headers)
            ended = ended or isinstance(event, h2.events.StreamEnded | h2.events.StreamReset)
    return received


@asynccontextmanager
async def bare_connection(
    port: int,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter, h2.connection.H2Connection]]:
    """A client HTTP/2 connection driven by hand, its socket closed however the test ends."""
    reader, writer = await asyncio.open_connection(HOST, port)
    connection = h2_client()
    connection.initiate_connection()
    try:
        yield reader, writer, connection
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def h2_client() -> h2.connection.H2Connection:
    return h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )


def request_headers(
    port: int, path: str, extra: list[tuple[str, str]] | None = None
) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", f"{HOST}:{port}"),
        ("content-type", "application/grpc+proto"),
        ("te", "trailers"),
        *(extra or []),
    ]


async def test_isolation_streams_opened_before_the_limit_was_heard_are_refused_one_by_one(
    tiny_chat: LoadedModel,
) -> None:
    """A client opens 40 streams at once before it has read the server's SETTINGS, as HTTP/2
    lets it. The streams over the limit (32) are refused, each with RESOURCE_EXHAUSTED, and
    the others served on the same connection: h2 on its own would drop the connection, with
    every stream on it (seen before as a flaky test: 64 streams from one grpclib client,
    none of them ever served)."""
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            statuses = await in_asyncio(open_streams_before_the_settings, port, 40)
    assert sorted(statuses.values()).count(str(Status.OK.value)) == 32, statuses
    refused = [s for s in statuses.values() if s != str(Status.OK.value)]
    assert refused == [str(Status.RESOURCE_EXHAUSTED.value)] * 8, statuses


async def open_streams_before_the_settings(port: int, count: int) -> dict[int, str]:
    """grpc-status by stream, for `count` Generate calls opened at once, before reading
    anything from the server."""
    async with bare_connection(port) as (reader, writer, connection):
        return await open_streams(reader, writer, connection, port, count)


async def open_streams(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    connection: h2.connection.H2Connection,
    port: int,
    count: int,
) -> dict[int, str]:
    for i in range(count):
        stream_id = 2 * i + 1
        connection.send_headers(stream_id, request_headers(port, GENERATE))
        connection.send_data(stream_id, grpc_message(greedy([i + 1, 2], 2)), end_stream=True)
    writer.write(connection.data_to_send())
    statuses: dict[int, str] = {}
    chunk = await reader.read(65536)
    while True:
        for event in connection.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                status = dict(event.headers).get("grpc-status")
                if status is not None:
                    statuses[event.stream_id] = status
            if isinstance(event, h2.events.DataReceived):
                connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        writer.write(connection.data_to_send())
        if len(statuses) == count:
            break
        chunk = await reader.read(65536)
        assert chunk, f"the server closed the connection; {len(statuses)} streams answered"
    return statuses


async def test_isolation_streams_refused_and_reset_in_one_read_break_nothing(
    tiny_chat: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A client holds the 32 streams its connection may have, then sends 20 more, each HEADERS
    followed by its RST_STREAM in the same write: the server reads the reset before it answers
    the refusal, and must neither fail on the closed stream nor drop the connection; the 32
    are served to their end."""
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            statuses = await in_asyncio(hold_then_refuse_reset_streams, port)
            assert sorted(set(statuses.values())) == [str(Status.OK.value)], statuses
            assert len(statuses) == 32
            await wait_all_blocks_free(port)
    failures = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert failures == [], [r.getMessage() for r in failures]


async def hold_then_refuse_reset_streams(port: int) -> dict[int, str]:
    async with bare_connection(port) as (reader, writer, connection):
        for i in range(32):
            connection.send_headers(2 * i + 1, request_headers(port, GENERATE))
            connection.send_data(2 * i + 1, grpc_message(greedy([i + 1, 2], 40)), end_stream=True)
        writer.write(connection.data_to_send())
        raw = b""
        for i in range(32, 52):
            raw += opened_then_reset(2 * i + 1, request_headers(port, GENERATE))
        writer.write(raw)
        statuses: dict[int, str] = {}
        while len(statuses) < 32:
            chunk = await reader.read(65536)
            assert chunk, f"the server closed the connection; {len(statuses)} streams answered"
            for event in connection.receive_data(chunk):
                if isinstance(event, h2.events.TrailersReceived):
                    statuses[event.stream_id] = dict(event.headers)["grpc-status"]
                if isinstance(event, h2.events.DataReceived):
                    connection.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
            writer.write(connection.data_to_send())
        return statuses


def opened_then_reset(stream_id: int, headers: list[tuple[str, str]]) -> bytes:
    """HEADERS (END_HEADERS) then RST_STREAM(CANCEL) for a new stream, written past the
    client's h2 (which would not open a stream over the server's limit), its header block
    encoded without indexing so that the client's own encoder state is untouched."""
    block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])
    headers_frame = HeadersFrame(stream_id, data=block, flags=["END_HEADERS"])
    reset = RstStreamFrame(stream_id, error_code=8)
    return bytes(headers_frame.serialize() + reset.serialize())
