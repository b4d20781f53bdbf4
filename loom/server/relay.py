"""One client request from its submission to its end, for either front: the relay owns the
engine requests it submits (one, or `n` for an HTTP request asking for several choices).

    submit (trio thread, through the bridge, every choice at once: one refused, none runs)
        ──▶ a RequestStream for each choice
        sink.when_ended(abort): a reset or a lost connection aborts every choice at once, in
        the connection's own event, whatever the handler is doing
    relay: what has piled up since the last send goes out as one message, framed by the
        front (`Framing`: a gRPC Delta, an SSE chunk; nothing yet for a whole HTTP response);
        a normal end as the front's last message; any other end aborts every choice and comes
        out as the front's error (a gRPC status, an HTTP error)
    finally: abort (a no-op for a request that finished)

The handler never holds the engine up: the engine pushes into each request's bounded buffer
and this side drains it. A message goes out at once when the connection can take it whole (the
common case: no task, no wait); otherwise it is sent in a task of its own while the relay
watches the requests. If the engine ends a request (stalled client, deadline, crash) while that
send is blocked on a client that stopped reading, the send is cancelled and the stream reset
(gRPC: RST_STREAM; HTTP: the connection closed): trailers after a half-sent message would break
the client; after a normal finish the client gets `send_timeout` to take its last message first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import trio

from loom.core.prompt import Prompt
from loom.core.request_output import NORMAL_FINISHES, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy
from loom.engine.engine import Engine
from loom.engine.request_stream import RequestStream
from loom.server.bridge import TrioBridge
from loom.server.ending import ClientGoneError

log = logging.getLogger(__name__)


Live = dict[tuple[str, str], set[RequestStream]]  # by (tenant, request_id label): for Abort


def aborted(streams: Iterable[RequestStream]) -> None:
    """Abort requests submitted for a call that will not relay them."""
    for stream in streams:
        stream.abort()


def abort_labels(live: Live, tenant: str, request_ids: Iterable[str]) -> int:
    """Abort the tenant's requests labelled `request_ids` (never another tenant's; an unknown
    or finished label is no error): how many were still running."""
    num_aborted = 0
    for request_id in set(request_ids):
        for outputs in live.pop((tenant, request_id), set()):
            num_aborted += not outputs.closed
            outputs.abort()
    return num_aborted


@attrs.frozen(kw_only=True)
class EngineRequest:
    """One engine request a client's request makes."""

    prompt: Prompt
    sampling: SamplingParams
    cache_salt: str = ""
    tenancy: Tenancy

    def choices(self, n: int) -> list[EngineRequest]:
        """`n` choices of this request. With a seed, choice i samples with seed + i: n
        different sequences, each reproducible (as vLLM's parallel sampling)."""
        seed = self.sampling.seed
        return [
            self
            if seed is None or i == 0
            else attrs.evolve(
                self, sampling=attrs.evolve(self.sampling, seed=(seed + i) % (1 << 63))
            )
            for i in range(n)
        ]


class Sink(Protocol):
    """Where a relay sends: a gRPC call (loom/server/grpc/call.py) or an HTTP exchange
    (loom/server/openai/exchange.py)."""

    def when_ended(self, callback: Callable[[], object]) -> None: ...
    def arrived(self) -> None: ...
    async def try_send(self, message: Any) -> bool: ...  # at once, or False (nothing sent)
    async def send_message(self, message: Any) -> None: ...
    async def cancel(self) -> None: ...


class Framing(Protocol):
    """How a front frames the outputs of choice `index`: a message, a tuple of messages to
    send in order, or None (nothing to send yet)."""

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> Any: ...
    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> Any: ...
    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]: ...


