"""`loom bench`, one concurrency level: the workload, the run on Loom, the baselines asked for,
the run on a server without prefix caching (--compare-prefix-caching), and the printed tables."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from typing import Any

import attrs

from loom.bench.baseline import run_baseline
from loom.bench.fronts import Constraining, Front, GrpcFront, OpenAIFront, ProcessCpu
from loom.bench.llama_cpp import drive_llama_server
from loom.bench.metrics import Objectives, summarize, table
from loom.bench.serving import (
    Conversations,
    Workload,
    drive,
    drive_conversations,
    make_conversations,
    make_rewrite_workload,
    make_shared_prefix_workload,
    make_workload,
)
from loom.client.channel import Client
from loom.model.loader import LoadedModel

# The warm-up's prompts: none of a measured run's (whose seeds are --seed + concurrency; Python
# seeds a generator with an integer's absolute value, so a negative offset would not do).
WARM_UP_SEED = 10**9
SECOND_RUN_SEED = 10**6


@attrs.frozen(kw_only=True)
class Target:
    """The server driven: its gRPC port, its HTTP API's, and its process when launched."""

    host: str
    port: int
    http_port: int | None = None
    pid: int | None = None

    def fronts(self, args: argparse.Namespace, tokenizer: Any = None) -> list[Front]:
        """The fronts `--api` asks for, gRPC first (`tokenizer`: for --text-prompts)."""
        share = Constraining(fraction=args.constrained_fraction)
        grpc = GrpcFront(host=self.host, port=self.port, client=Client.of(args), constraining=share)
        if args.api == "grpc":
            return [grpc]
        if self.http_port is None:
            raise ValueError("--api openai: the server has no HTTP API port")
        openai = OpenAIFront(
            host=self.host,
            port=self.http_port,
            api_key=args.api_key,
            constraining=share,
            decode=tokenizer.decode if args.text_prompts else None,
            model=served_model(self.host, self.http_port, args.api_key),
        )
        return [openai] if args.api == "openai" else [grpc, openai]


def served_model(host: str, port: int, api_key: str | None) -> str:
    """The model's name at an HTTP API (its first, from GET /v1/models): a request must name
    it to a gateway (SMG)."""
    request = urllib.request.Request(f"http://{host}:{port}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def measure(
    args: argparse.Namespace,
    loaded: LoadedModel,
    pad: int,
    goals: Objectives,
    target: Target,
    llama_ports: dict[str, int],
    concurrency: int,
) -> dict[str, Any]:
    """One concurrency level: warm up, drive the server (through each front asked for, one
    after the other: "loom" is the first, "openai" the HTTP API's beside gRPC's), then the
    baselines asked for."""
    result: dict[str, Any] = {"concurrency": concurrency}
    for run, (key, front) in enumerate(
        zip(("loom", "openai"), target.fronts(args, loaded.tokenizer), strict=False)
    ):
        workload = make_workload_of(args, loaded, concurrency, run)
        cpu = ProcessCpu(pid=target.pid) if target.pid is not None else None
        before = cpu.sample() if cpu is not None else (0.0, 0.0)
        timings, duration, server = run_workload(args, loaded, target, workload, concurrency, front)
        figures = summarize(timings, duration, goals) | {"server": server, "api": front.name}
        if cpu is not None:
            tokens = sum(len(t.token_times) for t in timings if t.ok)
            figures |= cpu_per_token(cpu.sample(), before, tokens)
        result[key] = figures
        result.setdefault("title", title_of(args, workload, server, concurrency))
    first = make_workload_of(args, loaded, concurrency)  # the baselines': the first run's
    if isinstance(first, Workload):
        result |= baselines(args, loaded, pad, goals, first, llama_ports, concurrency)
    return result


def measure_caching_off(
    args: argparse.Namespace,
    loaded: LoadedModel,
    goals: Objectives,
    target: Target,
    result: dict[str, Any],
) -> None:
    """The same level's workload on the server without prefix caching, into `result`."""
    concurrency = result["concurrency"]
    workload = make_workload_of(args, loaded, concurrency)
    front = GrpcFront(host=target.host, port=target.port, client=Client.of(args))
    timings, duration, server = run_workload(args, loaded, target, workload, concurrency, front)
    result["caching_off"] = summarize(timings, duration, goals) | {"server": server}


def report(result: dict[str, Any]) -> None:
    """Print one level's tables: Loom beside transformers, the caching-off server, llama.cpp."""
    print(table(result["title"], result["loom"], result.get("baseline"), "transformers"))
    if "openai" in result:
        grpc, http = result["loom"], result["openai"]
        print(table("", grpc, http, "HTTP API"))
        for label, key in (
            ("CPU ms/token", "cpu_ms_per_token"),
            ("front ms/token", "front_ms_per_token"),
        ):
            if key in grpc:
                print(f"{label:<16}{grpc[key]:>12.3f}{http[key]:>12.3f}")
    if "caching_off" in result:
        on, off = result["loom"]["server"], result["caching_off"]["server"]
        print(table("", result["loom"], result["caching_off"], "caching off"))
        for what in ("computed", "cached"):
            key = f"prompt_tokens_{what}"
            print(f"{'prompt tokens ' + what:<24}{on[key]:>12}{off[key]:>12}")
    for name, figures in result.get("llama_cpp", {}).items():
        print(f"llama.cpp on {name}")
        print(table("", result["loom"], figures, "llama.cpp"))
    sys.stdout.flush()


