"""`loom bench --plot`: the figure's panels, a line for every server the run measured with a
point at each level that has the figure, higher values drawn higher, the machine named; an
SVG that parses; any other file refused by name."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from loom.bench.plot import plot

SVG = "{http://www.w3.org/2000/svg}"


def figures(tok_s: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {
        "output_throughput": tok_s,
        "ttft_ms": {"p50": ttft, "mean": ttft},
        "tpot_ms": {"p50": tpot, "mean": tpot},
    }


def test_plot_draws_each_server_at_each_level_it_has(tmp_path: Path) -> None:
    results = [
        {
            "concurrency": c,
            "loom": figures(100.0 * c, 10.0 * c, 3.0 + c),
            "baseline": figures(50.0 * c, 20.0 * c, 6.0 + c),
            "llama_cpp": {"/x/model.Q4_0.gguf": figures(80.0 * c, 15.0 * c, 4.0 + c)}
            if c < 64
            else {},
        }
        for c in (1, 8, 64)
    ]
    path = tmp_path / "bench.svg"
    plot(results, path, "standard workload, tiny")
    root = ET.parse(path).getroot()
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    for expected in ("output tok/s (tok/s)", "TTFT p50 (ms)", "TPOT p50 (ms)", "Loom"):
        assert expected in texts
    assert "transformers" in texts
    assert "llama.cpp model.Q4_0.gguf" in texts
    assert any("cores" in t for t in texts)  # the machine
    lines = [line.get("points", "").split() for line in root.iter(f"{SVG}polyline")]
    assert [len(points) for points in lines] == [
        3,
        3,
        2,
    ] * 3  # per panel: Loom, transformers, llama.cpp
    loom_tok_s = [float(point.split(",")[1]) for point in lines[0]]
    assert loom_tok_s == sorted(loom_tok_s, reverse=True)  # more tok/s, higher (smaller y)


def test_bench_plot_refuses_a_file_that_is_not_svg(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loom", "bench", "--model", "sim:step_ms=1"]
    command += ["--plot", str(tmp_path / "bench.png")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--plot draws SVG: name a .svg file, not bench.png" in result.stderr
    assert not (tmp_path / "bench.png").exists()


def test_plot_leaves_out_a_level_that_has_no_figure_and_names_alike_files_apart(
    tmp_path: Path,
) -> None:
    nan = float("nan")
    results = [
        {
            "concurrency": c,
            "loom": figures(nan if c == 8 else 100.0, nan if c == 8 else 5.0, 3.0),
            "llama_cpp": {
                "/a/model.gguf": figures(50.0, 9.0, 4.0),
                "/b/model.gguf": figures(60.0, 8.0, 4.0),
            },
        }
        for c in (1, 8, 64)
    ]
    path = tmp_path / "bench.svg"
    plot(results, path, "standard workload")
    root = ET.parse(path).getroot()
    assert "nan" not in path.read_text()
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert {"llama.cpp /a/model.gguf", "llama.cpp /b/model.gguf"} <= set(texts)
    lines = [line.get("points", "").split() for line in root.iter(f"{SVG}polyline")]
    assert [len(points) for points in lines[:3]] == [2, 3, 3]  # Loom's tok/s: 8 left out
