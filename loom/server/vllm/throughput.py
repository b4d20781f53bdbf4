"""The engine's generation rate, as a gateway's load poll reads it: tokens per second between
two polls at least `WINDOW` apart (the last rate in between; 0 before the second)."""

from __future__ import annotations

import time

WINDOW = 1.0  # seconds


class Throughput:
    def __init__(self) -> None:
        self.since: tuple[float, int] | None = None  # (when, tokens generated then)
        self.last = 0.0

    def rate(self, num_generated_tokens: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.since is None:
            self.since = (now, num_generated_tokens)
        elif now - self.since[0] >= WINDOW:
            then, before = self.since
            self.last = max(num_generated_tokens - before, 0) / (now - then)
            self.since = (now, num_generated_tokens)
        return self.last
