"""The loom.v1 gRPC handlers, in the server's asyncio thread: thin. Each Generate call reads its
request (its size, timing and framing checked by the call itself, loom/server/grpc/call.py)
and hands it to a `Relay`, which owns the engine request from submit to end; the other two
methods ask the engine through the bridge. Every call but a health probe has a tenant
(loom/server/tenants.py): its Generate calls are its own to abort, and its stats show the
server's gauges and its own figures only (every tenant's, to an admin).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpclib import GRPCError, Status
from grpclib.server import Stream

from loom.core.request_output import RequestOutput
from loom.engine.engine import Engine
from loom.server.bridge import TrioBridge
from loom.server.grpc import wire
from loom.server.grpc.call import Call
from loom.server.grpc.status import ABNORMAL_STATUS, status_errors
from loom.server.relay import EngineRequest, Live, Relay, abort_labels
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomBase

MAX_ABORT_IDS = 1024


def call_of(stream: Any) -> Call:
    """The endpoint hands every handler a Call (grpclib's Stream API, and the call's end)."""
    if not isinstance(stream, Call):
        raise TypeError(f"served by Loom's endpoint only, not with a {type(stream).__name__}")
    return stream


async def generate_request(call: Call, engine: Engine) -> Any:
    """A Generate call's one request message; one refused before the engine saw it (too
    large, too slow, none) is counted all the same."""
    try:
        request = await call.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
    except GRPCError as exc:
        call.arrived()
        engine.metrics.refused_by_server(exc.status.name)
        raise
    return request


async def abort_labelled(stream: Stream[Any, Any], live: Live) -> int:
    """An Abort call's: abort the caller's requests with the labels it names (never another
    tenant's; an unknown label is no error), how many were running."""
    tenant = call_of(stream).tenant
    request = await stream.recv_message()
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
    if len(request.request_ids) > MAX_ABORT_IDS:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"request_ids: {len(request.request_ids)} ids, more than {MAX_ABORT_IDS}",
        )
    return abort_labels(live, tenant.name, request.request_ids)


class GrpcFraming:
    """A Generate stream's messages (loom/server/relay.py `Framing`): Deltas, then a Final
    that echoes the client's `request_id`, or a status."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> pb.GenerateResponse:
        return pb.GenerateResponse(delta=wire.delta_from(batch))

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> Any:
        return pb.GenerateResponse(final=wire.final_from(batch, self.request_id))

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        last = batch[-1]
        partial = self.delta(index, batch) if len(batch) > 1 or last.token_ids else None
        status = ABNORMAL_STATUS[last.finish_reason]  # type: ignore[index]
        return partial, GRPCError(status, last.error or str(last.finish_reason))


class LoomServicer(LoomBase):
    def __init__(self, engine: Engine, bridge: TrioBridge) -> None:
        self.engine = engine
        self.bridge = bridge
        self.live: Live = {}

    async def Generate(self, stream: Stream[pb.GenerateRequest, pb.GenerateResponse]) -> None:
        call = call_of(stream)
        request = await generate_request(call, self.engine)
        with status_errors():
            request_id = wire.request_id_from(request)
            tenant = call.tenant
            submission = EngineRequest(
                prompt=wire.prompt_from(request),
                sampling=wire.sampling_from(request.sampling),
                cache_salt=request.cache_salt,
                tenancy=wire.tenancy_from(
                    request, tenant.name, tenant.weight, f"grpc {call.peer.addr()}"
                ),
            )
            relay = Relay(call, GrpcFraming(request_id), self.engine, self.bridge, self.live)
            timeout = call.deadline.time_remaining() if call.deadline else None
            await relay.run(request_id, [submission], timeout)

    async def GetModelInfo(self, stream: Stream[pb.GetModelInfoRequest, pb.ModelInfo]) -> None:
        await stream.recv_message()
        with status_errors():
            info = await self.bridge.call(self.engine.model_info)
        await stream.send_message(wire.model_info_message(info))

    async def GetServerStats(
        self, stream: Stream[pb.GetServerStatsRequest, pb.ServerStats]
    ) -> None:
        tenant = call_of(stream).tenant
        await stream.recv_message()
        viewer = None if tenant.admin else tenant.name
        with status_errors():
            stats = await self.bridge.call(self.engine.stats, viewer)
        await stream.send_message(wire.stats_message(stats))

    async def Abort(self, stream: Stream[pb.AbortRequest, pb.AbortResponse]) -> None:
        num_aborted = await abort_labelled(stream, self.live)
        await stream.send_message(pb.AbortResponse(num_aborted=num_aborted))
