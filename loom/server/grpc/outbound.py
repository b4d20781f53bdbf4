"""A connection's sending half: what its calls write, under HTTP/2 flow control and the
peer's backpressure, and the frames the connection writes past h2.

A send waits for the connection to be writable (asyncio pauses it once `write_buffer_bytes`
are unsent: the peer is not taking them) and for the stream's window; a call whose stream
ended meanwhile raises StreamTerminatedError, and nothing is ever written to a transport whose
connection is lost. `can_send` and `write_data` are the path without waiting, for the common
case where the connection can take a message whole at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from grpclib.exceptions import StreamTerminatedError
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError

if TYPE_CHECKING:
    from loom.server.grpc.call import Call


class Outbound:
    def __init__(
        self,
        h2: H2Connection,
        write: Callable[[bytes], None],
        closing: Callable[[], str | None],
        sent: Callable[[int], None],
    ) -> None:
        self.h2 = h2
        self.write = write  # to the transport, unless the connection is lost
        self.closing = closing  # why the connection is closing; None while it is open
        self.frames_sent = sent  # the gate counts frames of work sent
        self.writable = asyncio.Event()
        self.writable.set()
        self.paused_since: float | None = None  # not writable since then

    def paused(self, now: float) -> None:
        """The transport asks for no more writes (the peer is not taking them)."""
        self.writable.clear()
        self.paused_since = now

    def resumed(self) -> None:
        self.writable.set()
        self.paused_since = None

    async def send_headers(
        self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False
    ) -> None:
        await self.until_writable(call)
        self.write_headers(call, headers, end_stream)
        if end_stream:
            if not call.inbound.ended:
                self.stop_input(call.stream_id)
            # In a drain, the connection's GOAWAY may follow in the same write.
            call.release("done")
        self.sent(1)

    async def send_data(self, call: Call, data: bytes) -> None:
        view, offset = memoryview(data), 0
        while offset < len(data):
            await self.until_writable(call)
            window = self.h2.local_flow_control_window(call.stream_id)
            if window <= 0:
                call.window_open.clear()
                await call.window_open.wait()
                continue
            size = min(window, self.h2.max_outbound_frame_size, len(data) - offset)
            self.write_data(call, view[offset : offset + size].tobytes())
            offset += size

    def can_send(self, call: Call, size: int) -> bool:
        """Whether `size` bytes of DATA go out on `call`'s stream now, in one frame."""
        return (
            call.ended is None
            and self.closing() is None
            and self.writable.is_set()
            and size <= self.h2.max_outbound_frame_size
            and size <= self.h2.local_flow_control_window(call.stream_id)
        )

    def write_headers(
        self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False
    ) -> None:
        """Headers, now (the caller has waited for the connection to be writable)."""
        with self.stream_open(call):
            self.h2.send_headers(call.stream_id, headers, end_stream=end_stream)

    def write_data(self, call: Call, data: bytes) -> None:
        """One DATA frame, now (the caller has checked the window and the connection)."""
        with self.stream_open(call):
            self.h2.send_data(call.stream_id, data)
        self.sent(1)

    @contextlib.contextmanager
    def stream_open(self, call: Call) -> Iterator[None]:
        """h2 refusing to write on a stream it has closed (by a reset it read in the same
        read, say): the call ends, its sender sees StreamTerminatedError."""
        try:
            yield
        except ProtocolError:  # StreamClosedError, StreamIDTooLowError: h2 has closed it
            call.release("the stream closed")
            raise StreamTerminatedError("the stream closed") from None

    async def until_writable(self, call: Call) -> None:
        while True:
            call.check_open()
            closing = self.closing()
            if closing is not None:
                raise StreamTerminatedError(closing)
            if self.writable.is_set():
                return
            await self.writable.wait()

    def reset(self, call: Call) -> None:
        if call.ended is None and self.closing() is None:
            with contextlib.suppress(ProtocolError):  # closed already: nothing to reset
                self.h2.reset_stream(call.stream_id, ErrorCodes.CANCEL)
            self.flush()
        call.release("reset by the server")

    def acknowledge(self, stream_id: int, size: int) -> None:
        if size and self.closing() is None:
            self.h2.acknowledge_received_data(size, stream_id)
            self.flush()

    def sent(self, num_frames: int) -> None:
        self.flush()
        self.frames_sent(num_frames)

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.write(data)

    def write_frames(self, frames: bytes) -> None:
        """Frames written past h2 (whose state stays as it was), after what h2 has queued, in
        the same write."""
        self.write(self.h2.data_to_send() + frames)

    def stop_input(self, stream_id: int) -> None:
        """RST_STREAM(NO_ERROR) after a whole response: the client need send nothing more
        (RFC 9113 §8.1). Its END_STREAM may have been read already (later in the same read)."""
        with contextlib.suppress(ProtocolError):  # StreamClosedError, or forgotten already
            self.h2.reset_stream(stream_id, ErrorCodes.NO_ERROR)
