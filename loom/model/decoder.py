"""One compact decoder forward pass for every family Loom runs (loom/model/family.py: Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3), over the paged KV pool.

Weights are taken from a loaded transformers model (loom/model/decoder_layer.py); q/k/v and
gate/up are fused into one matrix product each. A family's parts are switched on by its
`Family`: q/k norms, partial rotary, sandwich norms, GeGLU, soft-capping, sliding windows per
layer. The arithmetic follows transformers' modules (RMSNorm in float32, rotary embedding
from the model's own rotary module) so that greedy fp32 decoding gives the very tokens of
`generate`, with `quantization="none"`. Where Loom's CPU kernels run (on a GPU, Triton's:
loom/model/triton_ops.py, named by `ops`), the residual add and RMSNorm, rotary and the K/V
write, and SiLU * up are each one fused pass: rotary bit for bit on the CPU, the norm and SiLU
within float rounding of torch's; a quantised method (loom/model/linear.py)
changes the linear layers' arithmetic and nothing else. The forward takes the whole step's
tokens flat, `[T]`, with no batch axis.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from loom.model.attention import (
    can_decode_in_place,
    decode_group,
    paged_attention,
    write_kv,
)
from loom.model.attention_metadata import AttentionMetadata
from loom.model.decoder_layer import (
    DecoderLayer,
    decode_weights,
    embedding_of,
    layer_linear,
    load_layer,
    norm_weight,
    rms_norm,
)
from loom.model.family import UnsupportedModelError, family_of
from loom.model.kv_cache import KVCache, KVCacheShape
from loom.model.smoothing import calibration_ids, input_ranges, smooth

SMOOTHED = ("llama", "mistral", "qwen2")  # the families int8's smoothing knows the norms of
RotaryTable = tuple[torch.Tensor, torch.Tensor]


class DecoderModel:
    """The forward pass of a decoder-only causal LM, reading and writing K/V through the pool."""

    def __init__(
        self,
        hf_model: Any,
        *,
        quantization: str = "none",
        tokenizer: Any = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        config = hf_model.config
        self.family = family = family_of(config)
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim = family.head_dim
        self.eps: float = config.rms_norm_eps
        self.scale = family.scale
        self.vocab_size: int = config.vocab_size
        self.max_model_len = family.max_model_len
        self.rotary = hf_model.model.rotary_emb
        weights: dict[str, torch.Tensor] = dict(hf_model.state_dict())
        embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device, self.hidden_size = embed.dtype, embed.device, embed.shape[1]
        self.kv_dtype = kv_dtype or self.dtype  # the pool's: the model's, or float16
        scale = family.embed_scale
        self.embed_scale = None if scale is None else torch.tensor(scale).to(self.dtype)
        self.final_norm = norm_weight(family, weights["model.norm.weight"])
        self.decode_in_place = can_decode_in_place(self.device, self.dtype, self.head_dim)
        on_cpu = self.device.type == "cpu"
        self.decode_in_place &= self.kv_dtype in (torch.float32, torch.float16) or not on_cpu
        self.ops, self.fused, self.fused_rotary = self.small_ops(config, on_cpu)
        if quantization == "int8":
            weights = self.smoothed(weights, hf_model, tokenizer)
        linear = functools.partial(layer_linear, quantization)
        head = weights.get("lm_head.weight", embed)
        self.lm_head = linear("lm_head", head)
        self.embedding = embedding_of(embed, head, self.lm_head)
        self.layers = [load_layer(weights, i, family, linear) for i in range(family.num_layers)]
        one_call = self.fused and on_cpu and family.is_plain
        self.decode_weights = decode_weights(self.layers) if one_call else None  # q4: one call
        self.one_region = True  # that call's layers in one parallel region (False: one a kernel)

    def small_ops(self, config: Any, on_cpu: bool) -> tuple[Any, bool, bool]:
        """Where norms, rotary and the K/V write, and SiLU and its product are fused: the ops
        (the CPU kernels, or on a GPU Triton's: loom/model/triton_ops.py), whether the norms
        and SiLU are, and whether rotary is (the whole head, of a power-of-two size)."""
        fused = self.decode_in_place and self.hidden_size % 8 == 0
        fused &= config.intermediate_size % 8 == 0
        fused &= getattr(config, "shared_expert_intermediate_size", 0) % 8 == 0
        ops: Any = torch.ops.loom
        if fused and not on_cpu:
            from loom.model import triton_ops

            ops = triton_ops
        rotary, head_dim = self.family.rotary_dim, self.head_dim
        return ops, fused, fused and rotary == head_dim == 1 << (head_dim - 1).bit_length()

    def smoothed(
        self, weights: dict[str, torch.Tensor], hf_model: Any, tokenizer: Any
    ) -> dict[str, torch.Tensor]:
        """int8's weights: activation outliers folded into the norms before them."""
        if self.family.model_type not in SMOOTHED:
            raise UnsupportedModelError(
                f"quantization int8 is not supported for {self.family.model_type} (its "
                f"smoothing knows {', '.join(SMOOTHED)}); try q4"
            )
        ids = calibration_ids(tokenizer, self.vocab_size, self.max_model_len)
        return smooth(
            weights,
            input_ranges(hf_model, ids),
            num_layers=self.family.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
        )

    def kv_cache_shape(self, block_size: int) -> KVCacheShape:
        return KVCacheShape(
            num_layers=len(self.layers),
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
        )

    def rotary_tables(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> dict[Any, RotaryTable]:
        """cos and sin [T, 1, rotary_dim] for each table the layers take (Gemma 3: one per
        layer kind), from the model's own rotary module. transformers' `x * cos +
        rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1]: [-x2, x1] * sin == roll(x) *
        [-sin1, sin2], bit for bit, in one copy fewer; sin comes signed so."""
        tables: dict[str | None, RotaryTable] = {}
        for key in set(self.family.rope_keys):
            extra = () if key is None else (key,)
            cos, sin = self.rotary(hidden, positions[None], *extra)
            cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, R]: broadcast over heads
            half = sin.shape[-1] // 2
            tables[key] = cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return tables

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        rotary: dict[Any, RotaryTable] | None = None,
    ) -> torch.Tensor:
        """The last layer's hidden states [T, hidden] of the step's flat tokens; their K/V are
        written to the pool on the way. `rotary`: the tokens' cos and sin, where looked up
        already (the static decode step's), else computed from `positions`."""
        hidden = self.embedding(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        tables = rotary if rotary is not None else self.rotary_tables(hidden, positions)
        decodes = decode_group(metadata)
        if self.decode_weights is not None and decodes is not None:  # the same kernels, in C++
            w, (cos, sin) = self.decode_weights, tables[None]
            block_tables = decodes.block_index.view(len(decodes.seq_lens), -1)
            out: torch.Tensor = torch.ops.loom.llama_layers(
                hidden, cos, sin, metadata.slot_mapping, block_tables, decodes.seq_lens,
                w.weights, w.sizes, w.biases, kv_cache.k, kv_cache.v, self.num_heads, self.eps,
                self.scale, self.one_region,
            )  # fmt: skip
            return out
        delta: torch.Tensor | None = None  # what the last MLP adds to the residual stream
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v, strict=True):
            x = self.add_norm(hidden, delta, layer.input_norm)
            cos, sin = tables[layer.rope_key]
            x = self.attention(layer, x, cos, sin, metadata, k_cache, v_cache)
            if layer.attn_out_norm is not None:
                x = self.add_norm(x, None, layer.attn_out_norm)
            delta = self.mlp(layer, self.add_norm(hidden, x, layer.mlp_norm))
            if layer.mlp_out_norm is not None:
                delta = self.add_norm(delta, None, layer.mlp_out_norm)
        return hidden if delta is None else hidden.add_(delta)

    def add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """`hidden += delta` (the residual stream, in place), then RMSNorm of it: one fused
        kernel where Loom's CPU kernels run."""
        if self.fused:
            out: torch.Tensor = self.ops.add_rms_norm(hidden, delta, weight, self.eps)
            return out
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, weight, self.eps)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden states [N, hidden]: transformers' `last_hidden_state`."""
        return self.add_norm(hidden.contiguous(), None, self.final_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for hidden states [N, hidden]: the final norm and the LM head (and
        Gemma 2's soft cap, `cap * tanh(logits / cap)`)."""
        logits = self.lm_head(self.final_hidden(hidden))
        if (cap := self.family.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = layer.qkv(x)
        if layer.q_norm is not None and layer.k_norm is not None:
            qkv = self.qk_norm(qkv, layer.q_norm, layer.k_norm)
        if self.fused_rotary:  # rotary and the K/V write in one pass, bit for bit the same
            q = self.ops.rotary_write_kv(
                qkv, cos, sin, metadata.slot_mapping, k_cache, v_cache, self.num_heads
            )
        else:
            q = self.rotary_write_kv(qkv, cos, sin, metadata, k_cache, v_cache)
        softcap = self.family.attn_softcap
        out = paged_attention(q, k_cache, v_cache, metadata, self.scale, layer.window, softcap)
        return layer.o(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def qk_norm(
        self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor
    ) -> torch.Tensor:
        """RMSNorm over each head of q and of k (Qwen3, Gemma 3), before rotary."""
        num_tokens, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q = rms_norm(qkv[:, :q_size].view(num_tokens, -1, d), q_norm, self.eps)
        k = rms_norm(qkv[:, q_size : q_size + kv_size].view(num_tokens, -1, d), k_norm, self.eps)
        parts = [q.view(num_tokens, -1), k.view(num_tokens, -1), qkv[:, q_size + kv_size :]]
        return torch.cat(parts, dim=1)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary on q and k (the first `rotary_dim` of each head), k and v written to the
        pool; returns q [T, H_q, D]."""
        num_tokens, d, r = qkv.shape[0], self.head_dim, self.family.rotary_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, d)
        if r == d:
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # rotary, q and k at once
        else:  # Phi-3's partial rotary: the rest of each head passes through
            turned = qk[..., :r]
            qk = torch.cat([turned * cos + turned.roll(r // 2, dims=-1) * sin, qk[..., r:]], -1)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, d)
        write_kv(k_cache, v_cache, k, v, metadata.slot_mapping)
        return q

    def mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP (a mixture of experts: the shared expert, with the routed ones)."""
        gate_up = layer.gate_up(x)
        silu = self.family.activation == "silu"
        if self.fused and silu:
            out = layer.down(self.ops.silu_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) if silu else F.gelu(gate, approximate="tanh")
            out = layer.down(act * up)
        return out if layer.experts is None else layer.experts(x, out)
