"""The streams of one connection: each opened stream is either answered at once (draining, over
the streams limit, not a gRPC call, a malformed grpc-timeout: no handler runs) or served by a
Call and its handler task (`Dispatch.admitted`, the endpoint's); fed its data; ended by the
peer's reset; released once. The count of open calls is what `max_streams_per_connection`
bounds, kept here, on the connection, not keyed by the peer's address.

A stream that the peer opens and resets in one read never has its handler run: the task,
cancelled before its first step, is dropped, and the stream is released here, not by it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import h2.events
from grpclib import Status
from grpclib.metadata import Deadline, decode_metadata
from h2.connection import H2Connection
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes

from loom.server.boundary import BoundaryConfig
from loom.server.grpc.call import Call, Link, Peer
from loom.server.grpc.frames import stream_refusal, trailers
from loom.server.grpc.gate import FrameGate
from loom.server.grpc.inbound import Inbound
from loom.server.grpc.outbound import Outbound
from loom.server.traffic import Traffic


@attrs.frozen
class Dispatch:
    """What the endpoint gives each of its connections: the limits, the server's traffic
    ledger, the methods served (by path), how a refusal is counted, and where a call admitted
    goes (`admitted`: counted, and its handler's task begun)."""

    limits: BoundaryConfig
    traffic: Traffic
    mapping: dict[str, Any]
    refused: Callable[[str], None]
    admitted: Callable[[Call], None]


class Streams:
    def __init__(
        self,
        dispatch: Dispatch,
        h2_connection: H2Connection,
        gate: FrameGate,
        out: Outbound,
        peer: Peer,
        busy: Callable[[], None],
        done: Callable[[], None],
    ) -> None:
        self.dispatch = dispatch
        self.h2 = h2_connection
        self.gate = gate
        self.out = out
        self.link = Link(out, dispatch.limits, dispatch.refused, self.release, peer)
        self.busy = busy  # a stream opened: the connection is not idle
        self.done = done  # a stream is over on the connection
        self.calls: dict[int, Call] = {}

    def open(self, event: h2.events.RequestReceived) -> None:
        dispatch = self.dispatch
        stream_id = event.stream_id
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
        self.busy()
        fields = dict(headers)
        ended = event.stream_ended is not None
        refusal = stream_refusal(
            fields,
            draining=dispatch.traffic.refusing,
            num_open=len(self.calls),
            limit=dispatch.limits.max_streams_per_connection,
            paths=dispatch.mapping,
        )
        if refusal is not None:
            cause, response = refusal
            if cause:
                dispatch.refused(cause)
            self.answer(stream_id, response, ended)
            self.gate.did_no_work(stream_id)  # may raise LimitError: refused en masse
            return
        try:
            deadline, metadata = parsed(headers)
        except ValueError as exc:  # what a client sent, not a fault of the server's
            self.answer(stream_id, trailers(Status.INVALID_ARGUMENT, str(exc)), ended)
            self.gate.did_no_work(stream_id)
            return
        path = fields[":path"]
        inbound = Inbound(
            partial(self.out.acknowledge, stream_id),
            dispatch.traffic.budget,
            dispatch.refused,
            partial(self.gate.closed, stream_id),
        )
        method = dispatch.mapping[path]
        call = Call(self.link, stream_id, path, method, headers, deadline, metadata, inbound)
        self.calls[stream_id] = call
        dispatch.admitted(call)

    def handle(self, event: Any) -> None:
        """An event of h2's about the streams."""
        if isinstance(event, h2.events.RequestReceived):
            self.open(event)
        elif isinstance(event, h2.events.DataReceived):
            self.data(event)
        elif isinstance(event, h2.events.StreamEnded):
            self.ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.reset(event)
        elif isinstance(event, h2.events.WindowUpdated):
            self.window_updated(event.stream_id)
        elif (
            isinstance(event, h2.events.RemoteSettingsChanged)
            and SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings
        ):
            self.window_updated(0)

    def answer(self, stream_id: int, headers: list[tuple[str, str]], input_ended: bool) -> None:
        """A response made of headers alone, at once (none if the peer has reset the stream
        meanwhile, later in the same read)."""
        self.gate.closed(stream_id)
        try:
            self.h2.send_headers(stream_id, headers, end_stream=True)
            if not input_ended:
                self.out.stop_input(stream_id)
        except ProtocolError:  # closed (and maybe forgotten: StreamIDTooLowError) by h2
            pass
        finally:
            self.done()

    def data(self, event: h2.events.DataReceived) -> None:
        h2_connection = self.h2
        call = self.calls.get(event.stream_id)
        if call is None:  # answered, or ended: its data is dropped
            h2_connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        padding = event.flow_controlled_length - len(event.data)
        if padding:
            h2_connection.acknowledge_received_data(padding, event.stream_id)
        call.inbound.received(event.data)

    def ended(self, stream_id: int) -> None:
        call = self.calls.get(stream_id)
        if call is not None:
            call.inbound.end_of_input()

    def reset(self, event: h2.events.StreamReset) -> None:
        call = self.calls.pop(event.stream_id, None)
        if call is not None:
            call.end(f"the client reset the stream (error code {event.error_code})")
            self.done()

    def window_updated(self, stream_id: int) -> None:
        if stream_id:
            call = self.calls.get(stream_id)
            if call is not None:
                call.window_open.set()
        else:
            for call in self.calls.values():
                call.window_open.set()

    def release(self, call: Call, why: str) -> None:
        """The call is over on this connection (its handler may still be finishing)."""
        if self.calls.pop(call.stream_id, None) is not None:
            self.gate.closed(call.stream_id)
            self.done()
        call.end(why)

    def end_all(self, why: str) -> None:
        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            call.end(why)


TIMEOUT = re.compile(r"[0-9]{1,8}[HMSmun]")  # gRPC's spec: at most 8 digits and a unit


def parsed(headers: list[tuple[str, str]]) -> tuple[Deadline | None, Any]:
    """A call's deadline and metadata, from its headers; ValueError names what is malformed."""
    timeout = dict(headers).get("grpc-timeout")
    if timeout is not None and not TIMEOUT.fullmatch(timeout):
        raise ValueError("the grpc-timeout header is malformed")
    try:
        metadata = decode_metadata(headers)
    except ValueError as exc:  # a -bin value that is not base64, or not ASCII
        raise ValueError(f"the request metadata is malformed: {exc}") from None
    return Deadline.from_headers(headers), metadata
