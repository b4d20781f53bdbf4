"""The stages of tools/gpu_check.py, each run in a process of its own: `run_stage(name, ...)`
returns the stage's figures, with `status`, a one-line `line` and the `table` rows for the
summary."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.gpu_check import MODEL_TESTS, ROOT, TINY_TESTS

Result = dict[str, Any]
CONTEXT = 192  # cached tokens a sequence, the standard shape of the floors
SMOLLM2 = {  # SmolLM2-135M-Instruct's shape (its config.json)
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}  # fmt: skip
LLAMA_1B = {  # Llama-3.2-1B's shape
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
}  # fmt: skip
TINY = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}


def run_stage(name: str, device: str, tiny: bool, out: Path) -> Result:
    from tools.gpu_timing import bench_stage, steps_stage

    stages: dict[str, Callable[[torch.device, bool, Path], Result]] = {
        "env": env_stage,
        "tests-fp32": lambda d, t, o: tests_stage(d, t, "float32"),
        "tests-bf16": lambda d, t, o: tests_stage(d, t, "bfloat16"),
        "greedy": greedy_stage,
        "sync": sync_stage,
        "steps": steps_stage,
        "bench": bench_stage,
    }
    return stages[name](torch.device(device), tiny, out)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall ms of each of `repeats` calls after two warm-ups, the device's work included."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return times


def env_stage(device: torch.device, tiny: bool, out: Path) -> Result:
    import triton  # type: ignore[import-untyped,unused-ignore]

    result: Result = {"torch": torch.__version__, "triton": triton.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result |= {"cuda": torch.version.cuda, "sms": props.multi_processor_count}
        result["device"] = (
            f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"
        )
    else:
        result["device"] = f"cpu ({os.cpu_count()} cores)"
    n = (1 << 24) if tiny else (1 << 31)  # bytes copied: 2 GiB on the GPU
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(timed_ms(lambda: dst.copy_(src), device, 10))
    result["copy_gb_s"] = 2 * n / copy_ms / 1e6  # bytes read and written
    size = 512 if tiny else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    matmul_ms = statistics.median(timed_ms(lambda: a @ a, device, 10))
    result["matmul_tflop_s"] = 2 * size**3 / matmul_ms / 1e9
    result["line"] = (
        f"torch {result['torch']}, triton {result['triton']}; copy {result['copy_gb_s']:.0f} "
        f"GB/s, {dtype} matmul {result['matmul_tflop_s']:.1f} TFLOP/s"
    )
    return result


def tests_stage(device: torch.device, tiny: bool, dtype: str) -> Result:
    """The model tests on the device in `dtype`, counted (the log holds every failure)."""
    env = {**os.environ, "LOOM_TEST_DEVICE": str(device), "LOOM_TEST_DTYPE": dtype}
    tests = TINY_TESTS if tiny else MODEL_TESTS
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    found = {
        kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", done.stdout)
    }
    line = ", ".join(f"{n} {kind}" for kind, n in found.items()) or done.stdout[-200:]
    status = {0: "ok", 1: "failures"}.get(done.returncode, "failed")
    return {"status": status, "line": line, "counts": found, "returncode": done.returncode}


def random_model(
    shape: dict[str, Any], device: torch.device, dtype: torch.dtype, **config: Any
) -> Any:
    """A random-weight Llama of `shape`, initialised on the CPU from seed 0 (the same weights on
    every device) and moved to `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, **config)).eval()
    return model.to(device, dtype)


def loaded_model(
    model: Any, device: torch.device, dtype: torch.dtype, tokenizer: Any = None
) -> Any:
    from loom.model.loader import LoadedModel

    return LoadedModel(name="random", model=model, tokenizer=tokenizer, dtype=dtype, device=device)


def greedy_stage(device: torch.device, tiny: bool, out: Path) -> Result:
    """Loom's greedy tokens against transformers' `generate` on the same random model (its
    weights drawn wide, 0.1, so that greedy choices are rarely near-ties), in float32 and in
    bfloat16: the share of positions where the two agree, and the prompts agreeing whole."""
    from loom.core.block_manager import BlockManager
    from loom.core.config import CacheConfig
    from loom.model.model_runner import ModelRunner
    from tests.support.greedy import GreedyRequest, reference_tokens, run_greedy

    num_prompts, max_tokens = (2, 8) if tiny else (8, 64)
    shape = TINY if tiny else SMOLLM2
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, shape["vocab_size"], (16 + 5 * i,), generator=generator).tolist()
        for i in range(num_prompts)
    ]
    result: Result = {"table": []}
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(shape, device, dtype, initializer_range=0.1)
        cache = CacheConfig(num_blocks=256, block_size=16)
        runner = ModelRunner(loaded_model(model, device, dtype), cache, static_decode=True)
        requests = [GreedyRequest(str(i), p, max_tokens) for i, p in enumerate(prompts)]
        run_greedy(runner, BlockManager(num_blocks=256, block_size=16), requests)
        theirs = [reference_tokens(model, p, max_tokens) for p in prompts]
        ours = [r.output for r in requests]
        agree = sum(
            a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True)
        )
        whole = sum(o == t for o, t in zip(ours, theirs, strict=True))
        name = str(dtype).removeprefix("torch.")
        share = 100 * agree / (num_prompts * max_tokens)
        result[name] = {"agree_pct": share, "prompts_whole": whole}
        result["table"].append(
            f"greedy {name}: {share:.1f}% of {num_prompts} x {max_tokens} tokens agree; "
            f"{whole}/{num_prompts} prompts whole"
        )
        del runner, model
    fp32 = result["float32"]
    result["status"] = "ok" if fp32["prompts_whole"] == num_prompts else "differs"
    bf16 = result["bfloat16"]
    result["line"] = f"fp32 {fp32['agree_pct']:.1f}%, bf16 {bf16['agree_pct']:.1f}% tokens agree"
    return result


def sync_stage(device: torch.device, tiny: bool, out: Path) -> Result:
    """One decode step of 8 sequences (after a warm-up step) under the sync audit, and on a GPU
    under torch's own sync debug mode too (each sync it sees is a warning)."""
    import warnings

    from loom.bench.step import scheduled
    from loom.core.config import CacheConfig
    from loom.model.model_runner import ModelRunner
    from tests.support.sync_audit import SyncAudit

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = random_model(TINY if tiny else SMOLLM2, device, dtype)
    cache = CacheConfig(num_blocks=256, block_size=16)
    runner = ModelRunner(loaded_model(model, device, dtype), cache, static_decode=True)
    step = scheduled(runner, 8, CONTEXT, 1)
    runner.execute_model(step)
    synchronize(device)
    with warnings.catch_warnings(record=True) as seen, SyncAudit() as audit:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        runner.execute_model(step)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:120] for w in seen if "synchroniz" in str(w.message)]
    ops = dict(audit.ops)
    listed = ", ".join(f"{name} x{n}" for name, n in sorted(ops.items())) or "none"
    return {
        "ops": ops,
        "cuda_syncs": len(syncs),
        "cuda_sync_messages": syncs,
        "line": f"syncing ops in a decode step: {listed}; torch's sync debug mode: {len(syncs)}",
    }
