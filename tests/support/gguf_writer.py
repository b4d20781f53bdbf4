"""A transformers model written as a float32 GGUF file, named as llama.cpp's converter names
its tensors and keys (gguf's own name map; Gemma's norms stored as `1 + w`; a mixture's fused
experts split into gate, up and down; Llama's q and k rows permuted), with another file's
tokenizer, the matrices in float32 or in the quantised types asked for: the files of families
the tests cannot download, for Loom's GGUF path (tests/model/test_loader.py,
tests/model/test_gguf_weights.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCH = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe",
}  # fmt: skip


def tokenizer_fields(source: Path) -> list[tuple[str, Any, Any, Any]]:
    """A GGUF file's tokenizer keys: (name, value, type, array element type)."""
    import gguf

    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def small_tokenizer_fields(source: Path, size: int) -> list[tuple[str, Any, Any, Any]]:
    """A GGUF file's tokenizer cut to its first `size` tokens and the merges among them: the
    same kind of tokenizer (SmolLM2's byte-level BPE keeps its 256 bytes in its first 273),
    read in milliseconds rather than seconds."""
    fields = []
    for key, value, vtype, sub in tokenizer_fields(source):
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:size]
        elif key == "tokenizer.ggml.merges":
            kept = set(fields[[f[0] for f in fields].index("tokenizer.ggml.tokens")][1])
            value = [m for m in value if {*m.split(" "), m.replace(" ", "")} <= kept]
        fields.append((key, value, vtype, sub))
    return fields


def write_model_gguf(
    model: Any,
    path: Path,
    tokenizer: list[tuple[str, Any, Any, Any]],
    types: tuple[str, ...] = (),
) -> Path:
    """`model` at `path`: the config keys transformers' GGUF reader maps, every tensor; the
    matrices in `types` (gguf's type names, taken in turn: "Q4_1", "F16", ...), else float32."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = model.config
    arch_name = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, arch_name)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the file's base is its global layers'
    values = {**config.to_dict(), "rope_theta": rope["rope_theta"]}
    mapping = GGUF_CONFIG_MAPPING.get(config.model_type) or GGUF_CONFIG_MAPPING[arch_name]
    for key, hf_key in mapping.items():
        value = values.get(hf_key) if hf_key else None
        if value is None:
            continue
        add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        add(f"{arch_name}.{key}", value)
    for key, value, vtype, sub in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    matrices = 0
    for name, w in gguf_tensors(model):
        if types and w.ndim == 2:
            kind = gguf.GGMLQuantizationType[types[matrices % len(types)]]
            matrices += 1
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The model's tensors as llama.cpp's converter writes them: named by gguf's map, Llama's
    q and k rows permuted, Gemma's norms `1 + w`, a mixture's experts split."""
    import gguf

    config = model.config
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GGUF_ARCH[config.model_type])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    gemma = config.model_type.startswith("gemma")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if gemma and "norm.weight" in name:
            w = w + 1
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            w = w.reshape(heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(w, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate.copy()
            yield f"blk.{layer}.ffn_up_exps.weight", up.copy()
            continue
        if name.endswith("mlp.experts.down_proj"):
            yield f"blk.{layer}.ffn_down_exps.weight", w
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        if "shared_expert_gate" in name:
            w = w[0]
        yield f"{gguf_name}.{suffix}", w
