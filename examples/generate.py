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

import torch

from loom.block_manager import BlockManager
from loom.device import resolve_device, resolve_dtype
from loom.loader import load_model
from loom.model_runner import ModelRunner, ScheduledSequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=None, help="HF folder, hub id or GGUF file")
    parser.add_argument("--model-cache", type=Path, default=None, help="converted-model cache")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    device = resolve_device(args.device)
    started = time.perf_counter()
    loaded = load_model(
        args.model,
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        cache_dir=args.model_cache,
    )
    print(f"loaded {loaded.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    tokenizer = loaded.tokenizer
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )

    block_size = 16
    num_blocks = 1 + -(-(len(prompt) + args.max_tokens) // block_size)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size)
    manager = BlockManager(num_blocks=num_blocks, block_size=block_size)

    token_ids, num_computed, output, shown = prompt, 0, [], ""
    started = time.perf_counter()
    while len(output) < args.max_tokens:
        if not manager.allocate("example", len(token_ids)):
            raise RuntimeError("KV pool exhausted")
        step = ScheduledSequence(
            request_id="example",
            token_ids=tuple(token_ids[num_computed:]),
            num_computed_tokens=num_computed,
            block_table=manager.block_table("example"),
        )
        logits = runner.execute([step])
        num_computed = len(token_ids)
        next_token = int(torch.argmax(logits[0]))
        if next_token == tokenizer.eos_token_id:
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
