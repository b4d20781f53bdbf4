"""Smoothing for the int8 method (SmoothQuant, Xiao et al. 2023): move the activations' outlier
channels into the weights before both are quantised, exactly in real arithmetic.

A few input channels of a linear layer carry values far larger than the rest, and one int8
scale for a row of activations spends its range on them. For each input channel j, with
activation range a_j (from running the model on a calibration text) and weight range w_j,
s_j = a_j^alpha / w_j^(1 - alpha); the activations are divided by s and the weight's column j
multiplied by it. The division is folded into what makes those activations: the RMSNorm weight
before qkv and gate_up, and v's rows before o (shared by the query heads of one KV head). The
calibration text, loom/model/data/calibration.txt, is a section of the Python 3.11 language
reference ("Compound statements"; © Python Software Foundation, PSF License), not the text
`loom bench-quality` scores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"
ALPHA = 0.7  # SmolLM2, rows scaled: the best of 0.5, 0.7 and 0.8 (BENCHMARKS.md run F)
MAX_TOKENS = 512
HOOKED = ("q_proj", "gate_proj", "o_proj")


def calibration_ids(tokenizer: Any, vocab_size: int, max_len: int) -> list[int]:
    """The calibration text's tokens; for a model without a tokenizer, fixed random ids."""
    length = min(MAX_TOKENS, max_len)
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT.read_text()))[:length]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@torch.inference_mode()
def input_ranges(hf_model: Any, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The largest |input| per channel of every q_proj, gate_proj and o_proj, over the text."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            ranges[name] = torch.maximum(ranges[name], x) if name in ranges else x

        return hook

    handles = [
        module.register_forward_pre_hook(record(name))
        for name, module in hf_model.named_modules()
        if name.rpartition(".")[2] in HOOKED
    ]
    try:
        device = next(hf_model.parameters()).device
        hf_model(torch.tensor([token_ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def smooth(
    weights: dict[str, torch.Tensor],
    ranges: dict[str, torch.Tensor],
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, torch.Tensor]:
    """A copy of the weights (transformers' names) with the smoothing folded in."""
    weights = dict(weights)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        fold_into_norm(weights, prefix + "input_layernorm.weight", attn, "qkv", ranges)
        fold_into_norm(weights, prefix + "post_attention_layernorm.weight", mlp, "gate_up", ranges)
        fold_into_values(weights, attn, ranges[attn + "o_proj"], num_heads, num_kv_heads)
    return weights


def scales(activation: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """s per input channel, from the activations' and the weight columns' ranges."""
    a, w = activation.clamp(min=1e-5), weight.abs().amax(dim=0).clamp(min=1e-5)
    return (a**ALPHA / w ** (1 - ALPHA)).clamp(min=1e-5)


def fold_into_norm(
    weights: dict[str, torch.Tensor],
    norm: str,
    prefix: str,
    kind: str,
    ranges: dict[str, torch.Tensor],
) -> None:
    names = [f"{prefix}{p}_proj.weight" for p in ("qkv" if kind == "qkv" else ("gate", "up"))]
    first = names[0].removesuffix(".weight")
    s = scales(ranges[first], torch.cat([weights[n] for n in names]))
    weights[norm] = weights[norm] / s.to(weights[norm].dtype)
    for name in names:
        weights[name] = weights[name] * s.to(weights[name].dtype)


def fold_into_values(
    weights: dict[str, torch.Tensor],
    attn: str,
    activation: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """o's input channel (head h, d) is v's row (h // group, d): one s per v row, the largest
    need of the query heads that share it."""
    group = num_heads // num_kv_heads
    o = weights[attn + "o_proj.weight"]
    head_dim = o.shape[1] // num_heads
    a = activation.view(num_kv_heads, group, head_dim).amax(dim=1)
    w = o.abs().amax(dim=0).view(num_kv_heads, group, head_dim).amax(dim=1)
    s = scales(a.reshape(-1), w.reshape(1, -1)).to(o.dtype)  # [num_kv_heads * head_dim]
    weights[attn + "v_proj.weight"] = weights[attn + "v_proj.weight"] / s[:, None]
    if attn + "v_proj.bias" in weights:
        weights[attn + "v_proj.bias"] = weights[attn + "v_proj.bias"] / s
    expanded = s.view(num_kv_heads, 1, head_dim).expand(num_kv_heads, group, head_dim)
    weights[attn + "o_proj.weight"] = o * expanded.reshape(-1)
