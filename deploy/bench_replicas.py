"""Requests per second through nginx with 1, 2 and 4 Loom replicas (BENCHMARKS.md run J).

Each replica is `loom serve --model sim` whose step is a sleep (a step costs 50 ms and holds at
most 8 sequences), so that one replica's throughput is bounded by its batch, not by the two
cores; nginx (deploy/nginx/nginx.conf, started as the tests start it) balances them by least
connections; `loom bench` drives 64 concurrent streams through it. The same workload against
one replica directly gives what the proxy costs; so do five alternating pairs with a
zero-latency sim (the machine's CPU is the only limit, so the proxy's own CPU shows).

    .venv/bin/python deploy/bench_replicas.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loom.bench.serving import launched_process
from tests.support.nginx_front import nginx_front

SIM = ["--model", "sim:step_ms=50,seq_ms=0,token_ms=0", "--max-num-seqs", "8"]
BENCH = ["--model", "sim", "--concurrency", "64", "--num-prompts", "256", "--warmup", "8"]
BENCH += ["--input-len", "16", "--output-len", "16"]
FAST = ["--model", "sim:step_ms=0,seq_ms=0,token_ms=0", "--max-num-seqs", "64"]


def bench(port: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "loom", "bench", "--address", f"127.0.0.1:{port}"]
        command += [*BENCH, *extra, "--json", out.name]
        subprocess.run(command, check=True, capture_output=True)
        (run,) = json.loads(Path(out.name).read_text())["runs"]
    return dict(run["loom"])


def main() -> None:
    rows = []
    for replicas in (1, 2, 4):
        with ExitStack() as stack:
            ports = [stack.enter_context(launched_process(SIM))[0] for _ in range(replicas)]
            if replicas == 1:
                rows.append(("1, direct", bench(ports[0])))
            rows.append((f"{replicas}, nginx", bench(stack.enter_context(nginx_front(ports)))))
    print_rows(rows)
    print_proxy_cost()


def print_proxy_cost(pairs: int = 5) -> None:
    """Zero-latency sim, direct and through nginx, alternated: on 2 shared cores one pair
    swings widely, so the medians of `pairs` pairs, with their ranges."""
    longer = ("--output-len", "64", "--num-prompts", "128")
    runs: dict[str, list[float]] = {"direct": [], "nginx": []}
    with ExitStack() as stack:
        (port, _) = stack.enter_context(launched_process(FAST))
        front = stack.enter_context(nginx_front([port]))
        for _ in range(pairs):
            runs["direct"].append(bench(port, longer)["output_throughput"])
            runs["nginx"].append(bench(front, longer)["output_throughput"])
    print(f"\nzero-latency sim, 64 streams, {pairs} alternating pairs: tok/s")
    for name, values in runs.items():
        median = statistics.median(values)
        spread = f"{min(values):.0f} to {max(values):.0f}"
        print(f"{name}: median {median:.0f} ({spread}), {1e6 / median:.1f} µs a message")


def print_rows(rows: list[tuple[str, dict[str, Any]]]) -> None:
    print("| replicas | req/s | tok/s | TTFT p50 ms | ITL p50 ms | e2e p50 ms | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(
            f"| {name} | {r['request_throughput']:.1f} | {r['output_throughput']:.0f} | "
            f"{r['ttft_ms']['p50']:.0f} | {r['itl_ms']['p50']:.1f} | {r['e2e_ms']['p50']:.0f} |"
            f" {r['failed']} |"
        )


if __name__ == "__main__":
    main()
