"""`loom bench-step`: a real run on a tiny model, each part of the step timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loom.cli import main


def test_bench_step_times_each_part_of_a_decode_step(tiny_folder: Path) -> None:
    command = [sys.executable, "-m", "loom", "bench-step", "--model", str(tiny_folder)]
    command += ["--sequences", "1,3", "--context", "20", "--prompt-len", "9", "--repeats", "2"]
    command += ["--kv-cache-dtype", "fp16"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["sequences", "step"]))
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        step, linear, lm_head, attention = (float(x) for x in row[1:5])
        assert min(step, linear, lm_head, attention) > 0
    assert "prefill step, 4 prompts of 9 tokens:" in result.stdout
    assert "KV pool float16" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sequences", "1,x"], "--sequences takes whole numbers separated by commas"),
        (["--sequences", "0"], "--sequences must be at least 1, got 0"),
        (["--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["--context", "-1"], "--context must be at least 0, got -1"),
    ],
)
def test_bench_step_refuses_bad_flags_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-step", *flags])
    assert message in str(exit_info.value.code)
