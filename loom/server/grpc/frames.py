"""The frames and responses the HTTP/2 layer writes itself: GOAWAYs, the drain's PING, the
first SETTINGS frame as Loom advertises it, and gRPC's trailers-only responses."""

from __future__ import annotations

from collections.abc import Container

from grpclib import Status
from grpclib.metadata import encode_grpc_message
from h2.connection import H2Connection
from h2.settings import SettingCodes, Settings
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, SettingsFrame

from loom.server.boundary import BoundaryConfig

CONTENT_TYPE = "application/grpc+proto"
PROXY_WINDOW = 1 << 30  # a peer with this window reads all it is sent (nginx: 2^31-1)
DRAIN_PING_DATA = b"draining"
ALL_STREAMS = (1 << 31) - 1
GRPC_TYPES = ("application/grpc", "application/grpc+proto")
# The calls that generate (loom.v1's and vllm.grpc.engine's): refused in a drain, counted in
# flight until they end.
GENERATE_PATHS = frozenset({"/loom.v1.Loom/Generate", "/vllm.grpc.engine.VllmEngine/Generate"})
# A gateway's calls (SMG's): its client (hyper) runs its open streams on after a GOAWAY and
# opens a new connection for new ones, so a drain tells it at once, busy or not.
GATEWAY_SERVICE = "/vllm.grpc.engine.VllmEngine/"


def goaway(error_code: int, last_stream_id: int = ALL_STREAMS, why: str = "") -> bytes:
    frame = GoAwayFrame(0, error_code=error_code, additional_data=why.encode()[:1024])
    frame.last_stream_id = last_stream_id
    return bytes(frame.serialize())


def refusal_preface() -> bytes:
    """An empty SETTINGS frame: the server's preface, before the GOAWAY of a refusal."""
    return bytes(SettingsFrame(0).serialize())


def drain_ping() -> bytes:
    return bytes(PingFrame(0, opaque_data=DRAIN_PING_DATA).serialize())


def server_preface(h2: H2Connection, config: BoundaryConfig, window: int) -> bytes:
    """What the server sends first: its SETTINGS (the header list's limit, the streams' as
    `advertised` says) and a connection window of `window` bytes."""
    max_header_bytes = config.max_header_bytes
    h2.local_settings = Settings(
        client=False,
        initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: ALL_STREAMS,
            SettingCodes.MAX_HEADER_LIST_SIZE: max_header_bytes,
        },
    )
    # The decoded size is hpack's to enforce, and the settings above are current at once (no
    # ACK will apply them): so its decoder is told too.
    h2.decoder.max_header_list_size = max_header_bytes
    h2.initiate_connection()
    h2.increment_flow_control_window(window - 65535)
    return advertised(h2.data_to_send(), config.max_streams_per_connection)


def advertised(preface: bytes, max_streams: int) -> bytes:
    """The server's first SETTINGS frame saying MAX_CONCURRENT_STREAMS = `max_streams`.

    h2 enforces its own value of that setting by dropping the connection (and from the first
    frame, before a peer can have read it), where RFC 9113 §5.1.2 asks for a stream error; so
    h2 is told there is no limit, the wire carries the limit, and the connection refuses the
    streams over it one by one."""
    frame, length = Frame.parse_frame_header(memoryview(preface[:9]))
    frame.parse_body(memoryview(preface[9 : 9 + length]))
    frame.settings[SettingCodes.MAX_CONCURRENT_STREAMS] = max_streams  # type: ignore[attr-defined]
    return bytes(frame.serialize()) + preface[9 + length :]


def trailers(status: Status, message: str) -> list[tuple[str, str]]:
    """A trailers-only gRPC response."""
    return [
        (":status", "200"),
        ("content-type", CONTENT_TYPE),
        ("grpc-status", str(status.value)),
        ("grpc-message", encode_grpc_message(message)),
    ]


def stream_refusal(
    fields: dict[str, str], *, draining: bool, num_open: int, limit: int, paths: Container[str]
) -> tuple[str, list[tuple[str, str]]] | None:
    """Why a new stream is answered at once rather than served: (the limit's name for the
    metrics, or "" when no limit is at stake; the response's headers). While draining only
    Generate calls are refused: health still answers (NOT_SERVING)."""
    if draining and fields.get(":path") in GENERATE_PATHS:
        return "draining", trailers(Status.UNAVAILABLE, "the server is draining")
    if num_open >= limit:
        message = (
            f"this connection has {limit} streams open; "
            f"the limit is max_streams_per_connection={limit}"
        )
        return "max_streams_per_connection", trailers(Status.RESOURCE_EXHAUSTED, message)
    if fields.get(":method") != "POST":
        return "", [(":status", "405")]
    if fields.get("content-type") not in GRPC_TYPES:
        message = "the content-type is not application/grpc"
        return "", [(":status", "415"), *trailers(Status.UNKNOWN, message)[1:]]
    if fields.get(":path") not in paths:
        return "", trailers(Status.UNIMPLEMENTED, "Method not found")
    return None
