"""A stream's life at the network boundary (loom/server/grpc/), against a real server and
real clients: what a stream refused unread leaves behind, what a client's GOAWAY means for its
streams in flight, and DATA sent where nothing is read.

Rules: port 0; the server in this process; clients on their own asyncio loops in worker threads
(grpclib) or on bare sockets (frames made by hand); every test under `fail_after`.
"""

from __future__ import annotations

import socket

import h2.connection
import h2.events
import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from hyperframe.frame import DataFrame, Frame, HeadersFrame

from loom.client import frames as raw
from loom.model.loader import LoadedModel
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, greedy, in_asyncio, token_ids, wait_all_blocks_free
from tests.support.server_harness import serving

GENERATE = "/loom.v1.Loom/Generate"
WATCH = "/grpc.health.v1.Health/Watch"


async def refused_then_served(port: int, count: int) -> list[object]:
    """On one channel: `count` requests over --max-request-bytes, then a normal one."""
    outcomes: list[object] = []
    huge = pb.GenerateRequest(text="x" * (5 << 20))
    async with Channel(HOST, port) as channel:
        stub = LoomStub(channel)
        for _ in range(count):
            try:
                await stub.Generate(huge, timeout=10)
            except GRPCError as exc:
                outcomes.append(exc.status)
        outcomes.append(len(token_ids(list(await stub.Generate(greedy([1, 2], 3), timeout=10)))))
    return outcomes


async def test_streams_refused_unread_leave_the_connection_s_window_open(
    tiny_chat: LoadedModel,
) -> None:
    """Twenty requests refused unread (each over --max-request-bytes, its client sending what
    its window allows), then a normal request on the same channel: served. Before, the unread
    bytes were never given back, the connection's window shrank with each refusal, and from the
    fifth the channel could send nothing (every call waited out the request timeout)."""
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            outcomes = await in_asyncio(refused_then_served, port, 20)
            await wait_all_blocks_free(port)
    assert outcomes == [Status.RESOURCE_EXHAUSTED] * 20 + [3]


def call_then_goaway(port: int) -> list[Frame]:
    """A Generate call of 60 tokens, then at once the client's GOAWAY (last stream 1)."""
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", GENERATE)]
    headers += [(":authority", f"{HOST}:{port}"), ("content-type", "application/grpc")]
    connection.send_headers(1, [*headers, ("te", "trailers")])
    body = greedy([1, 2], 60).SerializeToString()
    connection.send_data(1, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    with socket.create_connection((HOST, port)) as sock:
        goaway = raw.frame(raw.GOAWAY, 0, 0, (1).to_bytes(4, "big") + bytes(4))
        sock.sendall(connection.data_to_send() + goaway)
        return raw.read_frames(sock, 30)


async def test_streams_a_client_s_goaway_lets_its_streams_in_flight_finish(
    tiny_chat: LoadedModel,
) -> None:
    """RFC 9113 §6.8: a client's GOAWAY says it opens no more streams; those it has opened go
    on. Its call is answered to its end (60 tokens, then trailers), and then the server closes
    the connection. Before, h2 (which sends nothing more once it has read a GOAWAY) ended the
    stream after a few messages, without trailers."""
    async with serving(tiny_chat, output_buffer_size=4) as (_, port):
        with trio.fail_after(60):
            frames = await trio.to_thread.run_sync(call_then_goaway, port)
            await wait_all_blocks_free(port)
    data = [f for f in frames if isinstance(f, DataFrame) and f.stream_id == 1]
    ends = [f for f in frames if isinstance(f, HeadersFrame) and "END_STREAM" in f.flags]
    assert len(ends) == 1, frames  # the trailers
    assert sum(len(f.data) for f in data) > 60 * 5  # every token's message


def watch_then_junk(port: int, frames: int) -> tuple[int, str]:
    """A health Watch call, then up to `frames` DATA frames of 1 KiB on its stream, as fast as
    the server's windows allow (the server no longer reads it: Watch takes one message). How
    many were sent, and the GOAWAY's error code and debug data ("" if none came)."""
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", WATCH)]
    headers += [(":authority", f"{HOST}:{port}"), ("content-type", "application/grpc")]
    connection.send_headers(1, [*headers, ("te", "trailers")])
    connection.send_data(1, b"\0\0\0\0\0")  # an empty HealthCheckRequest
    sent, goaway = 0, ""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        while sent < frames and not goaway:
            while sent < frames and min(connection.local_flow_control_window(1), 1024) == 1024:
                connection.send_data(1, b"\0" * 1024)
                sent += 1
            try:
                sock.sendall(connection.data_to_send())
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = f"{event.error_code!r} {event.additional_data!r}"
    return sent, goaway


@pytest.mark.parametrize("frames", [20_000])
async def test_streams_data_where_nothing_is_read_counts_against_the_control_frames(
    tiny_chat: LoadedModel, frames: int
) -> None:
    """DATA on a stream whose one message has been read does the server no work: it is dropped
    as it comes (never kept: before, up to its window per stream stayed in memory) and counted
    as a control frame, so a flood of it is told to calm down."""
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            sent, goaway = await trio.to_thread.run_sync(watch_then_junk, port, frames)
    print(f"junk DATA frames sent: {sent}; {goaway}")
    assert "ENHANCE_YOUR_CALM" in goaway, goaway
    assert "control_frame_burst" in goaway
    assert sent < frames