class Relay:
    def __init__(
        self, sink: Sink, framing: Framing, engine: Engine, bridge: TrioBridge, live: Live
    ) -> None:
        self.sink = sink
        self.framing = framing
        self.engine = engine
        self.bridge = bridge
        self.live = live
        self.send_timeout = engine.config.stall_timeout  # a finished request's last message
        self.wake = asyncio.Event()
        self.streams: list[RequestStream] = []

    async def run(
        self, request_id: str, submissions: Sequence[EngineRequest], time_left: float | None
    ) -> None:
        """Submit every choice (`time_left`: seconds to the client's deadline), relay
        their outputs, end them all. `request_id` is the client's label: the engine keys by
        its own ids."""
        tenant = submissions[0].tenancy.tenant
        key = (tenant, request_id)
        try:
            try:
                self.streams = await self.bridge.call(
                    self.submit_all, submissions, time_left, orphan=aborted
                )
            finally:
                self.sink.arrived()  # a drain waits for this (loom/server/drain.py)
            for outputs in self.streams:
                self.sink.when_ended(outputs.abort)
            self.live.setdefault(key, set()).update(self.streams)
            await self.relay()
        except ClientGoneError:
            log.info("request %r: client stopped reading; stream reset", request_id)
        finally:
            for outputs in self.streams:
                outputs.abort()
            self.forget(key)

    def forget(self, key: tuple[str, str]) -> None:
        streams = self.live.get(key)  # (an Abort takes them all)
        if streams is not None:
            streams.difference_update(self.streams)
            if not streams:
                del self.live[key]

    def submit_all(
        self, submissions: Sequence[EngineRequest], time_left: float | None
    ) -> list[RequestStream]:
        """In the trio thread, in one go: submit every choice, the client's deadline becoming
        theirs; one refused, those submitted before it are aborted."""
        deadline = None if time_left is None else trio.current_time() + time_left
        streams: list[RequestStream] = []
        try:
            for submission in submissions:
                stream = self.engine.submit(
                    submission.prompt,
                    submission.sampling,
                    deadline=deadline,
                    cache_salt=submission.cache_salt,
                    tenancy=submission.tenancy,
                )
                streams.append(stream)
        except BaseException:
            aborted(streams)
            raise
        return streams

    async def relay(self) -> None:
        wake = self.bridge.waker(self.wake)
        for outputs in self.streams:
            outputs.wake = wake
        pending = list(range(len(self.streams)))
        while pending:
            took = False
            for index in list(pending):
                batch = self.streams[index].take()
                if not batch:
                    continue
                took = True
                if not batch[-1].finished:
                    await self.send(self.framing.delta(index, batch))
                elif batch[-1].finish_reason in NORMAL_FINISHES:
                    pending.remove(index)
                    await self.send(self.framing.final(index, batch, done=not pending))
                else:
                    message, error = self.framing.abnormal(index, batch)
                    await self.send(message)
                    raise error
            if not took:
                await self.wake.wait()
                self.wake.clear()

    def over(self) -> bool:
        """Every choice has ended, or one has ended abnormally (the rest are aborted)."""
        return all(s.closed for s in self.streams) or not self.normal()

    def normal(self) -> bool:
        return all(not s.closed or s.finish_reason in NORMAL_FINISHES for s in self.streams)

    async def send(self, message: Any) -> None:
        """Send what the framing made: a message, several in a tuple, or None (nothing)."""
        for one in message if isinstance(message, tuple) else (message,):
            await self.send_one(one)

    async def send_one(self, message: Any) -> None:
        """Send one message: at once when the connection takes it whole; else in a task, given
        up on (cancelled, the stream reset) once the request has ended and the client does not
        take it: after `send_timeout` for a normal finish, at once for any other end."""
        if message is None or await self.sink.try_send(message):
            return
        sending = asyncio.ensure_future(self.sink.send_message(message))
        try:
            while not self.over() and not sending.done():
                waiter = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait({sending, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                self.wake.clear()  # new outputs stay buffered until this send is done
            timeout = self.send_timeout if self.normal() else 0.0
            done, _ = await asyncio.wait({sending}, timeout=timeout)
            if not done:
                sending.cancel()
                await self.sink.cancel()  # RST_STREAM, or the connection closed
                raise ClientGoneError
            sending.result()
        finally:
            sending.cancel()
