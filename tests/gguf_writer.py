"""A transformers model written as a float32 GGUF file, named as llama.cpp's converter names
its tensors and keys (gguf's own name map; Gemma's norms stored as `1 + w`; a mixture's fused
experts split into gate, up and down), with another file's tokenizer: the files of families
the tests cannot download, for Loom's GGUF path (tests/model/test_loader.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCH = {
    "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
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


def write_model_gguf(model: Any, path: Path, tokenizer: list[tuple[str, Any, Any, Any]]) -> Path:
    """`model` at `path`: the config keys transformers' GGUF reader maps, every tensor."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config = model.config
    arch_name = GGUF_ARCH[config.model_type]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
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
    gemma = config.model_type.startswith("gemma")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if gemma and "norm.weight" in name:
            w = w + 1
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(w, 2, axis=1)
            writer.add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_exps.weight", gate.copy())
            writer.add_tensor(f"blk.{name.split('.')[2]}.ffn_up_exps.weight", up.copy())
            continue
        if name.endswith("mlp.experts.down_proj"):
            writer.add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", w)
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        if "shared_expert_gate" in name:
            w = w[0]
        writer.add_tensor(f"{gguf_name}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
