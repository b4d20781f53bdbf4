"""An HTTP/1.1 connection's way out: its writes, the wait while the client reads too slowly,
and the deadlines that keep a client that stops reading from holding the connection.

HTTP/1.1 has no window: the write buffers are the flow control. A `send` waits while they are
over `write_buffer_bytes` (the kernel's send buffer is capped as well, by the front); a
connection whose buffers stay full for `write_timeout` is aborted (as the gRPC side's is),
whatever it was doing; a `close` flushes what is buffered, but aborts after `seconds` all
the same, so that no closing connection outlives a client that never reads.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from loom.server.boundary import BoundaryConfig


class Outbound:
    def __init__(
        self, transport: asyncio.Transport, config: BoundaryConfig, stuck: Callable[[], None]
    ) -> None:
        self.transport = transport
        self.write_timeout = config.write_timeout
        transport.set_write_buffer_limits(high=config.write_buffer_bytes)  # and SO_SNDBUF
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a token goes at once
        self.stuck = stuck  # the client took nothing for write_timeout: counted, then aborted
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.stalled: asyncio.TimerHandle | None = None  # the write timeout, while paused
        self.deadline: asyncio.TimerHandle | None = None  # a close's abort

    async def send(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        self.transport.write(data)
        if not self.can_write.is_set():
            await self.can_write.wait()
            if self.transport.is_closing():
                raise ConnectionError("the connection is closed")

    def writable(self) -> bool:
        """Whether a write goes out without waiting."""
        return not self.transport.is_closing() and self.can_write.is_set()

    def paused(self) -> None:
        self.can_write.clear()
        if self.stalled is None:
            loop = asyncio.get_running_loop()
            self.stalled = loop.call_later(self.write_timeout, self.took_nothing)

    def resumed(self) -> None:
        self.can_write.set()
        if self.stalled is not None:
            self.stalled.cancel()
            self.stalled = None

    def took_nothing(self) -> None:
        self.stuck()
        self.transport.abort()

    def close(self, seconds: float) -> None:
        """Close once what is buffered is written, or abort after `seconds`."""
        if not self.transport.is_closing():
            self.transport.close()
            loop = asyncio.get_running_loop()
            self.deadline = loop.call_later(seconds, self.transport.abort)

    def abort(self) -> None:
        self.transport.abort()

    def lost(self) -> None:
        self.can_write.set()  # a send waiting wakes, and finds the connection closed
        for timer in (self.stalled, self.deadline):
            if timer is not None:
                timer.cancel()
