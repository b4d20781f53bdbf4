"""One Generate call from its request to its end: the relay owns the engine request it submits.

    submit (trio thread, through the bridge) ──▶ RequestStream
        call.when_ended(abort): a reset or a lost connection aborts the request at once, in the
        connection's own event, whatever the handler is doing
    relay: what has piled up since the last send goes out as one Delta; the end as a Final
        message or a status (DESIGN.md §6)
    finally: abort (a no-op for a request that finished)

The handler never holds the engine up: the engine pushes into the request's bounded buffer and
this side drains it. A message goes out at once when the connection can take it whole (the
common case: no task, no wait); otherwise it is sent in a task of its own while the relay
watches the request. If the engine ends the request (stalled client, deadline, crash) while
that send is blocked on a client that stopped reading, the send is cancelled and the stream
reset (RST_STREAM): trailers after a half-sent message would break the client; after a normal
finish the client gets `send_timeout` to take its last message first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import trio
from grpclib import GRPCError

from loom.core.fair_share import Tenancy
from loom.core.prompt import Prompt
from loom.core.request_output import RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.engine.engine import Engine
from loom.engine.request_stream import RequestStream
from loom.server import wire
from loom.server.boundary.call import Call
from loom.server.bridge import TrioBridge
from loom.server.status import ABNORMAL_STATUS, ClientGoneError, status_errors
from loom.v1 import loom_pb2 as pb

log = logging.getLogger(__name__)


Live = dict[tuple[str, str], set[RequestStream]]  # by (tenant, request_id label): for Abort


class Relay:
    def __init__(self, call: Call, engine: Engine, bridge: TrioBridge, live: Live) -> None:
        self.call = call
        self.engine = engine
        self.bridge = bridge
        self.live = live
        self.send_timeout = engine.config.stall_timeout  # a finished request's last message
        self.wake = asyncio.Event()
        self.request_id = ""  # the client's label (or one made for it), echoed in the Final

    async def run(self, request: pb.GenerateRequest) -> None:
        try:
            with status_errors():
                # The client's id is a label, echoed and logged: the engine keys by its own ids.
                self.request_id = wire.request_id_from(request)
                prompt = wire.prompt_from(request)
                sampling = wire.sampling_from(request.sampling)
                tenant = self.call.tenant
                tenancy = wire.tenancy_from(request, tenant.name, tenant.weight)
                outputs = await self.submit(prompt, sampling, request.cache_salt, tenancy)
                self.call.when_ended(outputs.abort)
                key = (tenant.name, self.request_id)
                self.live.setdefault(key, set()).add(outputs)
                try:
                    await self.relay(outputs)
                finally:
                    outputs.abort()
                    self.forget(key, outputs)
        except ClientGoneError:
            log.info("request %r: client stopped reading; stream reset", self.request_id)

    def forget(self, key: tuple[str, str], outputs: RequestStream) -> None:
        streams = self.live.get(key)  # (an Abort takes them all)
        if streams is not None:
            streams.discard(outputs)
            if not streams:
                del self.live[key]

    async def submit(
        self, prompt: Prompt, sampling: SamplingParams, cache_salt: str, tenancy: Tenancy
    ) -> RequestStream:
        deadline = self.call.deadline
        timeout = deadline.time_remaining() if deadline else None
        args = (prompt, sampling, cache_salt, tenancy, timeout)
        try:
            return await self.bridge.call(self.submit_until, *args, orphan=RequestStream.abort)
        finally:
            self.call.arrived()  # a drain waits for this (loom/server/drain.py)

    def submit_until(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        cache_salt: str,
        tenancy: Tenancy,
        timeout: float | None,
    ) -> RequestStream:
        """In the trio thread: submit, the client's gRPC deadline becoming the request's."""
        deadline = None if timeout is None else trio.current_time() + timeout
        return self.engine.submit(
            prompt, sampling, deadline=deadline, cache_salt=cache_salt, tenancy=tenancy
        )

    async def relay(self, outputs: RequestStream) -> None:
        outputs.wake = self.bridge.waker(self.wake)
        while True:
            batch = outputs.take()
            if not batch:
                await self.wake.wait()
                self.wake.clear()
            elif batch[-1].finished:
                await self.send_final(outputs, batch)
                return
            else:
                await self.send(outputs, pb.GenerateResponse(delta=wire.delta_from(batch)))

    async def send_final(self, outputs: RequestStream, batch: Sequence[RequestOutput]) -> None:
        last = batch[-1]
        if last.finish_reason in wire.FINISH_REASONS:
            final = wire.final_from(batch, self.request_id)
            await self.send(outputs, pb.GenerateResponse(final=final))
            return
        if len(batch) > 1 or last.token_ids:
            await self.send(outputs, pb.GenerateResponse(delta=wire.delta_from(batch)))
        status = ABNORMAL_STATUS[last.finish_reason]  # type: ignore[index]
        raise GRPCError(status, last.error or str(last.finish_reason))

    async def send(self, outputs: RequestStream, message: pb.GenerateResponse) -> None:
        """Send one message: at once when the connection takes it whole; else in a task, given
        up on (cancelled, the stream reset) once the request has ended and the client does not
        take it: after `send_timeout` for a normal finish, at once for any other end."""
        if self.call.send_message_nowait(message):
            return
        sending = asyncio.ensure_future(self.call.send_message(message))
        try:
            while not outputs.closed and not sending.done():
                waiter = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait({sending, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                self.wake.clear()  # new outputs stay buffered until this send is done
            normal = outputs.finish_reason in wire.FINISH_REASONS
            done, _ = await asyncio.wait({sending}, timeout=self.send_timeout if normal else 0.0)
            if not done:
                sending.cancel()
                await self.call.cancel()  # RST_STREAM
                raise ClientGoneError
            sending.result()
        finally:
            sending.cancel()
