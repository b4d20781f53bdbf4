"""A compact Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV pool.

Weights are taken from a loaded transformers model; q/k/v and gate/up are fused into one matrix
product each. The arithmetic follows transformers' modules (RMSNorm in float32, rotary embedding
from the model's own rotary module) so that greedy fp32 decoding gives the very tokens of
`generate`, with `quantization="none"`. Where Loom's CPU kernels run, the residual add and
RMSNorm, rotary and the K/V write, and SiLU * up are each one fused pass: rotary bit for bit,
the norm and SiLU within float rounding of torch's; a quantised method (loom/model/linear.py)
changes the linear layers' arithmetic and nothing else. The forward takes the whole step's
tokens flat, `[T]`, with no batch axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F  # noqa: N812

from loom.model.attention import (
    AttentionMetadata,
    can_decode_in_place,
    decode_group,
    paged_attention,
    write_kv,
)
from loom.model.blocks import BlockLinear
from loom.model.kv_cache import KVCache, KVCacheShape
from loom.model.linear import LinearLayer, make_linear, method_for
from loom.model.smoothing import calibration_ids, input_ranges, smooth


@attrs.frozen(kw_only=True)
class LlamaLayer:
    input_norm: torch.Tensor
    qkv: LinearLayer  # [(H_q + 2 H_kv) D, hidden], with Qwen2's bias
    o: LinearLayer  # with Llama's attention_bias
    post_norm: torch.Tensor
    gate_up: LinearLayer  # [2 intermediate, hidden]
    down: LinearLayer


def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype (fp32: the
    same bits as its five separate ops, in one)."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def layer_linear(
    quantization: str, layer: str, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> LinearLayer:
    """A layer of this kind (qkv, o, gate_up, down, lm_head) as `quantization` computes it."""
    return make_linear(weight, bias, method=method_for(quantization, layer))


def max_model_len_of(config: Any) -> int:
    """Sliding-window attention is not implemented: stay within the window, where it is exact."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    return min(int(config.max_position_embeddings), window or 1 << 62)


