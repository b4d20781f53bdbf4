"""The HTTP port's boundary, tried as a hostile client would, with raw sockets against a real
server (`--model sim`-like, in process): heads bounded in bytes, lines and time on every request
of a connection; a foreign `Host` refused; CORS only for the origins named; pipelined requests
answered in order.

Loopback only, port 0, a timeout on every I/O.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import trio

from loom.model.sim import SimRunner, load_sim
from loom.server.boundary import BoundaryConfig
from loom.server.openai.config import HttpConfig
from tests.support.http_client import HOST, post, read_all
from tests.support.server_harness import serving, until

HTTP = HttpConfig(http_port=0)
SIM = "sim:step_ms=1,seq_ms=0,token_ms=0"
BODY = json.dumps({"prompt": [3, 4, 5], "max_tokens": 2}).encode()


def request(
    path: bytes = b"/v1/completions", host: bytes = b"localhost", extra: bytes = b""
) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (path, host, extra, len(BODY), BODY)
    )


def closed_at(sock: socket.socket, seconds: float) -> float | None:
    """When (time.monotonic) the server had closed `sock`; None: still open `seconds` on."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic()


async def test_http_connection_a_head_is_bounded_in_bytes_and_in_lines() -> None:
    """A 1.9 MiB head of lines each under the limit, and 101 short header lines: 431, never
    served (before: a per-line limit only, 128 lines, and the 1.9 MiB head was served)."""
    boundary = BoundaryConfig(max_header_bytes=16 << 10)
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        _,
    ):
        port = server.http_port or 0
        with trio.fail_after(30):
            lines = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 15_000) for i in range(127))
            many = b"".join(b"X-N-%d: 1\r\n" % i for i in range(101))
            replies = []
            for extra in (lines, many):
                sock = socket.create_connection((HOST, port))
                await trio.to_thread.run_sync(sock.sendall, request(extra=extra))
                replies.append(await trio.to_thread.run_sync(read_all, sock))
                sock.close()
            served = await post(port, "/v1/completions", json.loads(BODY))
    assert len(lines) > 1.8 * 2**20
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert b'"choices"' not in reply
    assert served[0] == 200


def second_heads_held(port: int, count: int) -> list[tuple[bytes, float | None]]:
    """`count` connections each served a request, then sent the start of a second head and
    no more: each one's first answer, and the seconds until the server closed it."""
    socks = [socket.create_connection((HOST, port)) for _ in range(count)]
    try:
        answers, sent = [], []
        for sock in socks:
            sock.sendall(request())
            sock.settimeout(10)
            answers.append(sock.recv(65536))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # no more
            sent.append(time.monotonic())
        closed = [closed_at(sock, 8) for sock in socks]
        return [
            (answer, None if at is None else at - start)
            for answer, at, start in zip(answers, closed, sent, strict=True)
        ]
    finally:
        for sock in socks:
            sock.close()


async def test_http_connection_every_request_s_head_is_due_within_the_header_timeout() -> None:
    """A keep-alive connection whose second request's head never ends is closed at the header
    timeout, as its first would be (before: only the first head was timed; the second held
    until the 300 s idle timeout)."""
    boundary = BoundaryConfig(header_timeout=1.0, idle_timeout=60)
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        _,
    ):
        port = server.http_port or 0
        with trio.fail_after(30):
            results = await trio.to_thread.run_sync(second_heads_held, port, 4)
    answers = [answer for answer, _ in results]
    waits = [wait for _, wait in results]
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    assert all(w is not None and 0.5 <= w <= 4 for w in waits), waits


