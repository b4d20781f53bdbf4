"""The loom.v1 gRPC handlers, in the server's asyncio thread; the engine is reached by the bridge.

Each Generate call submits one request and relays its outputs: what has piled up since the last
send goes out as one Delta, the end as a Final message or a status (DESIGN.md §6). The handler
never holds the engine up: the engine pushes into the request's bounded buffer and this side
drains it. If the engine ends a request (stalled client, deadline, crash) while the handler is
blocked sending to a client that stopped reading, the send is cancelled and the stream reset
(RST_STREAM): trailers after a half-sent message would break the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import trio
from grpclib import GRPCError, Status
from grpclib.metadata import Deadline
from grpclib.server import Stream

from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.prompt import Prompt
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.engine.engine import Engine
from loom.engine.request_stream import RequestStream
from loom.server import wire
from loom.server.bridge import Count, TrioBridge
from loom.server.calls import deadline_of, recv_request
from loom.server.config import ServerConfig
from loom.server.drain import admitted, arrived
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomBase

log = logging.getLogger(__name__)

ABNORMAL_STATUS = {
    FinishReason.DEADLINE: Status.DEADLINE_EXCEEDED,
    FinishReason.STALLED: Status.RESOURCE_EXHAUSTED,
    FinishReason.ERROR: Status.UNAVAILABLE,
    FinishReason.ABORTED: Status.CANCELLED,
}
GenerateStream = Stream[pb.GenerateRequest, pb.GenerateResponse]


class ClientGoneError(Exception):
    """The client stopped reading; its stream was reset."""


@contextmanager
def status_errors() -> Iterator[None]:
    """Engine errors as gRPC statuses; anything else is a bug: INTERNAL."""
    try:
        yield
    except InvalidRequestError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from exc
    except EngineOverloadedError as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from exc
    except EngineDeadError as exc:
        raise GRPCError(Status.UNAVAILABLE, str(exc)) from exc
    except (GRPCError, ClientGoneError, asyncio.CancelledError):
        raise
    except Exception as exc:  # its message stays in the log: it may hold another client's data
        log.exception("internal error")
        raise GRPCError(
            Status.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
        ) from exc


class LoomServicer(LoomBase):
    def __init__(
        self, engine: Engine, bridge: TrioBridge, config: ServerConfig, *, send_timeout: float
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.config = config
        self.send_timeout = send_timeout  # how long a finished request waits on a slow client
        self.num_in_flight = Count()  # Generate handlers running
        self.streams_per_connection = Counter[object]()  # by the client's address and port

    async def Generate(self, stream: GenerateStream) -> None:
        deadline = deadline_of(stream)
        try:
            request = await self.receive(stream, deadline)
            if not admitted(stream):
                raise GRPCError(Status.UNAVAILABLE, "the server is draining")
            self.check_streams(stream)
        except GRPCError as exc:  # refused before the engine saw it: counted all the same
            self.engine.metrics.refused_by_server(exc.status.name)
            raise
        with self.in_flight(stream):
            await self.answer(stream, request, deadline)

    async def receive(
        self, stream: GenerateStream, deadline: Deadline | None
    ) -> pb.GenerateRequest:
        """The request message, in time: by the deadline, else within `send_timeout`."""
        patience = deadline.time_remaining() if deadline else self.send_timeout
        try:
            async with asyncio.timeout(patience):
                request = await recv_request(stream)
        except TimeoutError:
            if deadline is not None:
                raise GRPCError(
                    Status.DEADLINE_EXCEEDED, "the deadline passed before the request came"
                ) from None
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"no request message within {self.send_timeout} s"
            ) from None
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
        return request  # type: ignore[no-any-return]

    async def answer(
        self, stream: GenerateStream, request: pb.GenerateRequest, deadline: Deadline | None
    ) -> None:
        """Submit the request and relay its outputs; the request ends with the handler."""
        request_id = ""
        try:
            with status_errors():
                # The client's id is a label, echoed and logged: the engine keys by its own ids.
                request_id = wire.request_id_from(request)
                prompt = wire.prompt_from(request)
                sampling = wire.sampling_from(request.sampling)
                timeout = deadline.time_remaining() if deadline else None
                try:
                    outputs = await self.bridge.call(
                        self.submit_until,
                        prompt,
                        sampling,
                        request.cache_salt,
                        timeout,
                        orphan=RequestStream.abort,
                    )
                finally:
                    arrived(stream)  # a drain waits for this (loom/server/drain.py)
                try:
                    await self.relay(stream, outputs, request_id)
                finally:
                    outputs.abort()  # a no-op for a request that finished
        except ClientGoneError:
            log.info("request %r: client stopped reading; stream reset", request_id)

    def check_streams(self, stream: GenerateStream) -> None:
        """A connection's Generate streams are bounded: HTTP/2's MAX_CONCURRENT_STREAMS says so
        too, but a client may open streams before it hears."""
        limit = self.config.max_streams_per_connection
        if self.streams_per_connection[stream.peer.addr()] >= limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"this connection has {limit} streams open; "
                f"the limit is max_streams_per_connection={limit}",
            )

    @contextmanager
    def in_flight(self, stream: GenerateStream) -> Iterator[None]:
        """Count a Generate stream, in all and on its connection."""
        connection = stream.peer.addr()
        self.streams_per_connection[connection] += 1
        self.num_in_flight.add(1)
        try:
            yield
        finally:
            self.num_in_flight.add(-1)
            self.streams_per_connection[connection] -= 1
            if not self.streams_per_connection[connection]:
                del self.streams_per_connection[connection]

    def submit_until(
        self, prompt: Prompt, sampling: SamplingParams, cache_salt: str, timeout: float | None
    ) -> RequestStream:
        """In the trio thread: submit, the client's gRPC deadline becoming the request's."""
        deadline = None if timeout is None else trio.current_time() + timeout
        return self.engine.submit(prompt, sampling, deadline=deadline, cache_salt=cache_salt)

    async def relay(self, stream: GenerateStream, outputs: RequestStream, request_id: str) -> None:
        event = asyncio.Event()
        outputs.wake = self.bridge.waker(event)
        while True:
            batch = outputs.take()
            if not batch:
                await event.wait()
                event.clear()
            elif batch[-1].finished:
                await self.send_final(stream, outputs, event, batch, request_id)
                return
            else:
                message = pb.GenerateResponse(delta=wire.delta_from(batch))
                await self.send(stream, outputs, event, message)

    async def send_final(
        self,
        stream: GenerateStream,
        outputs: RequestStream,
        event: asyncio.Event,
        batch: Sequence[RequestOutput],
        request_id: str,
    ) -> None:
        last = batch[-1]
        if last.finish_reason in wire.FINISH_REASONS:
            final = wire.final_from(batch, request_id)
            await self.send(stream, outputs, event, pb.GenerateResponse(final=final))
            return
        if len(batch) > 1 or last.token_ids:
            message = pb.GenerateResponse(delta=wire.delta_from(batch))
            await self.send(stream, outputs, event, message)
        status = ABNORMAL_STATUS[last.finish_reason]  # type: ignore[index]
        raise GRPCError(status, last.error or str(last.finish_reason))

    async def send(
        self,
        stream: GenerateStream,
        outputs: RequestStream,
        event: asyncio.Event,
        message: pb.GenerateResponse,
    ) -> None:
        """Send one message. Once the request has ended (before or during the send), a client
        that does not take it is given up on: the send is cancelled and the stream reset
        (RST_STREAM), after `send_timeout` for a normal finish, at once for any other end."""
        sending = asyncio.ensure_future(stream.send_message(message))
        try:
            while not outputs.closed and not sending.done():
                waiter = asyncio.ensure_future(event.wait())
                await asyncio.wait({sending, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                event.clear()  # new outputs stay buffered until this send is done
            normal = outputs.finish_reason in wire.FINISH_REASONS
            done, _ = await asyncio.wait({sending}, timeout=self.send_timeout if normal else 0.0)
            if not done:
                sending.cancel()
                await stream.cancel()  # RST_STREAM
                raise ClientGoneError
            sending.result()
        finally:
            sending.cancel()

    async def GetModelInfo(self, stream: Stream[pb.GetModelInfoRequest, pb.ModelInfo]) -> None:
        await stream.recv_message()
        with status_errors():
            info = await self.bridge.call(self.engine.model_info)
        await stream.send_message(wire.model_info_message(info))

    async def GetServerStats(
        self, stream: Stream[pb.GetServerStatsRequest, pb.ServerStats]
    ) -> None:
        await stream.recv_message()
        with status_errors():
            stats = await self.bridge.call(self.engine.stats)
        await stream.send_message(wire.stats_message(stats))
