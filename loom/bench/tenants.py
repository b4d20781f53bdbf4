"""`loom bench --tenants HEAVY:LIGHT`: two tenants on one server, the heavy one sending HEAVY/LIGHT
times the light one's load (concurrency and requests), both from the start, each named by the
`loom-tenant` header of a launched server that trusts this host (--trusted-proxies 127.0.0.1).

Three runs, each on a fresh server: the light tenant alone; both under the fair scheduler; both
under FCFS. Reported: the light tenant's TTFT p50/p99 and output throughput in each, its share
of the tokens served while both ran, and the total throughput fair against FCFS (what fairness
costs).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from loom.bench.metrics import Objectives, summarize
from loom.bench.serving import drive, launched_process, make_workload
from loom.client.channel import Client
from loom.model.loader import LoadedModel

HOST = "127.0.0.1"


def ratio_of(text: str) -> int:
    """`4:1` → 4 (the heavy tenant's load over the light one's: a whole number, at least 1)."""
    heavy, _, light = text.partition(":")
    try:
        value, base = int(heavy), int(light or "1")
    except ValueError:
        raise ValueError(f"--tenants takes HEAVY:LIGHT, e.g. 4:1, got {text!r}") from None
    if base != 1 or value < 1:
        raise ValueError(
            f"--tenants: the light tenant's load is 1, the heavy one's at least 1: {text!r}"
        )
    return value


def run_tenants(
    args: argparse.Namespace, loaded: LoadedModel, serve_args: list[str], concurrency: int
) -> dict[str, Any]:
    ratio = ratio_of(args.tenants)
    num_light = args.num_prompts or concurrency
    light = make_workload(loaded.tokenizer, num_light, args.input_len, args.output_len, args.seed)
    heavy = make_workload(
        loaded.tokenizer, num_light * ratio, args.input_len, args.output_len, args.seed + 1
    )
    shape = {"light": (light, concurrency), "heavy": (heavy, concurrency * ratio)}
    serve = [*serve_args, "--trusted-proxies", HOST]
    result: dict[str, Any] = {"ratio": ratio, "concurrency": concurrency}
    result["alone"] = served(serve, {"light": shape["light"]}, "fair")
    result["fair"] = served(serve, shape, "fair")
    result["fcfs"] = served(serve, shape, "fcfs")
    return result


def served(serve_args: list[str], tenants: dict[str, Any], policy: str) -> dict[str, Any]:
    """A fresh server under `policy`; every tenant's workload at once: each one's summary."""
    with launched_process([*serve_args, "--scheduling-policy", policy]) as (port, _):

        async def run_all() -> list[Any]:
            runs = [
                drive(
                    HOST,
                    port,
                    workload,
                    concurrency=concurrency,
                    request_rate=float("inf"),
                    seed=0,
                    progress=False,
                    client=Client(metadata={"loom-tenant": name}),
                )
                for name, (workload, concurrency) in tenants.items()
            ]
            return list(await asyncio.gather(*runs))

        runs = asyncio.run(run_all())
    return {
        name: summarize(timings, duration, Objectives())
        for name, (timings, duration, _) in zip(tenants, runs, strict=True)
    }


def report_tenants(result: dict[str, Any]) -> None:
    print(
        f"\nTwo tenants, the heavy one at {result['ratio']}x the light one's load "
        f"(light concurrency {result['concurrency']}):"
    )
    print(
        "| run | light TTFT p50 ms | light TTFT p99 ms | light tok/s | light share | total tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for run in ("alone", "fair", "fcfs"):
        figures = result[run]
        light = figures["light"]
        total = sum(f["output_tokens"] for f in figures.values())
        seconds = max(f["duration_s"] for f in figures.values())
        # While both ran: the light tenant's tokens over all tokens served in its duration.
        heavy = figures.get("heavy")
        share = (
            light["output_throughput"]
            / (light["output_throughput"] + heavy["output_tokens"] / heavy["duration_s"])
            if heavy
            else 1.0
        )
        print(
            f"| {run} | {light['ttft_ms']['p50']:.0f} | {light['ttft_ms']['p99']:.0f} | "
            f"{light['output_throughput']:.1f} | {share:.2f} | {total / seconds:.1f} |"
        )
