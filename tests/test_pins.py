"""The libraries under the server's HTTP/2 layer are pinned exactly (pyproject.toml, and the
lock files), and every name of theirs that Loom relies on is checked here, with the shape it is
relied on in: an upgrade that renames or reshapes one fails this test, not a client.

Public names are checked as used (an h2 connection driven the way loom/server/grpc/ drives
it); the few private ones (grpclib's client, for a chaos client's TCP reset; torch's extension
builder, which the kernels call to build a library without loading it) are listed by name.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from pathlib import Path

import grpclib.client
import grpclib.const
import grpclib.server
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h11
import pytest
from grpclib.metadata import Deadline, decode_metadata, encode_grpc_message, encode_metadata
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple
from hyperframe.frame import Frame, GoAwayFrame, PingFrame, SettingsFrame
from torch.utils import cpp_extension

from loom.model import kernels
from loom.server.grpc.call import Call
from loom.server.grpc.frames import advertised, goaway

ROOT = Path(__file__).parent.parent
PINS = {
    "grpclib": "0.4.9",
    "h2": "4.4.1",
    "hpack": "4.2.0",
    "hyperframe": "6.1.0",
    "aiohttp": "3.14.5",
    "h11": "0.16.0",
    "llguidance": "1.9.1",
}


def test_pins_the_installed_versions_are_the_pinned_ones() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    for lock in ("requirements.lock", "requirements-dev.lock"):
        locked = (ROOT / lock).read_text()
        for name, version in PINS.items():
            assert re.search(rf"^{name}=={re.escape(version)}$", locked, re.M), (lock, name)
    for name, version in PINS.items():
        assert f'"{name}=={version}"' in pyproject, name
        assert importlib.metadata.version(name) == version, name


def test_pins_h2_takes_its_settings_and_sends_them_as_the_first_frame() -> None:
    """Loom replaces h2's local settings before `initiate_connection` (so that h2 never
    enforces MAX_CONCURRENT_STREAMS itself), then rewrites that setting in the frame sent."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    codes = h2.settings.SettingCodes
    connection.local_settings = h2.settings.Settings(
        client=False,
        initial_values={codes.MAX_CONCURRENT_STREAMS: 1 << 31, codes.MAX_HEADER_LIST_SIZE: 4096},
    )
    connection.initiate_connection()
    connection.increment_flow_control_window(1 << 20)
    preface = advertised(connection.data_to_send(), 32)
    frame, length = Frame.parse_frame_header(memoryview(preface[:9]))
    frame.parse_body(memoryview(preface[9 : 9 + length]))
    assert isinstance(frame, SettingsFrame)
    assert frame.settings[codes.MAX_CONCURRENT_STREAMS] == 32
    assert frame.settings[codes.MAX_HEADER_LIST_SIZE] == 4096
    assert connection.local_settings.max_concurrent_streams == 1 << 31


