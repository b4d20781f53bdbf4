"""What sets one decoder family apart from another, read once from a transformers config.

Every family Loom runs is the same pre-norm decoder (loom/model/decoder.py) with small parts
switched on or off: Gemma's norms scale by `1 + w` and wrap each sublayer (sandwich norms), its
embeddings are scaled, its MLP is GeGLU and Gemma 2 soft-caps scores and logits; Qwen3 and
Gemma 3 normalise q and k per head; Phi-3 rotates part of each head; Mistral, Phi-3, Qwen2 and
Gemma slide a window over some or all layers. `family_of` reads those from the config and
refuses, by the field's name, whatever Loom does not implement: a config Loom would run
differently from transformers is never served.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen2_moe",
)  # fmt: skip
GEMMA = ("gemma2", "gemma3_text")
ALL_SLIDE = ("mistral", "phi3")  # `sliding_window` applies to every layer (transformers ignores
# their `layer_types`); Qwen and Gemma name each layer's kind in `layer_types`
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_KINDS = ("full_attention", "sliding_attention")

# Each rope type's parameters, as transformers' rotary module reads them: Loom takes cos and sin
# from that module, so a type is supported where its tables depend on the position alone.
ROPE_COMMON = {"rope_type", "rope_theta", "partial_rotary_factor"}
ROPE_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "longrope": {"short_factor", "long_factor", "factor", "original_max_position_embeddings"},
}


class UnsupportedModelError(ValueError):
    """A config names an architecture or a setting Loom does not implement."""


@attrs.frozen(kw_only=True)
class Family:
    model_type: str
    num_layers: int
    head_dim: int
    rotary_dim: int  # the leading part of each head that rotary turns (Phi-3: a fraction)
    scale: float  # attention's score scale
    windows: tuple[int | None, ...]  # per layer: keys within this distance, or all
    rope_keys: tuple[str | None, ...]  # per layer: its rotary table (Gemma 3: one per kind)
    max_model_len: int
    activation: str = "silu"  # or "gelu_tanh": the gate's, in the gated MLP
    qk_norm: bool = False  # RMSNorm on each head of q and k before rotary
    sandwich_norms: bool = False  # a norm on each sublayer's output too (Gemma)
    norm_offset: float = 0.0  # norms scale by `offset + w` (Gemma: 1)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    top_k: int = 0  # a mixture of experts: each token's experts (loom/model/moe.py)
    normalize_top_k: bool = False  # their router weights renormalised to sum to 1

    @property
    def is_plain(self) -> bool:
        """Llama's shape exactly: the one-call decode kernel (torch.ops.loom.llama_layers) runs
        it."""
        return not (
            self.qk_norm or self.sandwich_norms or self.norm_offset or self.embed_scale
            or self.attn_softcap or self.activation != "silu" or any(self.windows)
            or self.rotary_dim != self.head_dim or any(self.rope_keys) or self.top_k
        )  # fmt: skip

    @property
    def window_sizes(self) -> tuple[int, ...]:
        """The distinct windows, for the masks built once a step."""
        return tuple(sorted({w for w in self.windows if w is not None}))

    @property
    def kv_window(self) -> int | None:
        """Where every layer slides: the widest window, beyond which no layer reads a key (the
        KV blocks before it can be freed); else None."""
        if not self.windows or any(w is None for w in self.windows):
            return None
        return max(w for w in self.windows if w is not None)


def family_of(config: Any) -> Family:
    """The family of a transformers config; UnsupportedModelError names what Loom cannot run."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})"
        )
    refuse_unsupported(config, model_type)
    gemma = model_type in GEMMA
    heads = config.num_attention_heads
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = config.rope_parameters
    per_kind = (
        gemma and set(rope) <= set(LAYER_KINDS) and all(isinstance(v, dict) for v in rope.values())
    )
    kinds = layer_types_of(config, model_type)
    for params in rope.values() if per_kind else [rope]:
        check_rope(params)
    factor = float((rope if not per_kind else {}).get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if rotary_dim != head_dim and model_type != "phi3":
        raise UnsupportedModelError(
            f"rope_parameters.partial_rotary_factor {factor} is not supported for {model_type}"
        )
    max_model_len = max_model_len_of(config, rope if not per_kind else {})
    window = getattr(config, "sliding_window", None) or None
    if window is not None and window >= max_model_len:
        window = None  # no key is ever that far: the plain causal path, exactly the same
    return Family(
        model_type=model_type,
        num_layers=config.num_hidden_layers,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        scale=(config.query_pre_attn_scalar if gemma else head_dim) ** -0.5,
        windows=tuple(window if kind == "sliding_attention" else None for kind in kinds),
        rope_keys=tuple(kind if per_kind else None for kind in kinds),
        max_model_len=max_model_len,
        activation=ACTIVATIONS[activation_of(config)],
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sandwich_norms=gemma,
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=math.sqrt(config.hidden_size) if gemma else None,
        # Gemma 3's modules keep `attn_logit_softcapping` but never apply it; Gemma 2's do.
        attn_softcap=getattr(config, "attn_logit_softcapping", None)
        if model_type == "gemma2"
        else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
        normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
    )


def refuse_unsupported(config: Any, model_type: str) -> None:
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported")
    if activation_of(config) not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act {activation_of(config)!r} is not supported (supported: "
            f"{', '.join(ACTIVATIONS)})"
        )
    for kind in getattr(config, "layer_types", None) or ():
        if kind not in LAYER_KINDS and model_type not in ALL_SLIDE:
            raise UnsupportedModelError(f"layer_types entry {kind!r} is not supported")


def activation_of(config: Any) -> str:
    return str(getattr(config, "hidden_activation", None) or config.hidden_act)


def check_rope(params: dict[str, Any]) -> None:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_KEYS:
        raise UnsupportedModelError(
            f"rope_parameters.rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(ROPE_KEYS)})"
        )
    if unknown := sorted(set(params) - ROPE_COMMON - ROPE_KEYS[rope_type]):
        raise UnsupportedModelError(
            f"rope_parameters.{unknown[0]} is not supported for rope_type {rope_type!r}"
        )


def layer_types_of(config: Any, model_type: str) -> list[str]:
    """Each layer's kind, as transformers' modules of this family read it."""
    num_layers = int(config.num_hidden_layers)
    windowed = bool(getattr(config, "sliding_window", None))
    if model_type in ALL_SLIDE or not getattr(config, "layer_types", None):
        kind = "sliding_attention" if windowed and model_type != "llama" else "full_attention"
        return [kind] * num_layers
    kinds = [str(kind) for kind in config.layer_types[:num_layers]]
    return [kind if windowed else "full_attention" for kind in kinds]


def max_model_len_of(config: Any, rope: dict[str, Any]) -> int:
    """Within `max_position_embeddings`; longrope within its original length too, where
    transformers switches from the short factors to the long ones (and Loom's table would mix
    them within a step). Dynamic NTK changes its table only past `max_position_embeddings`."""
    length = int(config.max_position_embeddings)
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        length = min(length, int(original or length))
    return length
