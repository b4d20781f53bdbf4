"""The GOAWAYs of a drain, seen on the wire by plain HTTP/2 clients (h2, no gRPC library) of a
`loom serve --model sim` process (loom/server/drain.py): an idle connection is told to go away
at once; a busy one right after its last stream ends when its peer advertised a proxy's window
(nginx's 2^31-1), and not at all when it advertised a small one (as grpclib's client does,
which drops unread messages on a GOAWAY). Each GOAWAY lets every stream through (2^31-1)."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import h2.connection
import h2.events
import hpack
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame

from loom.bench.serving import launched_process
from loom.client.frames import split_frames
from loom.v1 import loom_pb2 as pb
from tests.support.grpc_client import HOST, greedy, token_ids

SIM = ["--model", "sim:step_ms=20", "--drain-timeout", "5"]
ALL_STREAMS = (1 << 31) - 1


def connect(port: int, window: int | None = None) -> tuple[socket.socket, Any]:
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    if window is not None:
        connection.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window})
    sock = socket.create_connection((HOST, port), timeout=10)
    sock.sendall(connection.data_to_send())
    return sock, connection


def call(sock: socket.socket, connection: Any, port: int) -> None:
    body = greedy([1, 2], 60).SerializeToString()  # 1.2 s of 20 ms steps
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"{HOST}:{port}")]
    headers += [(":path", "/loom.v1.Loom/Generate"), ("content-type", "application/grpc")]
    connection.send_headers(1, [*headers, ("te", "trailers")])
    connection.send_data(1, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    sock.sendall(connection.data_to_send())


def events(
    sock: socket.socket, connection: Any, seconds: float, until: type | None = None
) -> list[Any]:
    """What arrives for `seconds` (or until the connection closes, or an event of type `until`
    has come), acknowledging data and answering PINGs."""
    seen: list[Any] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if until is not None and any(isinstance(event, until) for event in seen):
            break
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        for event in connection.receive_data(data):
            seen.append(event)
            if isinstance(event, h2.events.DataReceived):
                connection.acknowledge_received_data(event.flow_controlled_length, 1)
            if isinstance(event, h2.events.PingReceived) and closed(connection):
                sock.sendall(answer(event.ping_data))  # h2 drops its own when a GOAWAY follows
        sock.sendall(connection.data_to_send())
    return seen


def closed(connection: Any) -> bool:
    return bool(connection.state_machine.state is h2.connection.ConnectionState.CLOSED)


def answer(ping_data: bytes) -> bytes:
    return bytes(PingFrame(0, opaque_data=ping_data, flags=["ACK"]).serialize())


def frames(sock: socket.socket, seconds: float) -> list[Frame]:
    """The frames that arrive for `seconds` (or until stream 1 ends), read without h2 (which
    takes any frame after a GOAWAY for an error), PINGs answered."""
    seen: list[Frame] = []
    buffer, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            complete, buffer = split_frames(buffer + sock.recv(65536))
        except TimeoutError:
            break
        for frame in complete:
            seen.append(frame)
            if isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                sock.sendall(answer(frame.opaque_data))
            if frame.stream_id == 1 and "END_STREAM" in frame.flags:
                return seen
    return seen


def until_goaway_waits(sock: socket.socket) -> None:
    """Until a GOAWAY has arrived, left unread: the drain has begun."""
    sock.settimeout(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        waiting, _ = split_frames(sock.recv(65536, socket.MSG_PEEK))
        if any(isinstance(frame, GoAwayFrame) for frame in waiting):
            return
        time.sleep(0.01)
    raise AssertionError("no GOAWAY 10 s after SIGTERM")


def kinds(seen: list[Any]) -> list[str]:
    interesting = (h2.events.StreamEnded, h2.events.ConnectionTerminated)
    return [type(e).__name__ for e in seen if isinstance(e, interesting)]


def test_drain_tells_idle_and_proxy_connections_to_go_away_and_spares_the_others() -> None:
    with launched_process(SIM) as (port, process):
        idle = connect(port)
        proxy = connect(port, window=ALL_STREAMS)
        client = connect(port)
        for sock, connection in (proxy, client):
            call(sock, connection, port)
        for connection in (idle, proxy, client):
            events(*connection, 0.05)  # settings; the calls' first tokens
        process.send_signal(signal.SIGTERM)
        # Before the 5 s drain timeout (its end closes every connection): the idle connection
        # answers the drain's PING at once, so new calls are refused 0.25 s after the signal,
        # and it is closed; the streams end about 1 s after the signal (later on a loaded
        # machine: each read waits for what it expects, not for a fixed time).
        on_idle = events(*idle, 4.5)  # ends when the connection closes
        on_client = events(*client, 4.5, until=h2.events.StreamEnded)
        on_proxy = events(*proxy, 4.5, until=h2.events.ConnectionTerminated)
        on_client += events(*client, 0.3)  # nothing more: the proxy's GOAWAY came meanwhile
        for sock, _ in (idle, proxy, client):
            sock.close()
        assert process.wait(timeout=10) == 0

    # RFC 9113 §6.8's two: all streams let through at once; once new calls are refused, the
    # last stream it took (none), and the connection closes.
    goaways = [e for e in on_idle if isinstance(e, h2.events.ConnectionTerminated)]
    assert [(g.last_stream_id, g.error_code) for g in goaways] == [(ALL_STREAMS, 0), (0, 0)]
    assert kinds(on_proxy) == ["StreamEnded", "ConnectionTerminated"]
    ended = next(i for i, e in enumerate(on_proxy) if isinstance(e, h2.events.StreamEnded))
    assert isinstance(on_proxy[ended + 1], h2.events.ConnectionTerminated)  # right after its end
    assert on_proxy[ended + 1].last_stream_id == ALL_STREAMS
    assert kinds(on_client) == ["StreamEnded"]  # no GOAWAY: its unread messages are safe


def test_drain_serves_a_call_sent_before_the_peer_heard_however_late_it_comes() -> None:
    """A peer that sends a call on an idle connection before it has read the drain's PING
    and GOAWAY (as nginx may, on a kept-alive connection) has it served, even when it comes
    after the 0.25 s grace (a loaded machine, a slow peer): new calls are refused only once
    the peer has answered the PING, and frames keep their order."""
    with launched_process([*SIM[:-1], "30"]) as (port, process):  # a drain timeout of 30 s
        sock, connection = connect(port)
        events(sock, connection, 0.05)  # settings
        process.send_signal(signal.SIGTERM)
        until_goaway_waits(sock)
        time.sleep(0.5)  # the PING and GOAWAY wait, unread, past the grace
        call(sock, connection, port)
        seen = frames(sock, 25.0)  # until the stream ends: 1.2 s on an idle machine
        sock.close()
        assert process.wait(timeout=10) == 0

    on_call = [f for f in seen if f.stream_id == 1]
    assert len(token_ids(messages(on_call))) == 60  # served, not refused (UNAVAILABLE)
    assert ("grpc-status", "0") in headers(on_call)
    ping = next(i for i, f in enumerate(seen) if isinstance(f, PingFrame))
    assert isinstance(seen[ping + 1], GoAwayFrame)  # in one write, the PING first
    assert seen[ping + 1].last_stream_id == ALL_STREAMS


def messages(on_stream: list[Frame]) -> list[pb.GenerateResponse]:
    data = b"".join(bytes(f.data) for f in on_stream if isinstance(f, DataFrame))
    found = []
    while data:
        size = int.from_bytes(data[1:5], "big")
        found.append(pb.GenerateResponse.FromString(data[5 : 5 + size]))
        data = data[5 + size :]
    return found


def headers(on_stream: list[Frame]) -> list[tuple[str, str]]:
    decoder = hpack.Decoder()  # every header block of the connection, in order: stream 1's
    blocks = [f.data for f in on_stream if isinstance(f, HeadersFrame)]
    return [(str(n), str(v)) for block in blocks for n, v in decoder.decode(block, raw=False)]
