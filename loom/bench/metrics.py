"""Serving benchmark figures: per-request timings in, a summary and a side-by-side table out.

Definitions (as in `vllm bench serve`): TTFT is send to first token; TPOT is (e2e - TTFT) / (output
tokens - 1); ITL is the gap between consecutive token arrivals (tokens arriving together count
one gap and zeros); E2E is send to last token. Throughput is output tokens over the wall time of
the whole run; goodput counts the requests per second that met every latency objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

PERCENTILES = (50, 90, 99)


@attrs.frozen(kw_only=True)
class RequestTiming:
    """One request, as its client saw it; times in seconds from its send."""

    ok: bool
    num_prompt_tokens: int
    token_times: tuple[float, ...]  # arrival of each output token
    error: str = ""

    @classmethod
    def failed(cls, prompt: tuple[int, ...], error: Exception) -> RequestTiming:
        """A request that failed: counted, not fatal to the run."""
        return cls(ok=False, num_prompt_tokens=len(prompt), token_times=(), error=repr(error))

    @property
    def ttft(self) -> float:
        return self.token_times[0]

    @property
    def e2e(self) -> float:
        return self.token_times[-1]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    ms = [v * 1000 for v in values]
    summary = {"mean": sum(ms) / len(ms) if ms else math.nan}
    summary.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return summary


@attrs.frozen(kw_only=True)
class Objectives:
    """Latency objectives for goodput, in milliseconds (None: not checked)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, timing: RequestTiming) -> bool:
        checks = [
            (self.ttft_ms, timing.ttft),
            (self.tpot_ms, timing.tpot or 0.0),
            (self.e2e_ms, timing.e2e),
        ]
        return all(limit is None or value * 1000 <= limit for limit, value in checks)


def summarize(
    timings: Sequence[RequestTiming], duration: float, objectives: Objectives
) -> dict[str, object]:
    done = [t for t in timings if t.ok and t.token_times]
    output_tokens = sum(len(t.token_times) for t in done)
    return {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / duration,
        "request_throughput": len(done) / duration,
        "goodput": sum(objectives.met(t) for t in done) / duration,
        "ttft_ms": distribution([t.ttft for t in done]),
        "tpot_ms": distribution([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": distribution([gap for t in done for gap in t.itls]),
        "e2e_ms": distribution([t.e2e for t in done]),
        "errors": sorted({t.error for t in timings if not t.ok})[:5],
    }


ROWS = [
    ("output tok/s", ("output_throughput",), True),
    ("requests/s", ("request_throughput",), True),
    ("goodput req/s", ("goodput",), True),
    *[(f"TTFT {s} ms", ("ttft_ms", s), False) for s in ("mean", "p50", "p90", "p99")],
    *[(f"TPOT {s} ms", ("tpot_ms", s), False) for s in ("mean", "p50", "p90", "p99")],
    *[(f"ITL {s} ms", ("itl_ms", s), False) for s in ("mean", "p50", "p90", "p99")],
    *[(f"E2E {s} ms", ("e2e_ms", s), False) for s in ("mean", "p50", "p90", "p99")],
]


def lookup(summary: dict[str, object], path: tuple[str, ...]) -> float:
    value: object = summary
    for key in path:
        value = value[key]  # type: ignore[index]
    return float(value)  # type: ignore[arg-type]


def table(
    title: str,
    loom: dict[str, object],
    baseline: dict[str, object] | None,
    name: str = "baseline",
) -> str:
    """A text table; with a baseline, its column (headed `name`) and Loom's ratio (higher is
    better for rates, lower for latencies: the ratio is Loom / baseline either way)."""
    header = f"{'':<16}{'loom':>12}" + (f"{name:>12}{'ratio':>9}" if baseline else "")
    lines = [title, header]
    for label, path, _ in ROWS:
        value = lookup(loom, path)
        line = f"{label:<16}{value:>12.1f}"
        if baseline is not None:
            base = lookup(baseline, path)
            ratio = value / base if base else math.nan
            line += f"{base:>12.1f}{ratio:>8.2f}x"
        lines.append(line)
    lines.append(
        f"{'completed':<16}{loom['completed']:>12}"
        + (f"{baseline['completed']:>12}" if baseline else "")
    )
    lines.append(
        f"{'failed':<16}{loom['failed']:>12}" + (f"{baseline['failed']:>12}" if baseline else "")
    )
    return "\n".join(lines)
