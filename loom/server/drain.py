"""What the gRPC server does in a drain that grpclib has no word for: GOAWAYs a proxy heeds,
the connections already waiting in the listen backlog, and the calls sent before their
clients heard.

Behind nginx a draining replica must never be sent a call it will refuse: nginx retries a
gRPC call on the next replica only while it has not sent it (a refused connection), never
once sent (its request body is not buffered), and it reuses a kept-alive upstream connection
unless a GOAWAY has come on it. So, while draining:
- the listening socket closes at once, after the connections the kernel already completed are
  taken (closing it would reset them, and nginx takes a reset for a failed call);
- an idle connection is sent a graceful GOAWAY (last stream id 2^31-1, RFC 9113 §6.8's first
  of two: a call already on its way is still answered), with a PING just before it in the
  same write. A peer answers the PING as it reads it, the GOAWAY right behind, so the answer
  comes after every call it sent before it heard (frames keep their order), and new calls
  are refused only once each peer told has answered or closed, however late a loaded
  machine reads them. grpc-go's drain sends its PING after the GOAWAY; h2, under grpclib's
  client, takes any frame after a GOAWAY for a protocol error, hence before (a peer that
  reads the two frames apart and opens a stream between them may see it refused). h2 drops
  its answer when the GOAWAY follows, but grpclib's client closes the connection: heard too;
- a call admitted (its stream opened before new calls were refused) is served whenever its
  handler runs; the engine stops taking requests once every admitted Generate call has
  reached it (at most `HEARD_WAIT` later: a request message may be slow to come);
- a connection that carries streams gets the same GOAWAY right after the end of its last one,
  in the same write, when its peer takes whatever arrives (a receive window of `PROXY_WINDOW`
  or more: nginx's is 2^31-1). grpclib's own client, with its smaller window, is left alone:
  it drops the messages it has not read yet when a GOAWAY comes.
Both GOAWAYs are written past h2, whose state stays open.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from typing import Any

from grpclib.server import Stream
from h2.connection import ConnectionState, H2Connection
from h2.events import PingAckReceived
from hyperframe.frame import GoAwayFrame, PingFrame

from loom.server.bridge import Count

PROXY_WINDOW = 1 << 30
DRAIN_PING_DATA = b"draining"
GENERATE_PATH = "/loom.v1.Loom/Generate"


def graceful_goaway() -> bytes:
    frame = GoAwayFrame(0)
    frame.last_stream_id, frame.error_code = (1 << 31) - 1, 0
    return bytes(frame.serialize())


def drain_ping() -> bytes:
    """The PING that goes before an idle connection's GOAWAY: its answer says the peer
    heard."""
    return bytes(PingFrame(0, opaque_data=DRAIN_PING_DATA).serialize())


class DrainingTransport(asyncio.Transport):
    """The transport grpclib writes to (it calls these four methods): while `draining()`, a
    graceful GOAWAY follows the write that ends the connection's last open stream, for a peer
    with a window of `PROXY_WINDOW` or more."""

    def __init__(
        self,
        inner: asyncio.Transport,
        connection: Callable[[], H2Connection],
        draining: Callable[[], bool],
    ) -> None:
        super().__init__()
        self.inner = inner
        self.connection = connection
        self.draining = draining
        self.had_stream = False  # while draining: a stream was open at the last write

    def write(self, data: Any) -> None:
        after = self.after_write()  # nothing, and no copy, outside a drain: every token passes
        self.inner.write(bytes(data) + after if after else data)

    def after_write(self) -> bytes:
        if not self.draining():
            return b""
        connection = self.connection()
        if connection.state_machine.state is ConnectionState.CLOSED:
            return b""  # closed by h2's own GOAWAY (the drain's end)
        if connection.open_inbound_streams:
            self.had_stream = True
            return b""
        if not self.had_stream:
            return b""
        self.had_stream = False
        if connection.remote_settings.initial_window_size < PROXY_WINDOW:
            return b""
        return graceful_goaway()

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def close(self) -> None:
        self.inner.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.inner.get_extra_info(name, default)


def pending_connections(listener: Any) -> Iterator[socket.socket]:
    """The connections waiting in a listening socket's backlog, accepted."""
    with socket.fromfd(listener.fileno(), listener.family, listener.type) as sock:
        sock.setblocking(False)
        while True:
            try:
                accepted, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            yield accepted


def hear_ping_answers(processor: Any, heard: Callable[[], None]) -> None:
    """Call `heard` when the answer to the drain's PING comes (`processor`: grpclib's events
    processor of a connection; grpclib's own keepalive PINGs, and stray answers, are not it)."""
    handle = processor.processors[PingAckReceived]

    def on_answer(event: PingAckReceived) -> None:
        handle(event)
        if event.ping_data == DRAIN_PING_DATA:
            heard()

    processor.processors[PingAckReceived] = on_answer


def admit(
    stream: Any, path: str, handler: asyncio.Task[Any], refusing: bool, arriving: Count
) -> None:
    """A call's stream (grpclib's, as it opens) is admitted unless new calls are refused,
    whenever its handler runs (late, on a loaded machine). A Generate call is counted in
    `arriving` until its handler has handed it to the engine (`arrived`) or ended (other calls
    never reach the engine: a health Watch may last for ever)."""
    stream.loom_admitted = not refusing
    if stream.loom_admitted and path == GENERATE_PATH:
        stream.loom_arriving = arriving
        arriving.add(1)
        handler.add_done_callback(lambda _: reached(stream))


def admitted(stream: Stream[Any, Any]) -> bool:
    """Whether a call is served: its stream opened before new calls were refused."""
    return bool(getattr(stream._stream, "loom_admitted", True))


def arrived(stream: Stream[Any, Any]) -> None:
    """The call has been handed to the engine (or refused by it)."""
    reached(stream._stream)


def reached(inner: Any) -> None:
    count: Count | None = getattr(inner, "loom_arriving", None)
    if count is not None:
        inner.loom_arriving = None
        count.add(-1)
