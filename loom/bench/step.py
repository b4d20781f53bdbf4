"""`loom bench-step`: the model runner's decode step, timed whole and part by part.

Where a step's time goes, without a server: for each batch size, S sequences decode one token
each over `--context` cached tokens (the pool filled with random values, blocks scattered over
it), and the step is timed whole (`ModelRunner.execute_model`, greedy sampling included) and by
part, each part over all layers with the model's real weights: the linear layers, the LM head,
attention (K/V write, gather, SDPA). What is left (norms, rotary, residual adds, sampling,
Python, and the parts slowing each other down through the caches) is the difference. Where a
step's layers go into the kernels in one call (q4), "per op" is the same step with them called
one by one from Python, as the other methods are, and "regions" the one call with each kernel in
a parallel region of its own rather than the layers in one, all timed in turn: the differences
are the dispatch and the regions' starts saved. With `--drafts K`, "verify" is the step of
speculative decoding: each sequence computes its token and K draft tokens and samples at all
K + 1 positions, timed in turn with the others. A prefill step of `--prefill` prompts of
`--prompt-len` tokens is timed whole. Figures are medians of `--repeats`, each the wall time
with the GPU's work done (on CUDA the device is synchronised around each call).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from loom.bench.command import counts
from loom.core.config import CacheConfig
from loom.core.sampling_params import SamplingParams
from loom.core.setting import at_least
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model.attention import paged_attention, write_kv
from loom.model.device import resolve_device, resolve_dtype
from loom.model.linear import METHODS, check_method
from loom.model.loader import load_model
from loom.model.model_runner import ModelRunner

GREEDY = SamplingInput(params=SamplingParams(temperature=0), num_output_tokens=0, eos_token_ids=())

BLOCK_SIZE = 16


def add_parser(commands: Any) -> argparse.ArgumentParser:
    bench: argparse.ArgumentParser = commands.add_parser(
        "bench-step",
        help="time the model runner's decode step, part by part",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    add = bench.add_argument
    add("--model", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    add("--sequences", default="1,8,64", help="comma-separated batch sizes (default: 1,8,64)")
    add("--context", type=int, default=192, help="cached tokens per sequence (default: 192)")
    add("--prefill", type=int, default=4, help="prompts in the prefill step (default: 4)")
    add("--prompt-len", type=int, default=128, help="tokens per prefill prompt (default: 128)")
    add("--repeats", type=int, default=10, help="timings per figure (default: 10)")
    add("--drafts", type=int, default=0, help="draft tokens a verify step takes (default: 0)")
    add("--device", default="auto", help="auto, cpu, cuda[:N]")
    add("--dtype", default="auto", help="auto (float32 on cpu, bfloat16 on cuda) or a dtype name")
    add("--quantization", default="none", choices=METHODS, help="as loom serve's (default: none)")
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=attrs.fields(CacheConfig).kv_cache_dtype.metadata["choices"],
        help="as loom serve's (default: auto, the model's)",
    )
    add(
        "--decode-attention",
        default="in-place",
        choices=("in-place", "gather"),
        help="decode attention reading the pool in place where it can (the default), or "
        "gathering each sequence's blocks into a copy for SDPA, as before",
    )
    return bench


def run(args: argparse.Namespace) -> None:
    sizes = counts("--sequences", args.sequences)
    at_least(0)("--context", args.context)
    for flag, value in [("--prefill", args.prefill), ("--prompt-len", args.prompt_len)]:
        at_least(1)(flag, value)
    at_least(1)("--repeats", args.repeats)
    at_least(0)("--drafts", args.drafts)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_method(args.quantization, device, dtype)
    loaded = load_model(args.model, dtype=dtype, device=device)
    loaded = attrs.evolve(loaded, quantization=args.quantization)
    blocks_per_seq = -(-(args.context + 1 + args.drafts) // BLOCK_SIZE)
    blocks_per_prompt = -(-args.prompt_len // BLOCK_SIZE)
    num_blocks = 1 + 2 * max(blocks_per_seq * max(sizes), blocks_per_prompt * args.prefill)
    cache = CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_cache_dtype=args.kv_cache_dtype
    )
    runner = ModelRunner(loaded, cache)
    cache_dtype = runner.kv_cache_shape.dtype
    if args.decode_attention == "gather":
        runner.model.decode_in_place = False
    for layer in runner.kv_cache.k + runner.kv_cache.v:
        layer.normal_()  # written pages, as in a server that has been running
    print(
        f"decode step, quantization {args.quantization}, "
        f"KV pool {str(cache_dtype).removeprefix('torch.')}, decode attention "
        f"{'in place' if runner.model.decode_in_place else 'over gathered blocks'}, "
        f"{args.context} tokens cached per sequence; ms, median of {args.repeats}"
    )
    verify = f"verify {args.drafts}" if args.drafts else ""
    print(
        f"{'sequences':>10} {'step':>8} {'regions':>8} {'per op':>8} {'linear':>8} {'LM head':>8} "
        f"{'attention':>10} {'rest':>8} {verify:>9}"
    )
    for num_seqs in sizes:
        parts = decode_parts(runner, num_seqs, args.context, args.repeats, args.drafts)
        rest = parts["step"] - parts["linear"] - parts["lm_head"] - parts["attention"]
        verified = f"{parts['verify']:>9.2f}" if args.drafts else ""
        print(
            f"{num_seqs:>10} {parts['step']:>8.2f} {parts['regions']:>8.2f} "
            f"{parts['per_op']:>8.2f} {parts['linear']:>8.2f} {parts['lm_head']:>8.2f} "
            f"{parts['attention']:>10.2f} {rest:>8.2f} {verified}"
        )
    prompts = scheduled(runner, args.prefill, 0, args.prompt_len, prefill=True)
    prefill_ms = median_ms(lambda: runner.execute_model(prompts), max(2, args.repeats // 3))
    print(f"prefill step, {args.prefill} prompts of {args.prompt_len} tokens: {prefill_ms:.0f} ms")


def scheduled(
    runner: ModelRunner,
    num_seqs: int,
    context: int,
    new_tokens: int,
    *,
    prefill: bool = False,
    drafts: int = 0,
) -> SchedulerOutput:
    """Greedy sequences over blocks taken at random from the pool (block 0 is the null block),
    each decoding one token (and verifying `drafts` draft tokens) or prefilling `new_tokens`."""
    per_seq = -(-(context + new_tokens + drafts) // BLOCK_SIZE)
    blocks = (torch.randperm(runner.num_blocks - 1)[: num_seqs * per_seq] + 1).tolist()
    sequences = [
        ScheduledSequence(
            request_id=str(i),
            token_ids=tuple(range(5, 5 + new_tokens)) if prefill else (5, *range(6, 6 + drafts)),
            num_computed_tokens=context,
            block_table=tuple(blocks[i * per_seq : (i + 1) * per_seq]),
            sampling=GREEDY,
            draft_token_ids=tuple(range(6, 6 + drafts)),
        )
        for i in range(num_seqs)
    ]
    return SchedulerOutput(sequences=tuple(sequences))


@torch.inference_mode()
def decode_parts(
    runner: ModelRunner, num_seqs: int, context: int, repeats: int, drafts: int = 0
) -> dict[str, float]:
    model, cache = runner.model, runner.kv_cache
    step = scheduled(runner, num_seqs, context, 1)
    metadata = runner.attention_metadata(step.sequences)
    dtype, hidden_size = model.dtype, model.hidden_size
    x = torch.randn(num_seqs, hidden_size, dtype=dtype, device=runner.device)
    intermediate = model.layers[0].gate_up(x).shape[1] // 2
    h = torch.randn(num_seqs, intermediate, dtype=dtype, device=runner.device)
    q = torch.randn(num_seqs, model.num_heads, model.head_dim, dtype=dtype, device=runner.device)
    kv = torch.randn(num_seqs, model.num_kv_heads, model.head_dim, dtype=dtype, device=x.device)

    def linears() -> None:
        for layer in model.layers:
            layer.qkv(x), layer.o(q.view(num_seqs, -1)), layer.gate_up(x), layer.down(h)

    def attention() -> None:
        for k_cache, v_cache in zip(cache.k, cache.v, strict=True):
            write_kv(k_cache, v_cache, kv, kv, metadata.slot_mapping)
            paged_attention(q, k_cache, v_cache, metadata, model.scale)

    timed: dict[str, Callable[[], object]] = {
        "step": lambda: runner.execute_model(step),
        "per_op": altered(runner, step, decode_weights=None),  # the kernels one by one
        "regions": altered(runner, step, one_region=False),  # each in a region of its own
    }
    if drafts:
        verify = scheduled(runner, num_seqs, context, 1, drafts=drafts)
        timed["verify"] = lambda: runner.execute_model(verify)
    steps = alternating_ms(timed, repeats)
    return {
        **steps,
        "linear": median_ms(linears, repeats),
        "lm_head": median_ms(lambda: model.lm_head(x), repeats),
        "attention": median_ms(attention, repeats),
    }


def altered(runner: ModelRunner, step: SchedulerOutput, **changes: object) -> Callable[[], None]:
    """The step run with the model's attributes `changes` (and as they were again after)."""

    def run_altered() -> None:
        saved = {name: getattr(runner.model, name) for name in changes}
        for name, value in changes.items():
            setattr(runner.model, name, value)
        try:
            runner.execute_model(step)
        finally:
            for name, value in saved.items():
                setattr(runner.model, name, value)

    return run_altered


def alternating_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's median, the functions timed in turn, so that a drift in the machine's
    speed falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            times[name].append(wall_ms(fn))
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(wall_ms(fn) for _ in range(repeats))


def wall_ms(fn: Callable[[], object]) -> float:
    """`fn`'s wall time in ms, its GPU work done: on CUDA a step returns once its kernels are
    launched, so the device is synchronised before and after (a no-op where CUDA is unused)."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return (time.perf_counter() - start) * 1000


def synchronize() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
