"""The frame gate alone, socket-free: bytes in, what h2 is to parse out, each limit raised as
the frame that breaks it arrives (loom/server/grpc/gate.py). A clock of the test's own."""

from __future__ import annotations

import attrs
import pytest

from loom.client import frames as raw
from loom.client.frames import frame
from loom.server.grpc.gate import FrameGate, GateLimits, LimitError

LIMITS = GateLimits(
    max_header_bytes=100, min_streams_judged=10, control_frame_burst=5, control_frames_per_second=1
)
MANY_CONTROL_FRAMES = attrs.evolve(LIMITS, control_frame_burst=1000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def opened(limits: GateLimits = LIMITS) -> tuple[FrameGate, Clock]:
    clock = Clock()
    gate = FrameGate(limits, clock=clock)
    gate.scan(raw.PREFACE + frame(raw.SETTINGS, 0, 0))
    return gate, clock


def test_gate_the_preface_is_done_once_its_settings_frame_is_whole() -> None:
    gate = FrameGate(LIMITS, clock=Clock())
    settings = frame(raw.SETTINGS, 0, 0, bytes(6))
    assert (
        gate.scan(raw.PREFACE + settings[:12]) == raw.PREFACE + settings[:12]
    )  # passed as it comes
    assert not gate.preface_done
    assert gate.scan(settings[12:]) == settings[12:]
    assert gate.preface_done


def test_gate_a_frame_header_split_between_reads_is_held_back() -> None:
    gate, _ = opened()
    ping = frame(raw.PING, 0, 0, bytes(8))
    assert gate.scan(ping[:5]) == b""
    assert gate.scan(ping[5:]) == ping


def test_gate_a_peer_s_goaway_is_cut_out_and_noted() -> None:
    gate, _ = opened()
    goaway = frame(raw.GOAWAY, 0, 0, bytes(8))
    ping = frame(raw.PING, 0, 0, bytes(8))
    assert gate.scan(goaway + ping) == ping
    assert gate.goaway_received


def test_gate_an_unfinished_header_block_is_timed_from_its_first_frame() -> None:
    gate, clock = opened()
    clock.now = 3.0
    gate.scan(frame(raw.HEADERS, 0, 1, bytes(10)))  # no raw.END_HEADERS
    clock.now = 5.0
    gate.scan(frame(raw.CONTINUATION, 0, 1, bytes(10)))
    assert gate.unfinished_since == 3.0
    gate.scan(frame(raw.CONTINUATION, raw.END_HEADERS, 1, bytes(10)))
    assert gate.unfinished_since is None


def test_gate_a_header_block_over_the_limit_stops_at_its_frame() -> None:
    gate, _ = opened()
    first = frame(raw.HEADERS, 0, 1, bytes(60))
    with pytest.raises(LimitError) as refused:
        gate.scan(first + frame(raw.CONTINUATION, raw.END_HEADERS, 1, bytes(60)))
    assert refused.value.cause == "max_header_bytes"
    assert refused.value.passed == first  # h2 still gets what came before
    assert "max_header_bytes=100" in refused.value.message


def test_gate_control_frames_past_the_burst_are_told_to_calm_down_and_refill_with_time() -> None:
    gate, clock = opened()
    ping = frame(raw.PING, 0, 0, bytes(8))
    gate.scan(ping * 4)  # raw.SETTINGS took one of 5
    with pytest.raises(LimitError) as refused:
        gate.scan(ping)
    assert refused.value.cause == "control_frame_burst"
    gate, clock = opened()
    gate.scan(ping * 4)
    clock.now = 2.0  # two more, at one a second
    gate.scan(ping * 2)


def test_gate_work_sent_refills_the_control_frame_bucket() -> None:
    gate, _ = opened()
    ping = frame(raw.PING, 0, 0, bytes(8))
    gate.scan(ping * 4)
    gate.sent(1)
    gate.scan(ping)


def test_gate_streams_reset_as_soon_as_opened_are_judged_a_rapid_reset() -> None:
    gate, _ = opened(MANY_CONTROL_FRAMES)
    pairs = b"".join(
        frame(raw.HEADERS, raw.END_HEADERS | raw.END_STREAM, stream_id, bytes(5))
        + frame(raw.RST_STREAM, 0, stream_id, bytes(4))
        for stream_id in range(1, 40, 2)
    )
    with pytest.raises(LimitError) as refused:
        gate.scan(pairs)
    assert refused.value.cause == "reset_streams_judged"
    assert gate.num_streams == 10  # judged at the first chance


def test_gate_streams_reset_after_they_worked_are_not_held_against_the_peer() -> None:
    gate, clock = opened(MANY_CONTROL_FRAMES)
    for stream_id in range(1, 40, 2):
        gate.scan(frame(raw.HEADERS, raw.END_HEADERS, stream_id, bytes(5)))
        clock.now += 2.0  # older than PREMATURE when reset
        gate.scan(frame(raw.RST_STREAM, 0, stream_id, bytes(4)))
    assert gate.num_idle_streams == 0
