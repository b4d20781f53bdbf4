"""`loom bench`: its flags and the servers it drives; loom/bench/measure.py runs each
concurrency level."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loom.bench.baseline import baseline_placement
from loom.bench.llama_cpp import add_llama_arguments, check_llama_flags, llama_server
from loom.bench.measure import Target, measure, measure_caching_off, report
from loom.bench.metrics import Objectives
from loom.bench.plot import plot
from loom.bench.serving import launched_process
from loom.bench.tenants import ratio_of, report_tenants, run_tenants
from loom.client.tls import add_tls_arguments
from loom.core.setting import at_least
from loom.model.linear import METHODS
from loom.model.loader import LoadedModel, load_model
from loom.model.sim import is_sim, load_sim


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
    add(
        "--workload",
        default="standard",
        choices=WORKLOADS,
        help="standard: distinct prompts; shared-prefix: --prefix-len common tokens before "
        "each prompt; multi-turn: --concurrency conversations of --turns turns, each resending "
        "its history; rewrite: each prompt asks for a passage of --input-len tokens to be "
        "written out again (for speculative decoding) (default: standard)",
    )
    add("--prefix-len", type=int, default=512, help="shared-prefix: common tokens (default: 512)")
    add("--turns", type=int, default=6, help="multi-turn: turns per conversation (default: 6)")
    add(
        "--compare-prefix-caching",
        action="store_true",
        help="then launch a server with --no-enable-prefix-caching (once the first has stopped) "
        "and run the same workloads on it; the tables put the two side by side",
    )
    add(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens; shared-prefix: the distinct part; multi-turn: new tokens a turn "
        "(default: 128)",
    )
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
    add_llama_arguments(bench)
    add(
        "--tenants",
        default=None,
        metavar="HEAVY:LIGHT",
        help="two tenants, e.g. 4:1: a heavy one at 4x a light one's load (concurrency and "
        "requests; the light one's: the first --concurrency), on launched servers: the light "
        "one alone, both under the fair scheduler, both under FCFS (loom/bench/tenants.py)",
    )
    add(
        "--api",
        default="grpc",
        choices=APIS,
        help="how the clients call: grpc, openai (POST /v1/completions, streamed), or both, "
        "one after the other on the same server, side by side in the tables, with each "
        "front's CPU time per token (default: grpc)",
    )
    add(
        "--constrained-fraction",
        type=fraction,
        default=0.0,
        help="the share of requests constrained by a JSON schema of records (structured "
        "outputs), spread evenly; each still makes exactly --output-len tokens (default: 0)",
    )
    add("--http-address", default=None, help="with --address and --api openai: HOST:PORT")
    add(
        "--text-prompts",
        action="store_true",
        help="with --api openai: send each prompt as its text (a gateway that takes no token "
        "ids: SMG), a token for each streamed chunk (and the few more the usage counts)",
    )
    add("--api-key", default=None, help="sent as `authorization: Bearer KEY` (--api-key-file)")
    add_tls_arguments(bench)
    add("--goodput", default="", help="latency objectives in ms, e.g. ttft=2000,tpot=200")
    add("--json", type=Path, default=None, help="write the results here")
    add("--plot", type=Path, default=None, help="draw output tok/s, TTFT and TPOT against "
        "concurrency for every server of the run into this SVG file")  # fmt: skip
    return bench


WORKLOADS = ("standard", "shared-prefix", "multi-turn", "rewrite")
APIS = ("grpc", "openai", "both")


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


def serve_args_of(args: argparse.Namespace) -> list[str]:
    """`loom serve`'s flags for a launched server. Its clients are all this process, one
    connection each: the connection caps (per peer above all) make room for them."""
    serve_args = shlex.split(args.serve_args)
    scale = ratio_of(args.tenants) + 1 if args.tenants else 1  # both tenants' connections
    room = str(max(counts("--concurrency", args.concurrency)) * scale + 16)
    for flag in ("--max-connections", "--max-connections-per-peer"):
        if not any(arg == flag or arg.startswith(flag + "=") for arg in serve_args):
            serve_args += [flag, room]
    if args.api != "grpc" and "--http-port" not in serve_args:
        serve_args += ["--http-port", "0"]
    if args.model:
        serve_args += ["--model", args.model]
    if args.quantization:
        serve_args += ["--quantization", args.quantization]
    return serve_args


@contextlib.contextmanager
def server_address(args: argparse.Namespace) -> Iterator[Target]:
    if args.address:
        host, _, port = args.address.rpartition(":")
        http_port = int(args.http_address.rpartition(":")[2]) if args.http_address else None
        yield Target(host=host or "127.0.0.1", port=int(port), http_port=http_port)
        return
    ports: dict[str, int] = {}
    with launched_process(serve_args_of(args), ports=ports) as (port, process):
        yield Target(host="127.0.0.1", port=port, http_port=ports.get("http"), pid=process.pid)


def run(args: argparse.Namespace) -> int:
    goals = objectives(args.goodput)
    concurrencies = counts("--concurrency", args.concurrency)
    check_flags(args)
    if is_sim(args.model):  # its prompts are random token ids
        if args.baseline or args.llama_server:
            raise ValueError("--baseline and --llama-server need a real model, not sim")
        loaded, pad = load_sim(args.model), 0
        if args.text_prompts and loaded.tokenizer is None:
            raise ValueError("--text-prompts: the sim model needs a tokenizer (tokenizer=...)")
    else:
        device, dtype = baseline_placement(args.baseline, args.serve_args)
        loaded = load_model(args.model, dtype=dtype, device=device)
        pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    if args.tenants:
        return run_tenants_of(args, loaded, concurrencies[0])
    with server_address(args) as target, llama_server(args, concurrencies) as llama:
        try:
            results = [measure(args, loaded, pad, goals, target, llama, c) for c in concurrencies]
        except ConnectionError as exc:
            where = f"{target.host}:{target.port}"
            print(f"loom bench: no server answers at {where} ({exc})", file=sys.stderr)
            return 2
    compared = not args.compare_prefix_caching or compare_caching_off(args, loaded, goals, results)
    for result in results:
        report(result)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "func")}
        args.json.write_text(json.dumps({"config": config, "runs": results}, indent=2, default=str))
    if args.plot:
        model = args.model or "SmolLM2-135M-Instruct"
        method = args.quantization or "exact"
        plot(results, args.plot, f"{args.workload} workload, {model}, {method}")
    failed = report_failures(results)
    return 1 if failed or not compared else 0


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values, and the ones that go together, refused by name."""
    if args.plot is not None and args.plot.suffix.lower() != ".svg":
        raise ValueError(f"--plot draws SVG: name a .svg file, not {args.plot.name}")
    if args.plot is not None and not args.plot.resolve().parent.is_dir():
        raise ValueError(f"--plot: no folder {args.plot.resolve().parent} to write it in")
    for flag, value, minimum in [
        ("--num-prompts", 1 if args.num_prompts is None else args.num_prompts, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--warmup", args.warmup, 0),
        ("--prefix-len", args.prefix_len, 1),
        ("--turns", args.turns, 1),
    ]:
        at_least(minimum)(flag, value)
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be above 0, got {args.request_rate}")
    if args.workload not in ("standard", "rewrite") and (args.baseline or args.llama_server):
        raise ValueError("--baseline and --llama-server run the standard and rewrite workloads")
    if args.tenants and (args.address or args.baseline or args.llama_server):
        raise ValueError("--tenants launches its servers, with Loom alone: drop --address")
    if args.compare_prefix_caching and args.address:
        raise ValueError("--compare-prefix-caching launches both servers; drop --address")
    if args.text_prompts and (args.api != "openai" or args.workload == "multi-turn"):
        raise ValueError("--text-prompts goes with --api openai, not --workload multi-turn")
    if args.api != "grpc" and args.address and not args.http_address:
        raise ValueError("--api openai with --address needs --http-address HOST:PORT")
    check_llama_flags(args)


def run_tenants_of(args: argparse.Namespace, loaded: LoadedModel, concurrency: int) -> int:
    result = run_tenants(args, loaded, serve_args_of(args), concurrency)
    report_tenants(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    runs = [figures for run in ("alone", "fair", "fcfs") for figures in result[run].values()]
    return 1 if any(run["failed"] for run in runs) else 0


def report_failures(results: list[dict[str, Any]]) -> int:
    """How many requests failed, on either server; says so, with their first errors."""
    runs = [r[side] for r in results for side in ("loom", "caching_off") if side in r]
    failed = sum(run["failed"] for run in runs)
    if failed:
        errors = sorted({error for run in runs for error in run["errors"]})
        print(f"{failed} requests failed: {'; '.join(errors[:3])}", file=sys.stderr)
    return int(failed)


def compare_caching_off(
    args: argparse.Namespace, loaded: LoadedModel, goals: Objectives, results: list[dict[str, Any]]
) -> bool:
    """The same workloads on a server without prefix caching, launched once the first has
    stopped: one server at a time (a second one, idle, slowed the first measurably). False if
    it stopped answering; what the first server gave is reported all the same."""
    with launched_process([*serve_args_of(args), "--no-enable-prefix-caching"]) as (port, _):
        try:
            for result in results:
                target = Target(host="127.0.0.1", port=port)
                measure_caching_off(args, loaded, goals, target, result)
        except ConnectionError as exc:
            print(f"loom bench: the caching-off server stopped answering ({exc})", file=sys.stderr)
            return False
    return True


def fraction(text: str) -> float:
    value = float(text)
    if not (0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value
