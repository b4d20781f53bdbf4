"""tools/gpu_check.sh, the device check a lent GPU machine runs, in its CPU dry run: every
stage runs on tiny shapes and ends ok, the summary block the device tool brings back names
each stage and holds the figures' tables, and OUT holds three files (the tool brings back at
most eight). So the check never rots between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

from tools.gpu_check import STAGES

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_runs_every_stage_on_the_cpu(tmp_path: Path) -> None:
    command = [str(ROOT / "tools" / "gpu_check.sh"), "--device", "cpu", "--tiny"]
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("loom gpu check: summary")[1]
    for stage in STAGES:
        assert f"\n{stage:<11} ok " in summary, (stage, summary)
    assert "seqs  wall ms" in summary  # the steps' table
    assert "out tok/s" in summary  # the bench's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tgz", "results.json", "summary.txt"]
    with tarfile.open(tmp_path / "logs.tgz") as logs:
        assert sorted(logs.getnames()) == sorted(f"{stage}.log" for stage in STAGES)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["greedy"]["float32"]["agree_pct"] == 100.0  # Loom's tokens are generate's
    assert results["sync"]["ops"] == {}  # the static decode step waits on nothing
    steps = results["steps"]["tiny"]
    assert [row["seqs"] for row in steps] == [1, 4]
    assert all(row["wall_ms"] > 0 and row["tok_s"] > 0 for row in steps)