async def test_http_connection_a_foreign_host_is_refused_and_cors_is_only_for_named_origins() -> (
    None
):
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 sends `Host: its.name`; the
    default front (on loopback) refuses it, and serves localhost names and addresses. No CORS
    header answers a page's Origin unless --allowed-origins names it; then its preflight is
    answered."""
    http = HttpConfig(http_port=0, allowed_origins=("https://app.example",))
    async with serving(load_sim(SIM), make_runner=SimRunner, http=http) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(30):
            answers = {}
            for host in (b"rebound.attacker.example", b"localhost:%d" % port, b"127.0.0.1"):
                sock = socket.create_connection((HOST, port))
                sock.sendall(request(host=host, extra=b"Connection: close\r\n"))
                answers[host] = await trio.to_thread.run_sync(read_all, sock)
                sock.close()
            foreign = await post(
                port, "/v1/models", None, {"Origin": "https://evil.example"}, "GET"
            )
            named = await post(port, "/v1/models", None, {"Origin": "https://app.example"}, "GET")
            preflight = await post(
                port,
                "/v1/chat/completions",
                None,
                {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
                "OPTIONS",
            )
            evil_preflight = await post(
                port, "/v1/chat/completions", None, {"Origin": "https://evil.example"}, "OPTIONS"
            )
    refused, *served = answers.values()
    assert refused.startswith(b"HTTP/1.1 400"), refused[:200]
    assert b"host_not_allowed" in refused
    assert b"--allowed-hosts" in refused
    assert all(s.startswith(b"HTTP/1.1 200") for s in served), served
    assert foreign[0] == 200
    assert not any(k.lower().startswith("access-control") for k in foreign[1])
    assert named[1].get("Access-Control-Allow-Origin") == "https://app.example"
    assert preflight[0] == 204
    assert "Content-Length" not in preflight[1]  # none on a 204 (RFC 9110 8.6)
    assert "POST" in preflight[1]["Access-Control-Allow-Methods"]
    assert evil_preflight[0] == 405
    assert not any(k.lower().startswith("access-control") for k in evil_preflight[1])


async def test_http_connection_pipelined_requests_are_answered_in_order() -> None:
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(30):
            sock = socket.create_connection((HOST, port))
            sock.sendall(
                request(path=b"/version")
                + b"GET /v1/nothing HTTP/1.1\r\nHost: localhost\r\n\r\n"
                + request(extra=b"Connection: close\r\n")
            )
            reply = await trio.to_thread.run_sync(read_all, sock)
            sock.close()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)
    assert statuses == [b"405", b"404", b"200"], reply


def conversation(port: int, data: bytes, then: bytes = b"", seconds: float = 10) -> bytes:
    """Send `data`, then (0.1 s on) `then`; what comes back until the server closes."""
    sock = socket.create_connection((HOST, port))
    try:
        sock.sendall(data)
        if then:
            time.sleep(0.1)
            sock.sendall(then)
        return read_all(sock, seconds)
    finally:
        sock.close()


async def test_http_connection_framing_the_client_gets_wrong_or_odd_is_answered_right() -> None:
    """Both Content-Length and Transfer-Encoding (smuggling): 400, closed. A byte after a
    request that said it was the last: dropped, the request still answered. HEAD: a head and
    no body, the connection serving on. A blank line before a request, alone or pipelined
    after the one before: let pass (RFC 9112).
    Found by a hostile review of the first h11 version, each a failure there."""
    smuggled = (
        b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    head = b"HEAD /version HTTP/1.1\r\nHost: localhost\r\n\r\n"
    get = b"\r\nGET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(30):
            two = await trio.to_thread.run_sync(conversation, port, smuggled)
            last = await trio.to_thread.run_sync(
                conversation, port, request(extra=b"Connection: close\r\n"), b"\r\nX"
            )
            heads = await trio.to_thread.run_sync(conversation, port, head, get)
            pipelined = await trio.to_thread.run_sync(conversation, port, head + get)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", two) == [b"400"], two
    assert b"Content-Length and Transfer-Encoding" in two
    assert last.startswith(b"HTTP/1.1 200"), last
    assert b'"choices"' in last
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", heads) == [b"405", b"200"], heads
    assert heads.count(b"{") == 1  # the 405 to HEAD has no body; the GET's is whole
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", pipelined) == [b"405", b"200"], pipelined


async def test_http_connection_a_client_that_reads_nothing_is_cut_off_at_the_write_timeout() -> (
    None
):
    """Pipelined GETs from a client that never reads fill the write buffers: the connection is
    aborted `write_timeout` later and its place is given back (before: held for as long as the
    client stayed, outside any timeout, and a close never finished)."""
    boundary = BoundaryConfig(write_timeout=1.0, write_buffer_bytes=16 << 10)
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        _,
    ):
        port = server.http_port or 0
        caps = server.io.traffic.caps
        with trio.fail_after(30):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((HOST, port))
            sock.settimeout(2)
            start = time.monotonic()
            with contextlib.suppress(TimeoutError):  # the server stops reading, its turn to wait
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n" * 2000)
            await until(lambda: caps.num_connections == 1, 10)
            await until(lambda: caps.num_connections == 0, 10)
            seconds = time.monotonic() - start
            sock.close()
    assert caps.num_connections == 0
    assert 0.5 <= seconds <= 6, seconds
