"""tools/gpu_check.sh, the device check a lent GPU machine runs, in its CPU dry run: every
stage runs on tiny shapes and ends ok, and the summary block the device tool brings back names
each stage and holds the figures' tables. So the check never rots between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
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
        assert (tmp_path / f"{stage}.log").exists()
    assert "seqs  wall ms" in summary  # the steps' table
    assert "out tok/s" in summary  # the bench's
    greedy = json.loads((tmp_path / "greedy.json").read_text())
    assert greedy["float32"]["agree_pct"] == 100.0  # Loom's greedy tokens are transformers'
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert [row["seqs"] for row in steps["tiny"]] == [1, 4]
    assert all(row["wall_ms"] > 0 and row["tok_s"] > 0 for row in steps["tiny"])
