"""`loom bench`: the command around loom/bench/serving.py and loom/bench/baseline.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loom.bench.baseline import run_baseline
from loom.bench.llama_cpp import check_llama_server, drive_llama_server, launched_llama_server
from loom.bench.metrics import Objectives, summarize, table
from loom.bench.serving import Workload, drive, launched_server, make_workload
from loom.core.setting import at_least
from loom.model.linear import METHODS
from loom.model.loader import LoadedModel, default_model_path, load_model


def add_parser(commands: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = commands.add_parser(
        "bench",
        help="benchmark a Loom server (and transformers, side by side)",
        description="Benchmark a Loom server on the standard workload: N concurrent streaming "
        "requests, prompts of exactly --input-len tokens, exactly --output-len generated, greedy.",
    )
    add = bench.add_argument
    add("--address", default=None, help="HOST:PORT of a running server (default: launch one)")
    add("--model", default=None, help="the model (launched server, tokenizer and baseline)")
    add(
        "--quantization",
        default=None,
        choices=METHODS,
        help="the launched server's --quantization (default: none, the exact path)",
    )
    add(
        "--serve-args",
        default="",
        help='extra `loom serve` flags for a launched server, e.g. "--max-num-seqs 64"',
    )
    add(
        "--concurrency",
        default="1,8,32,64",
        help="comma-separated concurrencies (default: 1,8,32,64)",
    )
    add(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per concurrency (default: the concurrency)",
    )
    add("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    add("--output-len", type=int, default=128, help="generated tokens (default: 128)")
    add(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    add("--seed", type=int, default=0)
    add("--warmup", type=int, default=2, help="unmeasured requests first (default: 2)")
    add("--baseline", action="store_true", help="also run transformers generate, static batches")
    add(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="also drive llama.cpp's llama-server binary at PATH on the model's GGUF file, "
        "same prompts (see loom/bench/llama_cpp.py)",
    )
    add("--goodput", default="", help="latency objectives in ms, e.g. ttft=2000,tpot=200")
    add("--json", type=Path, default=None, help="write the results here")
    return bench


def counts(flag: str, text: str) -> list[int]:
    """A comma-separated list of whole numbers of at least 1 (`1,8,64`)."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, got {text!r}") from None
    for value in values:
        at_least(1)(flag, value)
    return values


def objectives(text: str) -> Objectives:
    limits = dict(item.split("=") for item in text.split(",") if item)
    unknown = set(limits) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"--goodput takes ttft, tpot and e2e, not {', '.join(sorted(unknown))}")
    return Objectives(**{f"{k}_ms": float(v) for k, v in limits.items()})


@contextlib.contextmanager
def server_address(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    if args.address:
        host, _, port = args.address.rpartition(":")
        yield host or "127.0.0.1", int(port)
        return
    serve_args = shlex.split(args.serve_args)
    if args.model:
        serve_args += ["--model", args.model]
    if args.quantization:
        serve_args += ["--quantization", args.quantization]
    with launched_server(serve_args) as port:
        yield "127.0.0.1", port


def run(args: argparse.Namespace) -> int:
    goals = objectives(args.goodput)
    concurrencies = counts("--concurrency", args.concurrency)
    for flag, value, minimum in [
        ("--num-prompts", 1 if args.num_prompts is None else args.num_prompts, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--warmup", args.warmup, 0),
    ]:
        at_least(minimum)(flag, value)
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be above 0, got {args.request_rate}")
    if args.llama_server is not None:
        check_llama_server(args.llama_server, gguf_of(args))
    loaded = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    with server_address(args) as (host, port), llama_server(args, concurrencies) as llama:
        try:
            results = [
                measure(args, loaded, pad, goals, (host, port), llama, c) for c in concurrencies
            ]
        except ConnectionError as exc:
            print(f"loom bench: no server answers at {host}:{port} ({exc})", file=sys.stderr)
            return 2
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "func")}
        args.json.write_text(json.dumps({"config": config, "runs": results}, indent=2, default=str))
    failed = sum(r["loom"]["failed"] for r in results)
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, concurrencies: list[int]) -> Iterator[int | None]:
    """The port of a launched llama-server with `--llama-server`, else None."""
    if args.llama_server is None:
        yield None
        return
    tokens = args.input_len + args.output_len + 16
    with launched_llama_server(
        args.llama_server, gguf_of(args), max(concurrencies), tokens
    ) as port:
        yield port


def gguf_of(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else default_model_path()


def measure(
    args: argparse.Namespace,
    loaded: LoadedModel,
    pad: int,
    goals: Objectives,
    address: tuple[str, int],
    llama_port: int | None,
    concurrency: int,
) -> dict[str, Any]:
    """One concurrency level: warm up, drive the server, then the baselines asked for; print."""
    host, port = address
    workload = make_workload(
        loaded.tokenizer,
        args.num_prompts or concurrency,
        args.input_len,
        args.output_len,
        args.seed + concurrency,
    )
    warm_up(host, port, Workload(prompts=workload.prompts[: args.warmup], output_len=8))
    timings, duration, server = asyncio.run(
        drive(
            host,
            port,
            workload,
            concurrency=concurrency,
            request_rate=args.request_rate,
            seed=args.seed,
        )
    )
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "loom": summarize(timings, duration, goals) | {"server": server},
    }
    result |= baselines(args, loaded, pad, goals, workload, llama_port, concurrency)
    title = (
        f"\n== concurrency {concurrency}: {len(workload.prompts)} requests, "
        f"{args.input_len} prompt + {args.output_len} output tokens; "
        f"KV blocks used at most {server['max_used_blocks']}/{server['num_total_blocks']}, "
        f"preemptions {server['num_preemptions']}"
    )
    print(table(title, result["loom"], result.get("baseline"), "transformers"), flush=True)
    if "llama_cpp" in result:
        print(table("", result["loom"], result["llama_cpp"], "llama.cpp"), flush=True)
    return result


def baselines(
    args: argparse.Namespace,
    loaded: LoadedModel,
    pad: int,
    goals: Objectives,
    workload: Workload,
    llama_port: int | None,
    concurrency: int,
) -> dict[str, Any]:
    """transformers' `generate` (`--baseline`) and llama.cpp's server (`--llama-server`)."""
    result = {}
    if args.baseline:
        base_timings, base_duration = run_baseline(loaded.model, pad, workload, concurrency)
        result["baseline"] = summarize(base_timings, base_duration, goals)
    if llama_port is not None:
        warm = Workload(prompts=workload.prompts[: args.warmup], output_len=8)
        drive_llama_server(llama_port, warm, 1)  # unmeasured, as Loom's warm-up
        llama_timings, llama_duration = drive_llama_server(llama_port, workload, concurrency)
        result["llama_cpp"] = summarize(llama_timings, llama_duration, goals)
    return result


def warm_up(host: str, port: int, workload: Workload) -> None:
    """Unmeasured requests, one at a time, so that the measured run starts warm."""
    asyncio.run(
        drive(
            host, port, workload, concurrency=1, request_rate=float("inf"), seed=0, progress=False
        )
    )
