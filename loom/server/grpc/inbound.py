"""What one stream has received, and how its handler reads it.

Bytes wait in `buffer` until a read takes them. A read acknowledges (gives back to the peer's
HTTP/2 windows) what it will take as it comes, so that the peer may send the rest, and takes the
same bytes from the server-wide request budget (RESOURCE_EXHAUSTED when it cannot cover them)
until the message they belong to is decoded: only bytes really received count, never a size a
client merely declares. What lies beyond a read stays unacknowledged, so a stream holds at most
its window (64 KiB) of unread data. Once nothing more will be read (its one message taken, or
the call ended), the buffer is acknowledged and dropped, and so is whatever comes after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from grpclib import GRPCError, Status
from grpclib.exceptions import StreamTerminatedError

from loom.server.traffic import OverBudgetError, RequestBudget


class Inbound:
    def __init__(
        self,
        acknowledge: Callable[[int], None],
        budget: RequestBudget,
        refused: Callable[[str], None],
        no_more_work: Callable[[], None],
    ) -> None:
        self.give_to_peer = acknowledge  # bytes back to the peer's windows for this stream
        self.budget = budget  # the server's, for the request bytes being received
        self.refused = refused  # counts a refusal by the limit that made it
        self.no_more_work = no_more_work  # the gate: more DATA on the stream does no work
        self.buffer = bytearray()
        self.num_acknowledged = 0  # of `buffer`'s first bytes, given back to the peer's windows
        self.charged = 0  # bytes of the message being read, taken from the request budget
        self.discarding = False  # nothing more is read: what comes is acknowledged and dropped
        self.ended = False  # the peer's END_STREAM
        self.gone: str | None = None  # why the call ended, once it has: reads raise
        self.readable = asyncio.Event()

    def received(self, data: bytes) -> None:
        if self.discarding:
            self.give_to_peer(len(data))
            return
        self.buffer += data
        self.readable.set()

    def end_of_input(self) -> None:
        self.ended = True
        self.readable.set()

    def call_ended(self, why: str) -> None:
        """The call is over: nothing more is read, and a read waiting raises."""
        self.gone = why
        self.discard()
        self.readable.set()

    async def read(self, size: int) -> bytes:
        """`size` bytes of the request stream; b"" at its end (INVALID_ARGUMENT when it ends
        inside them)."""
        while True:
            self.acknowledge(min(len(self.buffer), size))
            if len(self.buffer) >= size or self.ended:
                break
            self.check_open()
            self.readable.clear()
            await self.readable.wait()
        self.check_open()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.num_acknowledged -= len(data)
        if data and len(data) < size:
            raise GRPCError(Status.INVALID_ARGUMENT, "the request message is cut short")
        return data

    def check_open(self) -> None:
        if self.gone is not None:
            raise StreamTerminatedError(self.gone)

    def acknowledge(self, upto: int) -> None:
        """The first `upto` bytes of the buffer are (or will be) taken: back to the peer's
        windows, and from the request budget."""
        more = upto - self.num_acknowledged
        if more <= 0:
            return
        try:
            self.budget.take(more)
        except OverBudgetError as exc:
            self.refused("max_buffered_request_bytes")
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
        self.charged += more
        self.give_to_peer(more)
        self.num_acknowledged = upto

    def give_back(self) -> None:
        """The message read is decoded (or given up): its bytes back to the request budget."""
        self.budget.give(self.charged)
        self.charged = 0

    def discard(self) -> None:
        """Read nothing more (and more DATA on the stream counts as a control frame: it does the
        server no work, loom/server/grpc/gate.py)."""
        if not self.discarding:
            self.discarding = True
            self.no_more_work()
            unread = len(self.buffer) - self.num_acknowledged
            self.give_to_peer(unread)
            self.buffer.clear()
            self.num_acknowledged = 0
