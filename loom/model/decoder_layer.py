"""One decoder layer's weights as the forward pass takes them (loom/model/decoder.py), read from
transformers' names: q/k/v fused into one matrix and gate/up into another (Phi-3's checkpoints
come fused), norms ready to multiply (Gemma's `1 + w` added once, here). Also the embedding
lookup, and the layers' tensors for the one-call decode kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F  # noqa: N812

from loom.model.blocks import BlockLinear
from loom.model.family import Family
from loom.model.linear import Linear, LinearLayer, make_linear, method_for
from loom.model.moe import Experts, load_experts


@attrs.frozen(kw_only=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: LinearLayer  # [(H_q + 2 H_kv) D, hidden], with Qwen2's bias
    o: LinearLayer  # with Llama's attention_bias
    mlp_norm: torch.Tensor  # before the MLP (post_attention_layernorm; Gemma: pre_feedforward)
    gate_up: LinearLayer  # [2 intermediate, hidden] (a mixture of experts: the shared expert's)
    down: LinearLayer
    experts: Experts | None = None  # a mixture of experts in place of the MLP (Qwen2-MoE)
    attn_out_norm: torch.Tensor | None = None  # Gemma's sandwich: on attention's output
    mlp_out_norm: torch.Tensor | None = None  # and on the MLP's
    q_norm: torch.Tensor | None = None  # per head (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # keys within this distance of the query, or all
    rope_key: str | None = None  # the rotary table it takes (Gemma 3: by layer kind)


def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype (fp32: the
    same bits as its five separate ops, in one). Gemma's `1 + w` comes as the weight."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def layer_linear(
    quantization: str, layer: str, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> LinearLayer:
    """A layer of this kind (qkv, o, gate_up, down, lm_head) as `quantization` computes it."""
    return make_linear(weight, bias, method=method_for(quantization, layer))


def norm_weight(family: Family, weight: torch.Tensor) -> torch.Tensor:
    """The factor a norm multiplies by: Gemma's `1 + w`, computed in float32 as its RMSNorm
    does, else a copy of `w` (not a view of the mapped checkpoint, which would keep the file
    resident)."""
    if family.norm_offset:
        return (family.norm_offset + weight.float()).to(weight.dtype)
    return weight.clone()


def stacked(
    weights: dict[str, torch.Tensor], prefix: str, names: str, fused_name: str
) -> torch.Tensor:
    """`prefix + fused_name` where the checkpoint has it fused (Phi-3), else the parts stacked."""
    if prefix + fused_name + ".weight" in weights:
        return weights[prefix + fused_name + ".weight"]
    return torch.cat([weights[f"{prefix}{name}.weight"] for name in names.split()])


def load_layer(
    weights: dict[str, torch.Tensor],
    i: int,
    family: Family,
    linear: Callable[..., LinearLayer],
) -> DecoderLayer:
    prefix = f"model.layers.{i}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    experts = load_experts(weights, mlp, family.top_k, family.normalize_top_k)
    if experts is not None:
        mlp += "shared_expert."
    biases = [weights[f"{attn}{p}_proj.bias"] for p in "qkv" if f"{attn}{p}_proj.bias" in weights]
    gemma = family.sandwich_norms

    def norm(name: str) -> torch.Tensor:
        return norm_weight(family, weights[prefix + name + ".weight"])

    def optional(name: str) -> torch.Tensor | None:
        return norm(name) if prefix + name + ".weight" in weights else None

    return DecoderLayer(
        input_norm=norm("input_layernorm"),
        qkv=linear(
            "qkv",
            stacked(weights, attn, "q_proj k_proj v_proj", "qkv_proj"),
            torch.cat(biases) if biases else None,
        ),
        o=linear("o", weights[attn + "o_proj.weight"], clone(weights.get(attn + "o_proj.bias"))),
        mlp_norm=norm("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"),
        gate_up=linear("gate_up", stacked(weights, mlp, "gate_proj up_proj", "gate_up_proj")),
        down=linear("down", weights[mlp + "down_proj.weight"]),
        experts=experts,
        attn_out_norm=norm("post_attention_layernorm") if gemma else None,
        mlp_out_norm=optional("post_feedforward_layernorm"),
        q_norm=optional("self_attn.q_norm"),
        k_norm=optional("self_attn.k_norm"),
        window=family.windows[i],
        rope_key=family.rope_keys[i],
    )


def embedding_of(
    embed: torch.Tensor, head: torch.Tensor, lm_head: LinearLayer
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids [T] -> their embeddings [T, hidden]. A tied LM head in blocks (q4: Q8_0, as the
    default model's file) is the embedding too: its rows are looked up there, and no float copy
    is kept (113 MB for SmolLM2). Lossless for a Q8_0 file's embedding; a float one is rounded
    to Q8_0, as the head is. A tied head that keeps its float weight (a GPU's, not prepacked
    for oneDNN) lends it to the embedding: one copy, not two."""
    tied = head.data_ptr() == embed.data_ptr()
    if isinstance(lm_head, BlockLinear) and tied:
        return lm_head.packed.rows
    if isinstance(lm_head, Linear) and tied and lm_head.weight is not None:
        return functools.partial(F.embedding, weight=lm_head.weight)  # the head's own (a GPU's)
    return functools.partial(F.embedding, weight=embed.clone())


@attrs.frozen(eq=False)
class DecodeWeights:
    """The layers' tensors as `torch.ops.loom.llama_layers` takes them: ten a layer in
    `weights`, four (qkv, o, gate_up, down) in `sizes` (output sizes) and `biases`. The very
    tensors the layers hold, taken at load (nothing replaces a layer's tensors after it)."""

    weights: list[torch.Tensor]
    sizes: list[int]
    biases: list[torch.Tensor | None]


def decode_weights(layers: list[DecoderLayer]) -> DecodeWeights | None:
    """The layers' tensors for one call, where every linear layer is in Q4_1 blocks; else None."""
    out = DecodeWeights(weights=[], sizes=[], biases=[])
    for layer in layers:
        out.weights.append(layer.input_norm)
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not isinstance(linear, BlockLinear) or linear.packed.bits != 4:
                return None
            out.weights.extend([linear.packed.q, linear.packed.dm])
            out.sizes.append(linear.packed.n)
            out.biases.append(linear.bias)
            if linear is layer.o:
                out.weights.append(layer.mlp_norm)
    return out