def test_pins_h2_events_carry_what_the_connection_reads() -> None:
    """A client's call through a real h2 server connection: the events and their fields."""
    client = h2.connection.H2Connection()
    client.initiate_connection()
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    client.send_headers(
        1, [(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")]
    )
    client.send_data(1, b"hello", end_stream=True)
    client.ping(b"12345678")
    events = server.receive_data(client.data_to_send())
    kinds = {type(e): e for e in events}
    request = kinds[h2.events.RequestReceived]
    assert request.stream_id == 1
    assert request.stream_ended is None  # END_STREAM came with the DATA
    assert (b":path", b"/x") in request.headers
    data = kinds[h2.events.DataReceived]
    assert (data.stream_id, data.data, data.flow_controlled_length) == (1, b"hello", 5)
    assert kinds[h2.events.StreamEnded].stream_id == 1
    assert h2.events.PingReceived in kinds
    server.acknowledge_received_data(5, 1)
    assert server.local_flow_control_window(1) > 0
    assert server.max_outbound_frame_size == 16384
    assert server.remote_settings.initial_window_size == 65535
    assert server.highest_inbound_stream_id == 1
    client.reset_stream(1)
    (reset,) = server.receive_data(client.data_to_send())
    assert (type(reset), reset.error_code, reset.remote_reset) == (h2.events.StreamReset, 0, True)
    ack = PingFrame(0, opaque_data=b"draining", flags=["ACK"]).serialize()
    (answer,) = server.receive_data(bytes(ack))
    assert isinstance(answer, h2.events.PingAckReceived)
    assert answer.ping_data == b"draining"
    client.increment_flow_control_window(100)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    client.close_connection(error_code=0)
    events = server.receive_data(client.data_to_send())
    window, settings, goaway_event = events
    assert (window.stream_id, window.delta) == (0, 100)
    assert h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in settings.changed_settings
    assert isinstance(goaway_event, h2.events.ConnectionTerminated)
    assert goaway_event.error_code == 0


def test_pins_hyperframe_and_hpack_build_the_frames_written_by_hand() -> None:
    frame = GoAwayFrame(0, error_code=11, additional_data=b"why")
    frame.last_stream_id = 7
    assert goaway(11, 7, "why") == bytes(frame.serialize())
    block = Encoder().encode([NeverIndexedHeaderTuple(":path", "/x")])
    assert Decoder().decode(block) == [(":path", "/x")]  # the same bytes, any number of times
    assert Decoder().decode(block) == [(":path", "/x")]


def test_pins_grpclib_s_servable_contract_and_helpers() -> None:
    assert grpclib.const.Handler._fields == ("func", "cardinality", "request_type", "reply_type")
    assert grpclib.const.Cardinality.UNARY_STREAM.server_streaming
    deadline = Deadline.from_headers([("grpc-timeout", "5S")])
    assert deadline is not None
    assert 4 < deadline.time_remaining() <= 5
    try:
        Deadline.from_headers([("grpc-timeout", "banana")])
    except ValueError:
        pass
    else:
        raise AssertionError("a malformed grpc-timeout must raise ValueError")
    assert decode_metadata([("x-key", "v"), (":path", "/x"), ("te", "trailers")]) == {"x-key": "v"}
    assert encode_metadata({"x-key": "v"}) == [("x-key", "v")]
    assert encode_grpc_message("100% sure") == "100%25 sure"


def test_pins_a_call_offers_grpclib_s_server_stream_api() -> None:
    """The handlers (grpclib's health and reflection, the generated loom.v1 base) are written
    against grpclib's server Stream: a Call has each of its public methods, taking what it
    takes."""
    public = ["recv_message", "send_initial_metadata", "send_message", "send_trailing_metadata"]
    for name in [*public, "cancel", "__aiter__", "__anext__"]:
        theirs = inspect.signature(getattr(grpclib.server.Stream, name)).parameters
        ours = inspect.signature(getattr(Call, name)).parameters
        assert list(theirs) == list(ours), name
    for attribute in ("deadline", "metadata", "peer", "user_agent"):
        assert attribute in inspect.getsource(Call.__init__), attribute


def test_pins_the_private_names_of_grpclib_s_client_loom_relies_on() -> None:
    """loom/chaos/clients.py `reset`: the socket under a channel, for an abortive close."""
    source = inspect.getsource(grpclib.client.Channel)
    assert "self._protocol" in source
    assert "self.connection" in inspect.getsource(grpclib.protocol.H2Protocol)
    assert "self._transport = transport" in inspect.getsource(grpclib.protocol.Connection)


def test_pins_torch_s_extension_builder_takes_what_the_kernels_pass() -> None:
    """loom/model/kernels `build`: torch's private builder, called as `cpp_extension.load`
    calls it, with every argument it requires."""
    for chosen in kernels.ISAS:
        path = kernels.library_path(chosen)
        inspect.signature(kernels.builder()).bind(**kernels.builder_arguments(chosen, path))
    assert "_write_ninja_file_and_build_library(" in inspect.getsource(cpp_extension._jit_compile)


def test_pins_h2_s_decoder_takes_the_decoded_header_limit_loom_sets() -> None:
    """The settings Loom gives h2 are current at once, so no ACK applies MAX_HEADER_LIST_SIZE
    to hpack's decoder: Loom sets the decoder's limit itself, and h2 refuses past it."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.decoder.max_header_list_size = 1024
    server.initiate_connection()
    client = h2.connection.H2Connection()
    client.initiate_connection()
    headers = [(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")]
    client.send_headers(1, [*headers, ("x-big", "y" * 2000)])
    try:
        server.receive_data(client.data_to_send())
    except h2.exceptions.DenialOfServiceError:
        return
    raise AssertionError("a header list past the decoder's limit must be refused")


def test_pins_h11_bounds_a_head_holds_a_pipelined_request_and_sees_expect() -> None:
    """loom/server/openai/connection.py: a head over `max_incomplete_event_size` is a protocol
    error hinting 431; the next request waits (PAUSED) until `start_next_cycle`, its bytes in
    `trailing_data`; a client waiting for `100 Continue` is seen."""
    server = h11.Connection(h11.SERVER, max_incomplete_event_size=64)
    server.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: " + b"x" * 80)
    with pytest.raises(h11.RemoteProtocolError) as error:
        server.next_event()
    assert error.value.error_status_hint == 431

    server = h11.Connection(h11.SERVER)
    server.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(server.next_event(), h11.Request)
    assert isinstance(server.next_event(), h11.EndOfMessage)
    assert server.next_event() is h11.PAUSED
    assert server.trailing_data[0].startswith(b"GET /b")
    server.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    server.send(h11.EndOfMessage())
    server.start_next_cycle()
    assert isinstance(server.next_event(), h11.Request)

    server = h11.Connection(h11.SERVER)
    server.receive_data(
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    )
    assert isinstance(server.next_event(), h11.Request)
    assert server.they_are_waiting_for_100_continue
