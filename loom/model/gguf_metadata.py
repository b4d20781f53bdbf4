"""What a GGUF file says that transformers' GGUF reader would not carry over, refused by name.

Loom loads a GGUF file through transformers, which dequantises it into a Hugging Face model and
a config built from a fixed set of the file's metadata keys (transformers'
`GGUF_CONFIG_MAPPING`). A key outside that set is dropped and the config's default stands in:
a Llama 3.1 or Phi-3 long-context file's rope scaling (tensors of factors), a sliding window
where the reader does not map one, Gemma 2's soft caps where they differ from the default,
Gemma's `query_pre_attn_scalar` (not in the file: 256 is taken, wrong for heads of another
size). The model would load
and give other tokens than the file's model, silently; these are refused before anything is
converted, with the key's name. Convert such a model to a Hugging Face folder (its config then
says everything) and serve that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.model.family import UnsupportedModelError
from loom.model.gguf_file import read_file_header

# GGUF's architecture names, for the families Loom runs (transformers reads all of these).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe")
ROPE_TENSORS = {
    "rope_freqs.weight": "Llama 3.1's",
    "rope_factors_long.weight": "Phi-3's long context",
    "rope_factors_short.weight": "Phi-3's long context",
}
# transformers' defaults for what its reader does not map: a file may say them, and no other.
DEFAULTS = {
    "gemma2.attn_logit_softcapping": 50.0,
    "gemma2.final_logit_softcapping": 30.0,
}


def check_gguf(path: Path) -> None:
    """Refuse a GGUF file whose metadata transformers would drop (module docstring)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    header = read_file_header(path)
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF general.architecture {arch!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)})"
        )
    mapping: Any = GGUF_CONFIG_MAPPING.get(arch.replace("qwen2moe", "qwen2_moe"), {})
    read = {str(key) for key in mapping}
    for key, value in header.fields.items():
        if not key.startswith(arch + "."):
            continue
        refused = refusal(key, key[len(arch) + 1 :], value, read)
        if refused is not None:
            raise UnsupportedModelError(f"GGUF {key} {refused}")
    for tensor in header.tensors:
        if tensor.name in ROPE_TENSORS:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name} (rope scaling factors: {ROPE_TENSORS[tensor.name]}) "
                "is not read by transformers' GGUF reader; serve the model's Hugging Face folder"
            )
    key_length = header.fields.get(f"{arch}.attention.key_length")
    if arch in ("gemma2", "gemma3") and key_length is not None and key_length != 256:
        raise UnsupportedModelError(
            f"GGUF {arch}.attention.key_length {key_length}: the file does not say "
            "query_pre_attn_scalar, and transformers' GGUF reader takes 256 (right only for "
            "heads of 256; Gemma's 27B models differ); serve the model's Hugging Face folder"
        )


def refusal(key: str, name: str, value: Any, read: set[str]) -> str | None:
    """Why the key cannot be served as transformers would read it, or None."""
    dropped = "is not read by transformers' GGUF reader; serve the model's Hugging Face folder"
    if name == "rope.scaling.type":
        return None if value in ("none", "") else f"{value!r} {dropped}"
    if name == "attention.sliding_window" and name not in read and value:
        return f"{value} {dropped}"
    if key in DEFAULTS and float(value) != DEFAULTS[key]:
        return f"{value} {dropped} (it would take {DEFAULTS[key]})"
    return None
