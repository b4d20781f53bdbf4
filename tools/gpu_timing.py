"""The timing stages of tools/gpu_check.py: decode steps on the model runner, and `loom bench`
against a launched server."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tools.gpu_stages import (
    CONTEXT,
    LLAMA_1B,
    ROOT,
    SMOLLM2,
    TINY,
    Result,
    loaded_model,
    random_model,
    synchronize,
    timed_ms,
)  # fmt: skip

SIZES = (1, 8, 64, 256)
TINY_SIZES = (1, 4)


def steps_stage(device: torch.device, tiny: bool, out: Path) -> Result:
    """Decode steps of S sequences, each with CONTEXT cached tokens, greedy: the wall ms (median
    of 20), the GPU's own ms (CUDA events), the host's metadata ms, tok/s, and the floor: the
    weights and the K/V read once at the measured copy bandwidth, as a share of the step."""
    env_file = out / "env.json"
    bandwidth = json.loads(env_file.read_text())["copy_gb_s"] if env_file.exists() else None
    shapes = {"tiny": TINY} if tiny else {"smollm2-135m": SMOLLM2, "llama-3.2-1b": LLAMA_1B}
    header = ["shape", "seqs", "wall ms", "gpu ms", "host ms", "eager ms", "tok/s", "floor us"]
    header.append("floor %")
    widths = [13, 5, 9, 8, 8, 9, 9, 9, 8]
    title = f"{header[0]:<{widths[0]}}" + "".join(
        f"{h:>{w}}" for h, w in zip(header[1:], widths[1:], strict=True)
    )
    result: Result = {"table": [title]}
    for name, shape in shapes.items():
        rows = time_steps(name, shape, device, tiny, bandwidth)
        result[name] = rows
        result["table"] += [
            f"{name:<13}{r['seqs']:>5}{r['wall_ms']:>9.3f}{r['gpu_ms']:>8.3f}{r['metadata_ms']:>8.3f}"
            f"{r['eager_ms']:>9.3f}{r['tok_s']:>9.0f}{r['floor_us']:>9.0f}{r['floor_pct']:>7.1f}%"
            for r in rows
        ]
        if device.type == "cuda":
            result[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
    first = result[next(iter(shapes))]
    result["line"] = ", ".join(f"{r['seqs']}: {r['wall_ms']:.2f} ms" for r in first)
    return result


def time_steps(
    name: str, shape: dict[str, Any], device: torch.device, tiny: bool, bandwidth: float | None
) -> list[Result]:
    from loom.core.config import CacheConfig
    from loom.model.model_runner import ModelRunner

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = random_model(shape, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sizes = TINY_SIZES if tiny else SIZES
    blocks_per_seq = -(-(CONTEXT + 1) // 16)
    cache = CacheConfig(num_blocks=1 + 2 * blocks_per_seq * max(sizes), block_size=16)
    loaded = loaded_model(model, device, dtype)
    try:
        runner = ModelRunner(loaded, cache, static_decode=True)
    except Exception as exc:  # the GPU path did not build: the gather path's figures, at least
        print(f"{name}: the static step did not build ({exc!r}); timing gather + SDPA", flush=True)
        runner = ModelRunner(loaded, cache, static_decode=False)
        runner.model.decode_in_place = runner.model.fused = runner.model.fused_rotary = False
    del model, loaded  # the runner holds what it computes with
    for layer in runner.kv_cache.k + runner.kv_cache.v:
        layer.normal_()
    kv_per_token = runner.kv_cache_shape.bytes_per_block // 16
    rows = []
    for seqs in sizes:
        rows.append(time_step(runner, seqs, device))
        floor_bytes = weight_bytes + seqs * (CONTEXT + 1) * kv_per_token
        floor_us = floor_bytes / (bandwidth * 1e3) if bandwidth else 0.0
        rows[-1] |= {"floor_us": floor_us, "floor_pct": floor_us / rows[-1]["wall_ms"] / 10}
        print(name, rows[-1], flush=True)
    return rows


def time_step(runner: Any, seqs: int, device: torch.device) -> Result:
    """The step as the runner takes it (the static step, in its CUDA graph, on a GPU), the
    host's part before the device's (the static step's fill, else the attention metadata), and
    the same step run eagerly, the dynamic way."""
    from loom.bench.step import scheduled

    step = scheduled(runner, seqs, CONTEXT, 1)
    wall = statistics.median(timed_ms(lambda: runner.execute_model(step), device, 20))
    static, rows = runner.static, seqs
    if static is not None and static.takes(step.sequences):
        rows = static.bucket(seqs)
        host = timed_ms(lambda: static.fill(step.sequences, rows), device, 20)
    else:
        host = timed_ms(lambda: runner.attention_metadata(step.sequences), device, 20)
    gpu = gpu_ms(lambda: runner.execute_model(step), device) if device.type == "cuda" else wall
    runner.static = None
    try:
        eager = statistics.median(timed_ms(lambda: runner.execute_model(step), device, 10))
    finally:
        runner.static = static
    return {
        "seqs": seqs, "rows": rows, "wall_ms": wall, "gpu_ms": gpu,
        "metadata_ms": statistics.median(host), "eager_ms": eager, "tok_s": seqs / wall * 1000,
    }  # fmt: skip


def gpu_ms(fn: Any, device: torch.device, repeats: int = 20) -> float:
    """The median time between CUDA events recorded before and after `fn`'s kernels."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tokenizer_folder() -> Path:
    """SmolLM2's tokenizer: .gpu/smollm2 where `just gpu-pack` put it (it travels to the GPU
    machine), else the default model's converted folder in the model cache."""
    packed = ROOT / ".gpu" / "smollm2"
    if packed.is_dir():
        return packed
    from loom.model.loader import converted_gguf_folder, default_model_path, model_cache_root

    return converted_gguf_folder(default_model_path(), model_cache_root())


def bench_stage(device: torch.device, tiny: bool, out: Path) -> Result:
    """`loom bench` on a random model of SmolLM2's shape saved with its tokenizer: output tok/s,
    TTFT and TPOT p50 at each concurrency, 128 + 128 tokens (tiny: 16 + 8)."""
    from transformers import AutoTokenizer

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    folder = Path(tempfile.mkdtemp(prefix="loom-check-model-"))
    random_model(TINY if tiny else SMOLLM2, torch.device("cpu"), dtype).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tokenizer_folder())).save_pretrained(folder)
    sizes = TINY_SIZES if tiny else SIZES
    lens = ("16", "8") if tiny else ("128", "128")
    report = out / "bench-results.json"
    command = [sys.executable, "-m", "loom", "bench", "--model", str(folder)]
    command += ["--concurrency", ",".join(map(str, sizes)), "--input-len", lens[0]]
    command += ["--output-len", lens[1], "--json", str(report), "--warmup", "2"]
    budget = "" if tiny else " --max-num-batched-tokens 8192"  # a GPU's prefill budget
    command += [f"--serve-args=--device {device} --max-num-seqs {max(sizes)}{budget}"]
    began = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the saved model: 270 MB on the GPU's shape
    print(done.stdout[-20000:], done.stderr[-20000:], sep="\n")
    if done.returncode != 0:
        return {"status": "failed", "line": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    runs = json.loads(report.read_text())["runs"]
    table = [f"{'streams':>8}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"]
    for run in runs:
        loom = run["loom"]
        table.append(
            f"{run['concurrency']:>8}{loom['output_throughput']:>11.0f}"
            f"{loom['ttft_ms']['p50']:>13.1f}{loom['tpot_ms']['p50']:>13.2f}"
        )
    took = time.monotonic() - began
    return {"runs": runs, "table": table, "line": f"{len(runs)} levels in {took:.0f} s"}
