"""Save one random-weight model of each family Loom runs, all of one size, for `loom bench-step`
(BENCHMARKS.md, "Decode step per family"): a family much slower than Llama's shows there.

    python examples/tiny_families.py /tmp/families
    for m in /tmp/families/*; do loom bench-step --model "$m" --sequences 1,16 --repeats 10; done

Each: 8 layers, hidden 512, 8 query heads and 4 KV heads of 64, an MLP of 1536, a vocabulary of
8192, SmolLM2's tokenizer (ids past 8192 are never fed). What sets a family apart is on:
windows of 128 where the family has them (Mistral on every layer, Gemma on every other),
Gemma 2's soft caps, Qwen3's and Gemma 3's q/k norms, the mixture's 8 experts of 768 (2 a
token, so 1536 wide, as the others' MLP) and a shared expert of 512.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer

from loom.model.loader import converted_gguf_folder, default_model_path, model_cache_root

SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
WINDOW = 128
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 64}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 4}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
        "shared_expert_intermediate_size": 512}),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to save the models in, one each")
    args = parser.parse_args()
    default = converted_gguf_folder(default_model_path(), model_cache_root(None))
    tokenizer = AutoTokenizer.from_pretrained(default)
    for family, (config_name, model_name, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**SHAPE, **extra)
        model = getattr(transformers, model_name)(config).eval()
        folder = args.out / family
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        size = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{family}: {size:.1f}M parameters -> {folder}")


if __name__ == "__main__":
    main()
