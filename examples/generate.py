"""Generate from a prompt through Loom's paged model runner (greedy), offline.

    python examples/generate.py "What is the capital of France?" --max-tokens 64

Loads the default model (SmolLM2-135M-Instruct, converted once into the model cache), applies its
chat template, prefills the prompt in one step and decodes one token per step, every token's K/V
living in blocks handed out by the BlockManager.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.core.sampling_params import SamplingParams
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model.loader import ModelConfig
from loom.model.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=None, help="HF folder, hub id or GGUF file")
    parser.add_argument("--model-cache", type=Path, default=None, help="converted-model cache")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    config = ModelConfig(
        model=args.model, model_cache=args.model_cache, device=args.device, dtype=args.dtype
    )
    started = time.perf_counter()
    loaded = config.load()
    print(f"loaded {loaded.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    tokenizer = loaded.tokenizer
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )

    block_size = 16
    num_blocks = 1 + -(-(len(prompt) + args.max_tokens) // block_size)
    runner = ModelRunner(loaded, CacheConfig(num_blocks=num_blocks, block_size=block_size))
    manager = BlockManager(num_blocks=num_blocks, block_size=block_size)

    token_ids, num_computed, output, shown = prompt, 0, [], ""
    greedy = SamplingParams(temperature=0)
    started = time.perf_counter()
    while len(output) < args.max_tokens:
        if not manager.allocate("example", len(token_ids)):
            raise RuntimeError("KV pool exhausted")
        step = ScheduledSequence(
            request_id="example",
            token_ids=tuple(token_ids[num_computed:]),
            num_computed_tokens=num_computed,
            block_table=manager.block_table("example"),
            sampling=SamplingInput(
                params=greedy, num_output_tokens=len(output), eos_token_ids=loaded.eos_token_ids
            ),
        )
        (next_token,) = runner.execute_model(SchedulerOutput(sequences=(step,))).token_ids
        num_computed = len(token_ids)
        if next_token in loaded.eos_token_ids:
            break
        output.append(next_token)
        token_ids = prompt + output
        text = tokenizer.decode(output, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    elapsed = time.perf_counter() - started
    manager.free("example")
    print(f"\n[{len(output)} tokens in {elapsed:.2f} s: {len(output) / elapsed:.1f} tok/s]")


if __name__ == "__main__":
    main()
