"""What the gRPC server does in a drain that grpclib has no word for: GOAWAYs a proxy heeds,
and the connections already waiting in the listen backlog.

Behind nginx a draining replica must never be sent a call it will refuse: nginx retries a
gRPC call on the next replica only while it has not sent it (a refused connection), never
once sent (its request body is not buffered), and it reuses a kept-alive upstream connection
unless a GOAWAY has come on it. So, while draining:
- the listening socket closes at once, after the connections the kernel already completed are
  taken (closing it would reset them, and nginx takes a reset for a failed call);
- an idle connection is sent a graceful GOAWAY (last stream id 2^31-1, RFC 9113 §6.8's first
  of two: a call already on its way is still answered);
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

from h2.connection import ConnectionState, H2Connection
from hyperframe.frame import GoAwayFrame

PROXY_WINDOW = 1 << 30


def graceful_goaway() -> bytes:
    frame = GoAwayFrame(0)
    frame.last_stream_id, frame.error_code = (1 << 31) - 1, 0
    return bytes(frame.serialize())


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
