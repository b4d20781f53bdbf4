"""vllm.grpc.engine.VllmEngine on Loom's gRPC port: the worker protocol of the SMG gateway
(vLLM's `vllm serve --grpc` speaks it too), beside loom.v1.Loom on the same connections, limits,
tenants, relay and drain. Thin, as the loom.v1 servicer is: each Generate call's request is
read by the call itself (its size, timing and framing checked, loom/server/grpc/call.py) and
handed to a `Relay`, one engine request per choice; the rest ask the engine through the bridge.

What a gateway calls, in order: HealthCheck (which runtime is this?), GetModelInfo and
GetServerInfo (its labels), GetTokenizer (it tokenizes and templates chats itself), then
HealthCheck and GetLoads on its timers, Generate with token ids, and Abort for each request
whose client went away (after it finished too: an unknown label is no error). Every call but
a health probe has a tenant, as on loom.v1: Abort reaches the caller's own requests only, and
the loads show the caller's own prefix-cache figures.

Embed serves an embedding model's vectors; FlushCache and the profiler answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from grpclib import GRPCError, Status
from grpclib.health.check import ServiceStatus
from grpclib.server import Stream

from loom.core.kv_events import KvEventLog
from loom.core.pooling import Pooling
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy
from loom.engine.engine import Engine
from loom.server.bridge import TrioBridge
from loom.server.grpc.call import Call
from loom.server.grpc.servicer import abort_labelled, call_of, generate_request
from loom.server.grpc.status import status_errors
from loom.server.grpc.wire import request_id_from
from loom.server.load import load_now, timestamp, version
from loom.server.relay import EngineRequest, Live, Relay
from loom.server.traffic import DrainPhase
from loom.server.vllm import wire
from loom.server.vllm.config import VllmConfig
from loom.server.vllm.framing import EmbedFraming, VllmFraming
from loom.server.vllm.kv_feed import KvFeed, Subscriptions
from loom.server.vllm.tokenizer_bundle import TokenizerBundle
from loom.smg import common_pb2 as common
from loom.smg import vllm_engine_pb2 as pb
from loom.smg.vllm_engine_grpc import VllmEngineBase

UNIMPLEMENTED = "not served by Loom"
MAX_SEQUENCE = 1 << 63


def tenancy_of(call: Call) -> Tenancy:
    tenant = call.tenant
    return Tenancy(tenant=tenant.name, weight=tenant.weight, connection=f"grpc {call.peer.addr()}")


class VllmServicer(VllmEngineBase):
    def __init__(
        self,
        engine: Engine,
        bridge: TrioBridge,
        live: Live,
        health: ServiceStatus,
        *,
        served_model_name: str | None,
        max_choices: int,
        config: VllmConfig,
    ) -> None:
        self.engine = engine
        self.bridge = bridge
        self.live = live  # the labels' requests, shared with loom.v1 and the HTTP API
        self.health = health
        self.served_model_name = served_model_name
        self.max_choices = max_choices
        self.started = time.monotonic()
        self.bundle = TokenizerBundle()
        self.subscriptions = Subscriptions(config)
        self.closing = asyncio.Event()  # the drain refuses new calls: the feeds end
        self.wakes: set[asyncio.Event] = set()  # the feeds'

    async def Generate(self, stream: Stream[pb.GenerateRequest, pb.GenerateResponse]) -> None:
        call = call_of(stream)
        request = await generate_request(call, self.engine)
        with status_errors():
            request_id = request_id_from(request)
            prompt = wire.prompt_from(request)
            sampling = wire.sampling_from(request.sampling_params)
            n = wire.num_choices(request.sampling_params, self.max_choices)
            tenancy = tenancy_of(call)
            submission = EngineRequest(prompt=prompt, sampling=sampling, tenancy=tenancy)
            num_prompt_tokens = 0 if isinstance(prompt, str) else len(prompt)
            framing = VllmFraming(
                stream=request.stream, num_choices=n, num_prompt_tokens=num_prompt_tokens
            )
            relay = Relay(call, framing, self.engine, self.bridge, self.live)
            timeout = call.deadline.time_remaining() if call.deadline else None
            await relay.run(request_id, submission.choices(n), timeout)

    async def Abort(self, stream: Stream[pb.AbortRequest, pb.AbortResponse]) -> None:
        await abort_labelled(stream, self.live)
        await stream.send_message(pb.AbortResponse())

    async def HealthCheck(
        self, stream: Stream[pb.HealthCheckRequest, pb.HealthCheckResponse]
    ) -> None:
        """Healthy while the server takes new requests (as grpc.health.v1 says SERVING)."""
        await stream.recv_message()
        healthy = self.health.__status__() is True
        message = "serving" if healthy else self.engine.refusal()
        await stream.send_message(pb.HealthCheckResponse(healthy=healthy, message=message))

    async def GetModelInfo(
        self, stream: Stream[pb.GetModelInfoRequest, pb.GetModelInfoResponse]
    ) -> None:
        await stream.recv_message()
        with status_errors():
            info = await self.bridge.call(self.engine.model_info)
        reply = wire.model_info_message(info, self.served_model_name)
        await stream.send_message(reply)

    async def GetServerInfo(
        self, stream: Stream[pb.GetServerInfoRequest, pb.GetServerInfoResponse]
    ) -> None:
        tenant = call_of(stream).tenant
        await stream.recv_message()
        with status_errors():
            info = await self.bridge.call(self.engine.model_info)
            stats = await self.bridge.call(self.engine.stats, None if tenant.admin else tenant.name)
        uptime = time.monotonic() - self.started
        await stream.send_message(wire.server_info_message(info, stats, uptime))

    async def GetLoads(self, stream: Stream[pb.GetLoadsRequest, pb.GetLoadsResponse]) -> None:
        tenant = call_of(stream).tenant
        await stream.recv_message()
        with status_errors():
            load = await self.load(None if tenant.admin else tenant.name)
        reply = pb.GetLoadsResponse(
            timestamp=timestamp(), version=version(), dp_rank_count=1, loads=[load]
        )
        await stream.send_message(reply)

    async def GetTokenizer(
        self, stream: Stream[common.GetTokenizerRequest, common.GetTokenizerChunk]
    ) -> None:
        await stream.recv_message()
        core = self.engine.core
        folder = core.loaded.tokenizer_folder if core is not None else None
        if folder is None:
            why = "the model is loading" if core is None else "no tokenizer files to send"
            raise GRPCError(Status.FAILED_PRECONDITION, f"GetTokenizer: {why}")
        try:
            bundle = await self.bundle.get(folder)
        except OSError as exc:
            raise GRPCError(Status.FAILED_PRECONDITION, f"GetTokenizer: {exc}") from None
        chunks = bundle.chunks()
        for i, data in enumerate(chunks):
            digest = bundle.sha256 if i == len(chunks) - 1 else ""
            await stream.send_message(common.GetTokenizerChunk(data=data, sha256=digest))

    async def SubscribeKvEvents(
        self, stream: Stream[common.SubscribeKvEventsRequest, common.KvEventBatch]
    ) -> None:
        """The prefix cache's events, the caller's own (loom/server/vllm/kv_feed.py)."""
        tenant = call_of(stream).tenant
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
        start = request.start_sequence_number
        if start >= MAX_SEQUENCE:
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"start_sequence_number must be below {MAX_SEQUENCE}"
            )
        viewer = None if tenant.admin else tenant.name
        with status_errors():
            log = await self.bridge.call(self.engine.kv_events)
        with self.subscriptions.held(tenant.name, tenant.admin, time.monotonic()):
            await self.feed(stream, log, viewer, start)

    async def feed(self, stream: Any, log: KvEventLog, viewer: str | None, start: int) -> None:
        wake = asyncio.Event()
        waker = self.bridge.waker(wake)
        feed = KvFeed(
            log,
            viewer,
            start,
            stream.send_message,
            self.bridge.call,
            partial(self.load, viewer),
        )
        self.bridge.soon(log.listeners.add, waker)  # in order: the discard comes after it
        self.wakes.add(wake)
        try:
            with status_errors():
                await feed.run(wake, self.closing.is_set)
        finally:
            self.wakes.discard(wake)
            self.bridge.soon(log.listeners.discard, waker)

    # The drain (a front of the traffic ledger, loom/server/traffic.py)

    def enter(self, phase: DrainPhase) -> None:
        """Once new calls are refused, the KV event streams end: a gateway's connection then
        has nothing left open, and can close."""
        if phase in (DrainPhase.REFUSING, DrainPhase.CLOSED):
            self.closing.set()
            for wake in self.wakes:
                wake.set()

    async def close(self) -> None:
        self.enter(DrainPhase.CLOSED)

    async def load(self, viewer: str | None) -> pb.SchedulerLoad:
        """The engine's load now, as `viewer` may see it (None: an admin)."""
        load, _ = await load_now(self.engine, self.bridge, viewer)
        return wire.scheduler_load(load)

    async def Embed(self, stream: Stream[pb.EmbedRequest, pb.EmbedResponse]) -> None:
        """An embedding model's vector for one prompt (as /v1/embeddings gives it), pooled and
        normalised the model's way; refused by a generating model, as vLLM's is."""
        call = call_of(stream)
        request = await generate_request(call, self.engine)
        with status_errors():
            request_id = request_id_from(request)
            prompt = wire.embed_prompt(request)
            tenancy = tenancy_of(call)
            sampling = SamplingParams(pooling=Pooling())
            submission = EngineRequest(prompt=prompt, sampling=sampling, tenancy=tenancy)
            relay = Relay(call, EmbedFraming(), self.engine, self.bridge, self.live)
            timeout = call.deadline.time_remaining() if call.deadline else None
            await relay.run(request_id, [submission], timeout)

    async def FlushCache(
        self, stream: Stream[common.FlushCacheRequest, common.FlushCacheResponse]
    ) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, UNIMPLEMENTED)

    async def StartProfile(
        self, stream: Stream[common.StartProfileRequest, common.ProfileResponse]
    ) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, UNIMPLEMENTED)

    async def StopProfile(
        self, stream: Stream[common.StopProfileRequest, common.ProfileResponse]
    ) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, UNIMPLEMENTED)