def make_workload_of(
    args: argparse.Namespace, loaded: LoadedModel, concurrency: int, run: int = 0
) -> Workload | Conversations:
    """The level's workload; `run` 1 (the second front's) is the same workload on prompts of
    its own, so that it finds nothing the first left in the prefix cache."""
    n, seed = args.num_prompts or concurrency, args.seed + concurrency + run * SECOND_RUN_SEED
    tokenizer, input_len, output_len = loaded.tokenizer, args.input_len, args.output_len
    if args.workload == "shared-prefix":
        return make_shared_prefix_workload(
            tokenizer, n, args.prefix_len, input_len, output_len, seed
        )
    if args.workload == "multi-turn":
        return make_conversations(tokenizer, concurrency, args.turns, input_len, output_len, seed)
    if args.workload == "rewrite":
        return make_rewrite_workload(tokenizer, n, input_len, output_len, seed)
    return make_workload(tokenizer, n, input_len, output_len, seed)


def run_workload(
    args: argparse.Namespace,
    loaded: LoadedModel,
    target: Target,
    workload: Workload | Conversations,
    concurrency: int,
    front: Front,
) -> tuple[list[Any], float, dict[str, int]]:
    """Warm the server up on prompts of its own (so that the measured prompts find nothing in
    its prefix cache that they did not put there), then run the workload through `front`."""
    host, port = target.host, target.port
    client = Client.of(args)
    seed = WARM_UP_SEED + args.seed
    warm = make_workload(loaded.tokenizer, args.warmup, args.input_len, 8, seed)
    warm_up(host, port, warm, client, front)
    if isinstance(workload, Conversations):
        return asyncio.run(drive_conversations(host, port, workload, client=client, front=front))
    return asyncio.run(
        drive(
            host,
            port,
            workload,
            concurrency=concurrency,
            request_rate=args.request_rate,
            seed=args.seed,
            client=client,
            front=front,
        )
    )


def cpu_per_token(
    after: tuple[float, float], before: tuple[float, float], tokens: int
) -> dict[str, float]:
    """The server's CPU time per output token over a run: all of it, and its front thread's."""
    per = 1000 / max(tokens, 1)
    return {
        "cpu_ms_per_token": (after[0] - before[0]) * per,
        "front_ms_per_token": (after[1] - before[1]) * per,
    }


def title_of(
    args: argparse.Namespace,
    workload: Workload | Conversations,
    server: dict[str, int],
    concurrency: int,
) -> str:
    if isinstance(workload, Conversations):
        what = (
            f"{len(workload.turns)} conversations of {args.turns} turns, {args.input_len} new "
            f"prompt tokens a turn + {args.output_len} output tokens"
        )
    elif args.workload == "shared-prefix":
        what = (
            f"{len(workload.prompts)} requests, {args.prefix_len} shared + {args.input_len} "
            f"distinct prompt tokens + {args.output_len} output tokens"
        )
    else:
        what = (
            f"{len(workload.prompts)} requests, {args.input_len} prompt + {args.output_len} "
            "output tokens"
        )
    if args.constrained_fraction:
        what += f", {args.constrained_fraction:.0%} constrained by a JSON schema"
    if server.get("spec_drafts"):  # vLLM's acceptance rate and mean accepted length
        rate = server["spec_accepted_tokens"] / server["spec_draft_tokens"]
        length = 1 + server["spec_accepted_tokens"] / server["spec_drafts"]
        what += f"; drafts accepted {rate:.1%}, mean accepted length {length:.2f}"
    return (
        f"\n== {args.workload}, concurrency {concurrency}: {what}; "
        f"KV blocks used at most {server['max_used_blocks']}/{server['num_total_blocks']}, "
        f"preemptions {server['num_preemptions']}"
    )


def baselines(
    args: argparse.Namespace,
    loaded: LoadedModel,
    pad: int,
    goals: Objectives,
    workload: Workload,
    llama_ports: dict[str, int],
    concurrency: int,
) -> dict[str, Any]:
    """transformers' `generate` (`--baseline`) and llama.cpp's servers (`--llama-server`), by
    GGUF file name."""
    result: dict[str, Any] = {}
    if args.baseline:
        base_timings, base_duration = run_baseline(loaded.model, pad, workload, concurrency)
        result["baseline"] = summarize(base_timings, base_duration, goals)
    for name, port in llama_ports.items():
        warm = Workload(prompts=workload.prompts[: args.warmup], output_len=8)
        drive_llama_server(port, warm, 1)  # unmeasured, as Loom's warm-up
        llama_timings, llama_duration = drive_llama_server(port, workload, concurrency)
        result.setdefault("llama_cpp", {})[name] = summarize(llama_timings, llama_duration, goals)
    return result


def warm_up(host: str, port: int, workload: Workload, client: Client, front: Front) -> None:
    """Unmeasured requests, one at a time, so that the measured run starts warm."""
    once = drive(
        host,
        port,
        workload,
        concurrency=1,
        request_rate=float("inf"),
        seed=0,
        progress=False,
        client=client,
        front=front,
    )
    asyncio.run(once)
