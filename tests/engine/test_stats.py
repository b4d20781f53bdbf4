"""The engine's figures (loom/engine/stats.py): the generation rate a gateway routes by."""

from __future__ import annotations

from loom.engine.stats import Throughput


def test_throughput_is_the_rate_between_samples_a_window_apart() -> None:
    rate = Throughput()
    assert rate.rate(100, now=10.0) == 0.0  # one sample: no rate yet
    assert rate.rate(150, now=10.5) == 0.0  # within the window: the last rate
    assert rate.rate(300, now=12.0) == 100.0  # (300 - 100) / 2 s
    assert rate.rate(320, now=12.4) == 100.0
    assert rate.rate(320, now=13.0) == 20.0  # (320 - 300) / 1 s
