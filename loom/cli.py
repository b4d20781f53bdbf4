"""`loom`: the command line: `loom serve`, `loom bench`, `loom bench-step`, `loom health`."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from loom import bench_command, bench_step, health_probe
from loom.device import resolve_device, resolve_dtype
from loom.engine import Engine
from loom.engine_config import EngineConfig
from loom.loader import load_model
from loom.scheduler import SchedulerConfig
from loom.server import LoomServer, ServerConfig

UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def byte_size(text: str) -> int:
    """`1073741824`, `512MiB`, `2GiB`, `1.5GB`."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = match and UNITS.get(match.group(2).upper())
    if not match or unit is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * unit)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="loom", description="Loom: an LLM inference server.")
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over gRPC",
        description="Serve a model over gRPC (loom.v1.Loom, health, reflection).",
    )
    add = serve.add_argument
    add(
        "--model",
        default=None,
        help="a Hugging Face folder, hub id or GGUF file (default: SmolLM2-135M-Instruct)",
    )
    add(
        "--model-cache",
        type=Path,
        default=None,
        help="where converted GGUF models are kept (default: $LOOM_CACHE_DIR or ~/.cache/loom)",
    )
    add(
        "--dtype",
        default="auto",
        help="auto, float32, bfloat16, float16 (auto: float32 on cpu, bfloat16 on cuda)",
    )
    add("--device", default="auto", help="auto, cpu, cuda[:N]")
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    add(
        "--port",
        type=int,
        default=50051,
        help="port to listen on; 0 picks a free one (default: 50051)",
    )
    add(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        help="KV pool size, e.g. 2GiB (default: a fraction of free memory)",
    )
    add(
        "--kv-cache-fraction",
        type=float,
        default=0.1,
        help="KV pool as a fraction of free memory (default: 0.1)",
    )
    add(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (overrides the memory settings)",
    )
    add("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    add("--max-num-seqs", type=int, default=64, help="most sequences in one step (default: 64)")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="most tokens in one step (default: 512)",
    )
    add(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="queue limit in requests; beyond it RESOURCE_EXHAUSTED (default: 256)",
    )
    add(
        "--max-waiting-tokens",
        type=int,
        default=1 << 20,
        help="queue limit in prompt tokens (default: 1048576)",
    )
    add(
        "--max-prompt-chars",
        type=int,
        default=1 << 20,
        help="longest prompt text accepted (default: 1048576)",
    )
    add(
        "--output-buffer-size",
        type=int,
        default=64,
        help="outputs buffered per request before it pauses (default: 64)",
    )
    add(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds a client may read nothing before its request is aborted (default: 30)",
    )
    add(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM (default: 30)",
    )
    add(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default: info)",
    )
    bench_command.add_parser(commands)
    bench_step.add_parser(commands)
    health_probe.add_parser(commands)
    root.formatter_class = argparse.RawDescriptionHelpFormatter
    root.epilog = serve.format_help()  # so that `loom --help` lists every flag too
    return root


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_fraction,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        max_prompt_chars=args.max_prompt_chars,
        output_buffer_size=args.output_buffer_size,
        stall_timeout=args.stall_timeout,
    )


def serve(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    load = partial(
        load_model,
        args.model,
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        cache_dir=args.model_cache,
    )
    server = LoomServer(
        Engine(engine_config(args), load),
        ServerConfig(host=args.host, port=args.port, drain_timeout=args.drain_timeout),
    )
    trio.run(server.run)
    return server.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        commands = {
            "serve": serve,
            "bench": bench_command.run,
            "bench-step": bench_step.run,
            "health": health_probe.run,
        }
        sys.exit(commands[args.command](args))
    except ValueError as exc:  # a bad setting: name it, no traceback
        sys.exit(f"loom: {exc}")
