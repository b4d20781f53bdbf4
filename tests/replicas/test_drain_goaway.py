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
from h2.settings import SettingCodes

from loom.bench.serving import launched_process
from tests.grpc_client import HOST, greedy

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


def events(sock: socket.socket, connection: Any, seconds: float) -> list[Any]:
    """What arrives for `seconds` (or until the connection closes), acknowledging data."""
    seen: list[Any] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
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
        sock.sendall(connection.data_to_send())
    return seen


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
        # Well within the 5 s drain timeout (its end closes every connection); the streams
        # end about 1 s after the signal, well after new calls are refused (0.25 s), when the
        # connections idle then were closed.
        on_client = events(*client, 2.0)
        on_idle = events(*idle, 0.5)
        on_proxy = events(*proxy, 0.5)
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
