"""Run Loom's engine on the default model with several prompts at once, streaming each answer.

    python examples/stream.py "What is the capital of France?" "Name three colours." --max-tokens 48

Every prompt is its own request in one continuously batched engine; tokens are printed as they
arrive, each line prefixed with its request's number.
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

from loom.core.config import CacheConfig
from loom.core.prompt import ChatMessage
from loom.core.sampling_params import SamplingParams
from loom.engine.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.loader import ModelConfig

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Why is the sky blue? One sentence.",
]


async def stream_one(engine: Engine, number: int, prompt: str, sampling: SamplingParams) -> None:
    line = ""
    async with engine.generate([ChatMessage(role="user", content=prompt)], sampling) as outputs:
        async for output in outputs:
            line += output.text
            while "\n" in line:
                head, line = line.split("\n", 1)
                print(f"[{number}] {head}", flush=True)
            if output.finished:
                print(f"[{number}] {line}  <{output.finish_reason}>", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    parser.add_argument("--model", default=None, help="HF folder, hub id or GGUF file")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    model = ModelConfig(model=args.model, device=args.device, dtype=args.dtype)
    engine = Engine(EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20)), model.load)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        started = time.perf_counter()
        async with trio.open_nursery() as clients:
            for number, prompt in enumerate(args.prompts, 1):
                clients.start_soon(stream_one, engine, number, prompt, sampling)
        elapsed = time.perf_counter() - started
        stats = engine.stats()
        print(
            f"\n{stats.num_generated_tokens} tokens for {len(args.prompts)} requests in "
            f"{elapsed:.1f} s ({stats.num_generated_tokens / elapsed:.1f} tok/s)",
            file=sys.stderr,
        )
        engine.drain()


if __name__ == "__main__":
    trio.run(main)
