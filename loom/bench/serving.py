"""`loom bench`: drive a Loom server with concurrent streaming clients (gRPC or OpenAI's HTTP API,
loom/bench/fronts.py) on a fixed workload.

The standard workload (BENCHMARKS.md): prompts of exactly `input_len` tokens, distinct, sent as
token ids; exactly `output_len` tokens generated (ignore_eos); greedy. `rewrite` is for
speculative decoding: each prompt asks (in the model's chat template) for a passage of exactly
`input_len` tokens of the shipped text (loom/bench/data/perplexity.txt, distinct passages) to
be written out again, so that the answer repeats its prompt, as a rewrite, an extraction or an
edit does. Two more for prefix caching: `shared-prefix` puts one common `prefix_len`-token
text (a system prompt) before each distinct prompt; `multi-turn` holds `concurrency`
conversations of `turns` turns, each turn resending the whole history (earlier prompts and
replies, as token ids) plus `input_len` new
tokens. Requests arrive all at once or as a Poisson process at `request_rate`, at most
`concurrency` in flight, one channel per concurrent client. While it runs, GetServerStats is
polled for KV usage and preemptions. With `--baseline`, the same prompts also go through
transformers' `generate` in static batches of `concurrency` (this process, same machine, same
run) for a ratio per figure.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from loom.bench.fronts import Front, GrpcFront
from loom.bench.metrics import RequestTiming
from loom.bench.server_watch import ServerWatch
from loom.client.channel import PLAIN, Client

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


@attrs.frozen(kw_only=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]
    output_len: int


def make_workload(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, seed: int
) -> Workload:
    """Distinct prompts of exactly `input_len` tokens: numbered texts of random words; without
    a tokenizer (the simulated model), random token ids below 1000, the first one numbering
    the prompt."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        if tokenizer is None:
            rest = (rng.randrange(1, 1000) for _ in range(input_len - 1))
            prompts.append((1000 + i, *rest)[:input_len])
            continue
        text = f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(2 * input_len))
        ids = tokenizer.encode(text)[:input_len]
        if len(ids) < input_len:
            raise ValueError(f"could not make a prompt of {input_len} tokens")
        prompts.append(tuple(ids))
    return Workload(prompts=tuple(prompts), output_len=output_len)


REWRITE = "Write out the following text again, word for word, without any change:\n\n{}"
TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def make_rewrite_workload(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, seed: int
) -> Workload:
    """Prompts asking for a passage of `input_len` tokens to be written out again (in the
    model's chat template, so a few tokens more); passages start at distinct random tokens of
    the shipped text, its paragraphs unwrapped. Without a tokenizer (the simulated model): the
    standard prompts."""
    if tokenizer is None:
        return make_workload(tokenizer, num_prompts, input_len, output_len, seed)
    # Paragraphs on one line each, as prose in a chat is (the file wraps at 70 columns).
    paragraphs = (" ".join(p.split()) for p in TEXT.read_text().split("\n\n"))
    text = tokenizer.encode("\n\n".join(p for p in paragraphs if p), add_special_tokens=False)
    starts = random.Random(seed).sample(range(len(text) - input_len), num_prompts)
    prompts = []
    for start in starts:
        passage = tokenizer.decode(text[start : start + input_len])
        messages = [{"role": "user", "content": REWRITE.format(passage)}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tuple(tokenizer.encode(chat, add_special_tokens=False)))
    return Workload(prompts=tuple(prompts), output_len=output_len)


def make_shared_prefix_workload(
    tokenizer: Any, num_prompts: int, prefix_len: int, input_len: int, output_len: int, seed: int
) -> Workload:
    """One common `prefix_len`-token text, then `input_len` distinct tokens, in every prompt."""
    (prefix,) = make_workload(tokenizer, 1, prefix_len, output_len, seed + 1).prompts
    distinct = make_workload(tokenizer, num_prompts, input_len, output_len, seed)
    return attrs.evolve(distinct, prompts=tuple(prefix + p for p in distinct.prompts))


@attrs.frozen(kw_only=True)
class Conversations:
    """Each conversation's user turns (distinct token ids); the replies come from the server."""

    turns: tuple[tuple[tuple[int, ...], ...], ...]
    output_len: int

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.turns)


def make_conversations(
    tokenizer: Any, num_conversations: int, turns: int, input_len: int, output_len: int, seed: int
) -> Conversations:
    messages = make_workload(tokenizer, num_conversations * turns, input_len, output_len, seed)
    user = messages.prompts
    return Conversations(
        turns=tuple(tuple(user[c * turns : (c + 1) * turns]) for c in range(num_conversations)),
        output_len=output_len,
    )


