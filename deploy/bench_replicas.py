"""Requests per second through nginx with 1, 2 and 4 Loom replicas (BENCHMARKS.md run J).

Each replica is `loom serve --model sim` whose step is a sleep (a step costs 50 ms and holds at
most 8 sequences), so that one replica's throughput is bounded by its batch, not by the two
cores; nginx (deploy/nginx/nginx.conf, started as the tests start it) balances them by least
connections; `loom bench` drives 64 concurrent streams through it. The same workload against
one replica directly gives what the proxy costs; so does a second pair with a zero-latency sim
(the machine's CPU is the only limit, so the proxy's own CPU shows: per request and per message).

    .venv/bin/python deploy/bench_replicas.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loom.bench.serving import launched_process
from tests.nginx_front import nginx_front

SIM = ["--model", "sim:step_ms=50,seq_ms=0,token_ms=0", "--max-num-seqs", "8"]
BENCH = ["--model", "sim", "--concurrency", "64", "--num-prompts", "256", "--warmup", "8"]
BENCH += ["--input-len", "16", "--output-len", "16"]
FAST = ["--model", "sim:step_ms=0,seq_ms=0,token_ms=0", "--max-num-seqs", "64"]


def bench(port: int, extra: tuple[str, ...] = ()) -> dict[str, float]:
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
    longer = ("--output-len", "64", "--num-prompts", "128")
    with ExitStack() as stack:
        (port, _) = stack.enter_context(launched_process(FAST))
        rows.append(("1 zero-latency, direct", bench(port, longer)))
        front = stack.enter_context(nginx_front([port]))
        rows.append(("1 zero-latency, nginx", bench(front, longer)))
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
