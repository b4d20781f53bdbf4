"""The second baseline: llama.cpp's server on the same GGUF file, prompts and lengths.

`loom bench --llama-server PATH` launches PATH, llama.cpp's `llama-server` (built from the tree
vendored in the `llama-cpp-python` sdist; BENCHMARKS.md says how), on the model's GGUF file (or
on each `--llama-gguf FILE`: llama.cpp is fastest on x86 with a Q4_0 copy, which it repacks) with
as many slots as the largest concurrency and a thread per core, and drives its streaming
`/completion` endpoint as the Loom clients drive Loom: the prompts as token ids, greedy, exactly
`output_len` tokens (`ignore_eos`), no prompt cache, all requests at once with at most
`concurrency` in flight. Not a dependency of Loom and not run in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from loom.bench.metrics import RequestTiming
from loom.bench.serving import Workload
from loom.model.loader import default_model_path


@contextmanager
def launched_llama_server(
    binary: Path, gguf: Path, slots: int, tokens_per_slot: int, extra: tuple[str, ...] = ()
) -> Iterator[int]:
    """`llama-server` on a free loopback port; yields the port once /health answers 200."""
    check_llama_server(binary, gguf)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    command = [
        str(binary),
        *("--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("--parallel", str(slots), "--ctx-size", str(slots * tokens_per_slot)),
        *("--threads", str(os.cpu_count() or 1), "--no-webui"),
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(command)}")
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def launched_llama_servers(
    binary: Path, ggufs: list[Path], slots: int, tokens_per_slot: int, extra: tuple[str, ...] = ()
) -> Iterator[dict[str, int]]:
    """A llama-server per GGUF file, each with the `extra` flags; yields their ports by file
    name. Each idles while another server is measured."""
    with ExitStack() as stack:
        yield {
            gguf.name: stack.enter_context(
                launched_llama_server(binary, gguf, slots, tokens_per_slot, extra)
            )
            for gguf in ggufs
        }


def check_llama_server(binary: Path, gguf: Path) -> None:
    if not binary.is_file():
        raise ValueError(f"--llama-server: no such file: {binary}")
    if gguf.suffix != ".gguf":
        raise ValueError(f"--llama-server serves GGUF files; the model is {gguf}")
    if not gguf.is_file():
        raise ValueError(f"--llama-server: no such GGUF file: {gguf}")


def healthy(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


def one_request(port: int, prompt: tuple[int, ...], output_len: int) -> RequestTiming:
    body = {
        "prompt": list(prompt),
        "n_predict": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }
    start = time.perf_counter()
    times: list[float] = []
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        connection.request(
            "POST", "/completion", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if line.startswith(b"data: "):
                now = time.perf_counter() - start
                times.extend([now] * len(json.loads(line[6:]).get("tokens", [])))
        connection.close()
    except Exception as exc:  # a failed request is counted, not fatal to the run
        return RequestTiming.failed(prompt, exc)
    return RequestTiming(ok=True, num_prompt_tokens=len(prompt), token_times=tuple(times))


def drive_llama_server(
    port: int, workload: Workload, concurrency: int
) -> tuple[list[RequestTiming], float]:
    """All requests at once, at most `concurrency` in flight; the timings and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings = list(
            pool.map(lambda p: one_request(port, p, workload.output_len), workload.prompts)
        )
    return timings, time.perf_counter() - start


def llama_server(
    args: argparse.Namespace, concurrencies: list[int]
) -> AbstractContextManager[dict[str, int]]:
    """The llama-servers of `--llama-server`, on each `--llama-gguf` (else the model's file)."""
    ggufs = ggufs_of(args) if args.llama_server is not None else []
    tokens = args.input_len + args.output_len + 128  # the rewrite workload's chat template
    extra = tuple(shlex.split(args.llama_args))
    return launched_llama_servers(args.llama_server, ggufs, max(concurrencies), tokens, extra)


def add_llama_arguments(parser: argparse.ArgumentParser) -> None:
    """`loom bench`'s flags for llama.cpp's server."""
    add = parser.add_argument
    add(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="also drive llama.cpp's llama-server binary at PATH on the model's GGUF file, "
        "same prompts (see loom/bench/llama_cpp.py)",
    )
    add(
        "--llama-gguf",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help="the GGUF file llama-server serves (default: the model's); repeat it to compare "
        "formats, e.g. a Q4_0 copy made by llama-quantize (llama.cpp repacks Q4_0 for AVX2)",
    )
    add(
        "--llama-args",
        default="",
        metavar="FLAGS",
        help="more flags for each llama-server, e.g. its n-gram speculation: "
        '"--spec-type ngram-simple --draft-max 4"',
    )


def check_llama_flags(args: argparse.Namespace) -> None:
    if args.llama_args and args.llama_server is None:
        raise ValueError("--llama-args are flags of --llama-server: give --llama-server")
    if args.llama_gguf and args.llama_server is None:
        raise ValueError("--llama-gguf names what --llama-server serves: give --llama-server")
    if args.llama_gguf and len({g.name for g in args.llama_gguf}) < len(args.llama_gguf):
        raise ValueError("--llama-gguf: each file needs a name of its own (results go by name)")
    if args.llama_server is not None:
        for gguf in ggufs_of(args):
            check_llama_server(args.llama_server, gguf)


def ggufs_of(args: argparse.Namespace) -> list[Path]:
    return args.llama_gguf or [Path(args.model) if args.model else default_model_path()]
