"""`loom bench-quality`: what each quantised method costs in quality, beside the exact path.

For each `--quantization` method, the exact `none` first as the reference:

- perplexity on a fixed text, each token scored given all the text before it: the first
  `--tokens` tokens of loom/bench/data/perplexity.txt, two sections of the Python 3.11 language
  reference ("Exceptions", "The standard type hierarchy"; © Python Software Foundation, PSF
  License), shipped so that every run scores the same tokens;
- greedy agreement on the standard prompts (`loom bench`'s, `--prompts` of `--input-len`
  tokens): the exact path's greedy continuation of `--output-len` tokens is scored by each
  method with the exact tokens fed back, and the share of positions where the method's greedy
  token is the exact path's is given, with how many continuations it reproduces whole.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import attrs
import torch

from loom.bench.serving import make_workload
from loom.core.config import CacheConfig
from loom.core.setting import at_least
from loom.core.step import ScheduledSequence
from loom.model.linear import METHODS, check_method
from loom.model.loader import LoadedModel, load_model
from loom.model.model_runner import ModelRunner

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
BLOCK_SIZE = 16
CHUNK = 512  # tokens scored per forward


def add_parser(commands: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = commands.add_parser(
        "bench-quality",
        help="perplexity and greedy agreement of each quantised method beside the exact path",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    add = bench.add_argument
    add("--model", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    add("--methods", default=",".join(METHODS[1:]), help="quantised methods to compare")
    add("--tokens", type=int, default=4096, help="tokens of the text scored (default: 4096)")
    add("--prompts", type=int, default=8, help="standard prompts (default: 8)")
    add("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    add("--output-len", type=int, default=64, help="greedy tokens compared (default: 64)")
    return bench


def run(args: argparse.Namespace) -> None:
    methods = ["none", *(m for m in args.methods.split(",") if m and m != "none")]
    at_least(2)("--tokens", args.tokens)
    for flag in ("prompts", "input_len", "output_len"):
        at_least(1)("--" + flag.replace("_", "-"), getattr(args, flag))
    loaded = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    for method in methods:
        check_method(method, loaded.device, loaded.dtype)
    text = loaded.tokenizer.encode(TEXT.read_text())[: args.tokens]
    if len(text) < args.tokens:
        raise ValueError(f"--tokens: the text has only {len(text)} tokens")
    workload = make_workload(loaded.tokenizer, args.prompts, args.input_len, args.output_len, 0)
    exact = runner_for(loaded, "none", max(len(text), args.input_len + args.output_len))
    continuations = [greedy(exact, prompt, args.output_len) for prompt in workload.prompts]
    print(f"{len(text)} tokens of {TEXT.name}; {args.prompts} prompts x {args.output_len} tokens")
    print(f"{'method':>8} {'perplexity':>11} {'vs none':>8} {'greedy agree':>13} {'whole':>6}")
    reference = 0.0
    for method in methods:
        runner = exact if method == "none" else runner_for(loaded, method, len(text))
        ppl = perplexity(runner, text)
        reference = reference or ppl
        agree, whole = agreement(runner, workload.prompts, continuations)
        print(
            f"{method:>8} {ppl:>11.3f} {(ppl / reference - 1) * 100:>+7.2f}% "
            f"{agree * 100:>12.1f}% {whole:>3}/{len(continuations)}"
        )


def runner_for(loaded: LoadedModel, method: str, max_tokens: int) -> ModelRunner:
    num_blocks = 1 + -(-max_tokens // BLOCK_SIZE)  # block 0 is the null block
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    return ModelRunner(attrs.evolve(loaded, quantization=method), cache)


def logits(runner: ModelRunner, token_ids: list[int], start: int = 0) -> torch.Tensor:
    """Logits after each of `token_ids[start:]`, the tokens before `start` already cached."""
    table = tuple(range(1, runner.num_blocks))
    seq = ScheduledSequence(
        request_id="score",
        token_ids=tuple(token_ids[start:]),
        num_computed_tokens=start,
        block_table=table[: -(-len(token_ids) // BLOCK_SIZE)],
    )
    return runner.logits(seq)


def perplexity(runner: ModelRunner, text: list[int], chunk: int = CHUNK) -> float:
    """exp of the mean negative log-likelihood of text[1:], `chunk` tokens a forward."""
    nll = 0.0
    for start in range(0, len(text) - 1, chunk):
        end = min(start + chunk, len(text) - 1)
        out = logits(runner, text[:end], start).log_softmax(dim=-1)
        targets = torch.tensor(text[start + 1 : end + 1])
        nll -= float(out.gather(1, targets[:, None]).sum())
    return math.exp(nll / (len(text) - 1))


def greedy(runner: ModelRunner, prompt: tuple[int, ...], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    start = 0
    for _ in range(num_tokens):
        tokens.append(int(logits(runner, tokens, start)[-1].argmax()))
        start = len(tokens) - 1
    return tokens[len(prompt) :]


def agreement(
    runner: ModelRunner,
    prompts: tuple[tuple[int, ...], ...],
    continuations: list[list[int]],
    chunk: int = CHUNK,
) -> tuple[float, int]:
    """The share of the exact continuations' tokens this runner would choose given the same
    tokens before them, and how many continuations it chooses whole. The prompt is one
    forward, as a server prefills it; the continuation `chunk` tokens a forward."""
    agreed = whole = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        tokens = [*prompt, *continuation[:-1]]
        parts = [logits(runner, tokens[: len(prompt)])[-1:]]
        for start in range(len(prompt), len(tokens), chunk):
            parts.append(logits(runner, tokens[: start + chunk], start))
        out = torch.cat(parts)
        matches = int((out.argmax(dim=-1) == torch.tensor(continuation)).sum())
        agreed += matches
        whole += matches == len(continuation)
    return agreed / sum(len(c) for c in continuations), whole