def embedding_of(
    embed: torch.Tensor, head: torch.Tensor, lm_head: LinearLayer
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids [T] -> their embeddings [T, hidden]. A tied LM head in blocks (q4: Q8_0, as the
    default model's file) is the embedding too: its rows are looked up there, and no float copy
    is kept (113 MB for SmolLM2). Lossless for a Q8_0 file's embedding; a float one is rounded
    to Q8_0, as the head is."""
    if isinstance(lm_head, BlockLinear) and head.data_ptr() == embed.data_ptr():
        return lm_head.packed.rows
    return functools.partial(F.embedding, weight=embed.clone())


@attrs.frozen(eq=False)
class DecodeWeights:
    """The layers' tensors as `torch.ops.loom.llama_layers` takes them: ten a layer in
    `weights`, four (qkv, o, gate_up, down) in `sizes` (output sizes) and `biases`. The very
    tensors the layers hold, taken at load (nothing replaces a layer's tensors after it)."""

    weights: list[torch.Tensor]
    sizes: list[int]
    biases: list[torch.Tensor | None]


def decode_weights(layers: list[LlamaLayer]) -> DecodeWeights | None:
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
                out.weights.append(layer.post_norm)
    return out


class LlamaModel:
    """The forward pass of a Llama-family causal LM, reading and writing K/V through the pool."""

    def __init__(
        self,
        hf_model: Any,
        *,
        quantization: str = "none",
        tokenizer: Any = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        config = hf_model.config
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or (
            config.hidden_size // self.num_heads
        )
        self.eps: float = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.vocab_size: int = config.vocab_size
        self.max_model_len = max_model_len_of(config)
        if getattr(config, "mlp_bias", False):
            raise ValueError("Llama models with mlp_bias are not supported")
        self.rotary = hf_model.model.rotary_emb
        weights: dict[str, torch.Tensor] = dict(hf_model.state_dict())
        embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device, self.hidden_size = embed.dtype, embed.device, embed.shape[1]
        self.kv_dtype = kv_dtype or self.dtype  # the pool's: the model's, or float16
        # Copies, not views of the mapped checkpoint: a view keeps the file resident (513 MB).
        self.final_norm = weights["model.norm.weight"].clone()
        self.decode_in_place = can_decode_in_place(self.device, self.dtype, self.head_dim)
        self.decode_in_place &= self.kv_dtype in (torch.float32, torch.float16)
        # Norms, rotary and the K/V write, SiLU and its product fused, where the CPU kernels run.
        self.fused = self.decode_in_place and self.hidden_size % 8 == 0
        self.fused &= config.intermediate_size % 8 == 0
        if quantization == "int8":
            ids = calibration_ids(tokenizer, self.vocab_size, self.max_model_len)
            weights = smooth(
                weights,
                input_ranges(hf_model, ids),
                num_layers=config.num_hidden_layers,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
            )
        linear = functools.partial(layer_linear, quantization)
        head = weights.get("lm_head.weight", embed)
        self.lm_head = linear("lm_head", head)
        self.embedding = embedding_of(embed, head, self.lm_head)
        self.layers = [
            self.fuse_layer(weights, f"model.layers.{i}.", linear)
            for i in range(config.num_hidden_layers)
        ]
        self.decode_weights = decode_weights(self.layers) if self.fused else None  # q4: one call

    @staticmethod
    def fuse_layer(
        weights: dict[str, torch.Tensor], prefix: str, linear: Callable[..., LinearLayer]
    ) -> LlamaLayer:
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv_biases = [
            weights[f"{attn}{p}_proj.bias"] for p in "qkv" if f"{attn}{p}_proj.bias" in weights
        ]
        return LlamaLayer(
            input_norm=weights[prefix + "input_layernorm.weight"].clone(),
            qkv=linear(
                "qkv",
                torch.cat([weights[f"{attn}{p}_proj.weight"] for p in "qkv"]),
                torch.cat(qkv_biases) if qkv_biases else None,
            ),
            o=linear(
                "o", weights[attn + "o_proj.weight"], clone(weights.get(attn + "o_proj.bias"))
            ),
            post_norm=weights[prefix + "post_attention_layernorm.weight"].clone(),
            gate_up=linear(
                "gate_up",
                torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]),
            ),
            down=linear("down", weights[mlp + "down_proj.weight"]),
        )

    def kv_cache_shape(self, block_size: int) -> KVCacheShape:
        return KVCacheShape(
            num_layers=len(self.layers),
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """The last layer's hidden states [T, hidden] of the step's flat tokens; their K/V are
        written to the pool on the way."""
        hidden = self.embedding(input_ids)
        cos, sin = self.rotary(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, D]: broadcast over heads
        # transformers' `x * cos + rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1]:
        # [-x2, x1] * sin == roll(x) * [-sin1, sin2], bit for bit, in one copy fewer.
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        decodes = decode_group(metadata)
        if self.decode_weights is not None and decodes is not None:  # the same kernels, in C++
            w = self.decode_weights
            tables = decodes.block_index.view(len(decodes.seq_lens), -1)
            out: torch.Tensor = torch.ops.loom.llama_layers(
                hidden, cos, sin, metadata.slot_mapping, tables, decodes.seq_lens, w.weights,
                w.sizes, w.biases, kv_cache.k, kv_cache.v, self.num_heads, self.eps, self.scale,
            )  # fmt: skip
            return out
        delta: torch.Tensor | None = None  # what the last MLP adds to the residual stream
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v, strict=True):
            x = self.add_norm(hidden, delta, layer.input_norm)
            x = self.attention(layer, x, cos, sin, metadata, k_cache, v_cache)
            delta = self.mlp(layer, self.add_norm(hidden, x, layer.post_norm))
        return hidden if delta is None else hidden.add_(delta)

    def add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """`hidden += delta` (the residual stream, in place), then RMSNorm of it: one fused
        kernel where Loom's CPU kernels run."""
        if self.fused:
            out: torch.Tensor = torch.ops.loom.add_rms_norm(hidden, delta, weight, self.eps)
            return out
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, weight, self.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for hidden states [N, hidden]: the final norm and the LM head."""
        return self.lm_head(self.add_norm(hidden.contiguous(), None, self.final_norm))

    def attention(
        self,
        layer: LlamaLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = layer.qkv(x)
        if self.fused:  # rotary and the K/V write in one pass, bit for bit the same
            q = torch.ops.loom.rotary_write_kv(
                qkv, cos, sin, metadata.slot_mapping, k_cache, v_cache, self.num_heads
            )
        else:
            q = self.rotary_write_kv(qkv, cos, sin, metadata, k_cache, v_cache)
        out = paged_attention(q, k_cache, v_cache, metadata, self.scale)
        return layer.o(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary on q and k, k and v written to the pool; returns q [T, H_q, D]."""
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin  # rotary, q and k at once
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        return q

    def mlp(self, layer: LlamaLayer, x: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(x)
        if self.fused:
            return layer.down(torch.ops.loom.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
