"""Loom's device check: what Loom does on a GPU, in one command of at most 8 minutes.

Run by tools/gpu_check.sh on a lent GPU machine (no network: random-weight models with the
SmolLM2-135M and Llama-3.2-1B shapes are built there; SmolLM2's tokenizer travels in .gpu/).
Stages, most valuable first, each a process of its own under its own timeout, so that a hang or
a crash in one costs that stage alone:

    env         the device, torch and Triton; measured copy bandwidth and bf16 matmul rate
    tests-fp32  the model tests on the device in float32 (LOOM_TEST_DEVICE, LOOM_TEST_DTYPE)
    tests-bf16  the same in bfloat16 (the exact-token tests are expected to differ there)
    greedy      Loom's greedy tokens against transformers' on the device, fp32 and bf16
    sync        the ops of one decode step that make the host wait for the device
    steps       decode steps at 1, 8, 64, 256 sequences of 192 tokens: wall and GPU ms, the
                metadata's share, tok/s, the floor (weights + K/V read at the measured
                bandwidth) as a share of the step; peak memory
    bench       `loom bench` at 1, 8, 64, 256 streams, 128 + 128 tokens, on the SmolLM2 shape

Each stage writes its log and its figures to a work folder; the run ends with a summary block
(the device tool returns only the output's last 12,000 characters) and leaves three files in
OUT: summary.txt, results.json (every stage's figures), logs.tgz (every stage's log).
`--device cpu --tiny` runs every stage on tiny shapes in under a minute: CI runs it, so that
the check never rots.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = {  # name: timeout in seconds on the GPU (the tiny run: a quarter, at least 30)
    "env": 40,
    "tests-fp32": 90,
    "tests-bf16": 60,
    "greedy": 70,
    "sync": 30,
    "steps": 90,
    "bench": 100,
}
BUDGET_S = 480  # the whole run: a stage that could end past it is skipped
MODEL_TESTS = [  # SmolLM2's GGUF stays behind (64 MiB travel): its tests are left out
    "-m",
    "not smollm2",
    "tests/model/test_triton_decode.py",
    "tests/model/test_static_decode.py",
    "tests/model/test_launched.py",
    "tests/engine/test_overlap.py",
    "tests/model/test_triton_ops.py",
    "tests/model/test_sampling_noise.py",
    "tests/model/test_model_runner.py",
    "tests/model/test_families.py",
    "tests/model/test_rope_invariance.py",
    "tests/model/test_sampler.py",
    "tests/model/test_decoder.py",
]
TINY_TESTS = ["tests/model/test_triton_decode.py", "-k", "splits_only or padded_row"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the CPU dry run")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a stage's process
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage is not None:
        from tools.gpu_stages import run_stage

        result = run_stage(args.stage, args.device, args.tiny, args.out)
        (args.out / f"{args.stage}.json").write_text(json.dumps(result, indent=1))
        return 0
    return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    """Every stage, each writing to a work folder; then OUT gets three files (the device tool
    brings back at most eight): summary.txt, results.json (every stage's figures) and
    logs.tgz (every stage's log)."""
    start = time.monotonic()
    out, args.out = args.out, Path(tempfile.mkdtemp(prefix="loom-gpu-check-"))
    rows: list[tuple[str, str, float, str]] = []
    for name in args.stages.split(","):
        if name not in STAGES:
            raise SystemExit(f"no stage {name!r}; the stages: {', '.join(STAGES)}")
        timeout = max(30, STAGES[name] // 4) if args.tiny else STAGES[name]
        if time.monotonic() - start + timeout > BUDGET_S and not args.tiny:
            rows.append((name, "skipped", 0.0, f"past the {BUDGET_S} s budget"))
            continue
        rows.append(run_one(args, name, timeout))
        print(
            f"[{time.monotonic() - start:6.1f} s] {name}: {rows[-1][1]} {rows[-1][3]}", flush=True
        )
    text = summary(args, rows, time.monotonic() - start).replace(str(args.out), str(out))
    results = {p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.txt").write_text(text)
    with tarfile.open(out / "logs.tgz", "w:gz") as logs:
        for log in sorted(args.out.glob("*.log")):
            logs.add(log, arcname=log.name)
    print(text)
    return 0 if all(status == "ok" for _, status, _, _ in rows) else 1


def run_one(args: argparse.Namespace, name: str, timeout: int) -> tuple[str, str, float, str]:
    """One stage in a process of its own; its output to OUT/<name>.log."""
    command = [sys.executable, __file__, "--stage", name, "--device", args.device]
    command += ["--out", str(args.out)] + (["--tiny"] if args.tiny else [])
    log = args.out / f"{name}.log"
    began = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            return name, "timeout", time.monotonic() - began, f"past {timeout} s (see {log.name})"
    took = time.monotonic() - began
    result_file = args.out / f"{name}.json"
    if code != 0 or not result_file.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return name, f"failed({code})", took, tail[0][:200]
    result: dict[str, Any] = json.loads(result_file.read_text())
    return name, str(result.get("status", "ok")), took, str(result.get("line", ""))


def summary(args: argparse.Namespace, rows: list[tuple[str, str, float, str]], took: float) -> str:
    env: dict[str, Any] = {}
    if (args.out / "env.json").exists():
        env = json.loads((args.out / "env.json").read_text())
    lines = ["", "=" * 24 + " loom gpu check: summary " + "=" * 24]
    lines.append(f"device   {env.get('device', args.device)}  ({'tiny' if args.tiny else 'full'})")
    lines += [f"{name:<11} {status:<10} {t:6.1f} s  {line}" for name, status, t, line in rows]
    for name in ("steps", "bench", "greedy", "sync"):
        path = args.out / f"{name}.json"
        if path.exists():
            lines += [f"  {row}" for row in json.loads(path.read_text()).get("table", [])]
    lines.append(f"total    {took:.0f} s; logs and figures in {args.out}")
    lines.append("=" * 73)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
