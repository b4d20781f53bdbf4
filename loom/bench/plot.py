"""`loom bench --plot FILE.svg`: output tok/s, TTFT p50 and TPOT p50 against concurrency, three
panels side by side, a line for Loom and for every baseline the run measured (the HTTP API
beside gRPC, transformers, each llama.cpp file, the caching-off server), the machine and the
workload named on the figure. SVG written by hand (no plotting library): a figure any browser
or Markdown page shows, small enough to commit beside BENCHMARKS.md.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

PANELS = (  # title, the figure's key and statistic, its unit
    ("output tok/s", ("output_throughput", None), "tok/s"),
    ("TTFT p50", ("ttft_ms", "p50"), "ms"),
    ("TPOT p50", ("tpot_ms", "p50"), "ms"),
)
COLOURS = ("#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#57606a", "#bf3989")
WIDTH, HEIGHT, PANEL, TOP, LEFT = 960, 380, 300, 70, 60
PLOT_W, PLOT_H = 220, 230


def machine() -> str:
    """The CPU as /proc/cpuinfo names it (model name, family, model), and its cores."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    name = fields.get("model name", platform.machine())
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{name} (family {family}, model {model}), {os.cpu_count()} cores"


def series_of(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any] | None]]:
    """Each server's figures at each concurrency (None where a level lacks it)."""
    names: dict[str, list[dict[str, Any] | None]] = {}
    labels = {"loom": "Loom", "openai": "Loom, HTTP API", "baseline": "transformers"}
    labels["caching_off"] = "Loom, prefix caching off"
    for level, result in enumerate(results):
        found = {label: result[key] for key, label in labels.items() if key in result}
        files = result.get("llama_cpp", {})
        bases = [Path(n).name for n in files]  # the whole path where two names are alike
        found |= {
            f"llama.cpp {base if bases.count(base) == 1 else path}": f
            for base, (path, f) in zip(bases, files.items(), strict=True)
        }
        for label, figures in found.items():
            names.setdefault(label, [None] * len(results))[level] = figures
    return names


def value(figures: dict[str, Any] | None, key: tuple[str, str | None]) -> float | None:
    if figures is None or key[0] not in figures:
        return None
    found = figures[key[0]] if key[1] is None else (figures[key[0]] or {}).get(key[1])
    if not isinstance(found, int | float) or not math.isfinite(found):
        return None  # (a level whose requests all failed: NaN, left out)
    return float(found)


def plot(results: Sequence[dict[str, Any]], path: Path, workload: str) -> None:
    """Write the figure of a run's `results` (one a concurrency level) to `path` (SVG)."""
    levels = [r["concurrency"] for r in results]
    series = series_of(results)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        '<text x="12" y="20" font-size="14" font-weight="bold">'
        f"loom bench: {escape(workload)}</text>",
        f'<text x="12" y="38" fill="#57606a">{escape(machine())}</text>',
    ]
    for number, (title, key, unit) in enumerate(PANELS):
        parts += panel(LEFT + number * PANEL, title, unit, key, levels, series)
    x = 12.0
    for number, label in enumerate(series):  # the legend, a label's width at ~6.5 px a letter
        colour = COLOURS[number % len(COLOURS)]
        parts.append(f'<rect x="{x:.0f}" y="{HEIGHT - 22}" width="12" height="4" fill="{colour}"/>')
        parts.append(f'<text x="{x + 16:.0f}" y="{HEIGHT - 16}">{escape(label)}</text>')
        x += 32 + 6.5 * len(label)
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")


def panel(
    left: int,
    title: str,
    unit: str,
    key: tuple[str, str | None],
    levels: list[int],
    series: dict[str, list[dict[str, Any] | None]],
) -> list[str]:
    """One panel: axes, ticks, and a line with points for each server that has the figure."""
    found = [v for figures in series.values() for f in figures if (v := value(f, key)) is not None]
    top = max(found, default=1.0) * 1.1 or 1.0
    bottom = TOP + PLOT_H

    def x_of(level: int) -> float:
        return left + (PLOT_W * level / max(len(levels) - 1, 1) if len(levels) > 1 else PLOT_W / 2)

    def y_of(v: float) -> float:
        return bottom - PLOT_H * v / top

    parts = [
        f'<text x="{left}" y="{TOP - 10}" font-weight="bold">{escape(title)} ({unit})</text>',
        f'<path d="M{left} {TOP} V{bottom} H{left + PLOT_W}" fill="none" stroke="#24292f"/>',
    ]
    for tick in range(5):
        v = top * tick / 4
        parts.append(f'<text x="{left - 4}" y="{y_of(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for index, level in enumerate(levels):
        parts.append(
            f'<text x="{x_of(index):.1f}" y="{bottom + 14}" text-anchor="middle">{level}</text>'
        )
    parts.append(
        f'<text x="{left + PLOT_W / 2}" y="{bottom + 28}" text-anchor="middle">concurrency</text>'
    )
    for number, figures in enumerate(series.values()):
        colour = COLOURS[number % len(COLOURS)]
        points = [
            (x_of(i), y_of(v)) for i, f in enumerate(figures) if (v := value(f, key)) is not None
        ]
        if points:
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(
                f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
            parts += [
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points
            ]
    return parts