async def drive(
    host: str,
    port: int,
    workload: Workload,
    *,
    concurrency: int,
    request_rate: float,
    seed: int,
    progress: bool = True,
    client: Client = PLAIN,
    front: Front | None = None,
) -> tuple[list[RequestTiming], float, dict[str, int]]:
    """Run the workload through `front` (gRPC at `host:port`, by default); returns the
    timings, the wall time and what the server's stats showed."""
    through: Front = front or GrpcFront(host=host, port=port, client=client)
    channels = [through.open() for _ in range(concurrency)]
    free = asyncio.Queue[Any]()
    for channel in channels:
        free.put_nowait(channel)
    rng = random.Random(seed)
    bar = tqdm(
        total=len(workload.prompts),
        disable=not progress,
        desc=f"concurrency {concurrency}",
        file=sys.stderr,
    )
    server = await ServerWatch.started(host, port, client)
    watcher = asyncio.create_task(server.watch())

    async def run_one(prompt: tuple[int, ...], channel: Any) -> RequestTiming:
        try:
            return await through.request(channel, prompt, workload.output_len, None)
        finally:
            free.put_nowait(channel)
            bar.update()

    start = time.perf_counter()
    tasks = []
    for prompt in workload.prompts:
        channel = await free.get()
        tasks.append(asyncio.create_task(run_one(prompt, channel)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    timings = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    watcher.cancel()
    bar.close()
    for channel in channels:
        await through.close(channel)
    return timings, duration, await server.summary()


async def drive_conversations(
    host: str,
    port: int,
    conversations: Conversations,
    *,
    progress: bool = True,
    client: Client = PLAIN,
    front: Front | None = None,
) -> tuple[list[RequestTiming], float, dict[str, int]]:
    """Every conversation at once, each on its own connection, its turns one after another."""
    through: Front = front or GrpcFront(host=host, port=port, client=client)
    bar = tqdm(
        total=conversations.num_requests,
        disable=not progress,
        desc=f"{len(conversations.turns)} conversations",
        file=sys.stderr,
    )
    server = await ServerWatch.started(host, port, client)
    watcher = asyncio.create_task(server.watch())
    timings: list[RequestTiming] = []

    async def talk(turns: tuple[tuple[int, ...], ...]) -> None:
        history: list[int] = []
        channel = through.open()
        try:
            for user in turns:
                history += user
                reply: list[int] = []
                output_len = conversations.output_len
                timings.append(await through.request(channel, tuple(history), output_len, reply))
                history += reply
                bar.update()
        finally:
            await through.close(channel)

    start = time.perf_counter()
    await asyncio.gather(*(talk(turns) for turns in conversations.turns))
    duration = time.perf_counter() - start
    watcher.cancel()
    bar.close()
    return timings, duration, await server.summary()


PORT_LINES = {
    "grpc": r"serving on [\w.:\[\]]+:(\d+)",
    "http": r"HTTP API on http://[\w.:\[\]]+:(\d+)",
    "metrics": r"metrics on http://[\w.:\[\]]+:(\d+)",
}


@contextmanager
def launched_process(
    serve_args: list[str],
    module: str = "loom",
    preexec_fn: Callable[[], object] | None = None,
    ports: dict[str, int] | None = None,
) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """`python -m MODULE serve --port 0 ...` in a child process (`preexec_fn` runs in it
    first); yields its port, once it serves, and the process (stopped with SIGTERM on the way
    out, unless it has exited). With `--http-port` among the flags, `ports["http"]` is the
    HTTP API's; with `--metrics-port`, `ports["metrics"]` is the metrics port's (say 0: a port
    picked here and then passed on could be taken by another process in between)."""
    # Its ports come from its INFO lines ("serving on HOST:PORT"): the log level stays info.
    command = [sys.executable, "-m", module, "serve", "--port", "0", *serve_args]
    command += ["--log-level", "info"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    assert process.stderr is not None
    reader = threading.Thread(target=process.stderr.read, daemon=True)  # keeps the pipe flowing
    found = ports if ports is not None else {}
    try:
        port = None
        for line in process.stderr:
            for name, pattern in PORT_LINES.items():
                if match := re.search(pattern, line):
                    found[name] = int(match.group(1))
            port = found.pop("grpc", port)
            if port is not None and ("--http-port" not in serve_args or "http" in found):
                break
        if port is None:
            raise RuntimeError(f"loom serve exited with {process.wait()} before serving")
        reader.start()
        yield port, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if reader.is_alive():
            reader.join(timeout=10)  # the pipe ends with the process
        process.stderr.close()
