"""The Llama-family forward's one-call decode step (`torch.ops.loom.llama_layers`,
loom/model/kernels/layers.cpp): the same bits as the per-op path, with biases and norms that
would show a tensor taken from the wrong place, and its checks against malformed calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from loom.bench.quality import BLOCK_SIZE
from loom.core.config import CacheConfig
from loom.core.step import ScheduledSequence
from loom.model import kernels
from loom.model.attention import decode_group
from loom.model.decoder import DecoderModel
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.model.test_blocks import as_if_from_a_gguf
from tests.support.sync_audit import SyncAudit

pytestmark = pytest.mark.skipif(
    kernels.unavailable() is not None, reason=f"Loom's CPU kernels: {kernels.unavailable()}"
)


def decode_runner(kv_cache_dtype: str = "auto", num_blocks: int = 16, **config: Any) -> ModelRunner:
    """A tiny q4 model whose biases (qwen2's qkv; llama's with `attention_bias`) and norms are
    random, not transformers' zeros and ones, so that a bias or a norm taken from the wrong
    place shows; its pool of `num_blocks` blocks filled with random values, as written pages."""
    family = config.pop("family", "llama")
    loaded = tiny_model(family, **config)
    for name, p in loaded.model.named_parameters():
        if name.endswith(".bias"):
            p.data.normal_()
        elif name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
    cache = CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=num_blocks + 1, kv_cache_dtype=kv_cache_dtype
    )
    runner = ModelRunner(attrs.evolve(as_if_from_a_gguf(loaded), quantization="q4"), cache)
    for layer in runner.kv_cache.k + runner.kv_cache.v:
        layer.normal_()
    return runner


def decode_step(contexts: list[int]) -> list[ScheduledSequence]:
    """A decode step: sequence i decodes one token over contexts[i] cached ones, its blocks
    after the sequence before it's."""
    sequences, first_block = [], 1
    for i, context in enumerate(contexts):
        used = -(-(context + 1) // BLOCK_SIZE)
        table = tuple(range(first_block, first_block + used))
        sequences.append(
            ScheduledSequence(
                request_id=str(i),
                token_ids=(7 + i,),
                num_computed_tokens=context,
                block_table=table,
            )
        )
        first_block += used
    return sequences


@pytest.mark.parametrize(
    "config",
    [{}, {"family": "qwen2"}, {"attention_bias": True}, {"kv_cache_dtype": "fp16"}],
    ids=["llama", "qwen2-qkv-bias", "llama-attention-bias", "llama-fp16-pool"],
)
def test_blocks_q4_decode_layers_in_one_call_are_the_per_op_path_bit_for_bit(
    config: dict[str, Any],
) -> None:
    """A q4 decode step of three sequences, its layers in one call into the kernels
    (`torch.ops.loom.llama_layers`), gives the very hidden states and K/V pool of the same
    kernels called one by one from Python."""
    config = dict(config)
    runner = decode_runner(config.pop("kv_cache_dtype", "auto"), **config)
    model, pool = runner.model, runner.kv_cache
    sequences = decode_step([5, 20, 37])
    assert decode_group(runner.attention_metadata(sequences)) is not None
    decode_weights = model.decode_weights
    assert decode_weights is not None
    assert any(b is not None for b in decode_weights.biases) == bool(config)
    before = [layer.clone() for layer in pool.k + pool.v]
    fused = runner.forward(sequences)
    fused_pool = [layer.clone() for layer in pool.k + pool.v]
    for layer, saved in zip(pool.k + pool.v, before, strict=True):
        layer.copy_(saved)
    model.decode_weights = None  # the per-op path
    per_op = runner.forward(sequences)
    assert torch.equal(fused, per_op)
    assert all(map(torch.equal, fused_pool, pool.k + pool.v))
    assert not torch.equal(fused_pool[0], before[0])  # the step's keys were written


def test_blocks_q4_decode_layers_in_one_region_are_each_kernel_in_its_own_bit_for_bit() -> None:
    """40 sequences (so that the norms, rotary and the products' rows are shared out among the
    threads too): the layers in one parallel region give the very hidden states and pool of the
    same call with each kernel in a region of its own, and of the per-op path."""
    assert torch.get_num_threads() > 1  # else there is nothing to share out
    runner = decode_runner(num_blocks=48)
    model, pool = runner.model, runner.kv_cache
    sequences = decode_step([(7 * i) % 15 for i in range(40)])
    before = [layer.clone() for layer in pool.k + pool.v]
    results = []
    for one_region, decode_weights in [
        (True, model.decode_weights),
        (False, None),
        (False, model.decode_weights),
    ]:
        for layer, saved in zip(pool.k + pool.v, before, strict=True):
            layer.copy_(saved)
        model.one_region, model.decode_weights = one_region, decode_weights
        results.append((runner.forward(sequences), [layer.clone() for layer in pool.k + pool.v]))
    for hidden, layers in results[1:]:
        assert torch.equal(hidden, results[0][0])
        assert all(map(torch.equal, layers, results[0][1]))
    assert not torch.equal(results[0][1][0], before[0])


def llama_layers_args(runner: ModelRunner) -> dict[str, Any]:
    """A well-formed call of `llama_layers` for one sequence decoding over an empty pool."""
    w, pool, model = runner.model.decode_weights, runner.kv_cache, runner.model
    assert w is not None
    one = torch.ones(1, dtype=torch.long)
    return {
        "hidden": torch.ones(1, model.hidden_size),
        "cos": torch.ones(1, 1, model.head_dim),
        "sin": torch.zeros(1, 1, model.head_dim),
        "slots": one * BLOCK_SIZE,
        "block_tables": one.view(1, 1),
        "seq_lens": one,
        "weights": list(w.weights),
        "sizes": list(w.sizes),
        "biases": list(w.biases),
        "k_caches": pool.k,
        "v_caches": pool.v,
        "num_heads": model.num_heads,
        "eps": model.eps,
        "scale": model.scale,
    }


@pytest.mark.parametrize("short", ["weights", "sizes", "biases", "v_caches"])
def test_blocks_q4_decode_layers_refuse_a_layer_short_of_tensors(short: str) -> None:
    """`llama_layers` checks its lists against the layers' count before reading any."""
    args = llama_layers_args(decode_runner())
    torch.ops.loom.llama_layers(**args)  # well-formed: runs
    args[short] = args[short][:-1]
    with pytest.raises(RuntimeError, match="10 weights, 4 sizes and biases"):
        torch.ops.loom.llama_layers(**args)


@pytest.mark.parametrize(
    ("index", "wrong"),
    [
        (10 + 1, lambda w: w[:, :-1]),  # layer 1's qkv blocks, one block of inputs short
        (10 + 2, lambda w: w.float()),  # its qkv scales in float32
        (10 + 5, lambda w: w[:-8]),  # its post-attention norm, short
        (10 + 8, lambda w: w.to(torch.int8)),  # its down blocks, signed
    ],
)
def test_blocks_q4_decode_layers_refuse_a_malformed_layer_before_any_runs(
    index: int, wrong: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """A malformed tensor in the second layer is refused, by its layer, before the first layer
    writes the residual stream or the pool."""
    runner = decode_runner()
    args = llama_layers_args(runner)
    args["weights"][index] = wrong(args["weights"][index])
    hidden, pool = args["hidden"].clone(), [t.clone() for t in runner.kv_cache.k]
    with pytest.raises(RuntimeError, match="layer 1: "):
        torch.ops.loom.llama_layers(**args)
    assert torch.equal(args["hidden"], hidden)
    assert all(map(torch.equal, pool, runner.kv_cache.k))


def test_decoder_tied_embedding_is_the_lm_head_s_weight_not_a_copy() -> None:
    """A tied LM head that keeps its float weight (a GPU's; float16 here, which oneDNN does not
    prepack on the CPU) lends that very tensor to the embedding: one copy of the vocabulary's
    rows, not two (SmolLM2's: 57 MB in bfloat16)."""
    loaded = tiny_model("llama", tie_word_embeddings=True)
    loaded.model.to(torch.float16)
    model = DecoderModel(loaded.model)
    head_weight = model.lm_head.weight  # type: ignore[attr-defined]
    assert head_weight is not None
    assert model.embedding.keywords["weight"] is head_weight  # type: ignore[attr-defined]
    ids = torch.tensor([3, 1, 4])
    assert torch.equal(model.embedding(ids), loaded.model.model.embed_tokens(ids))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_decoder_forward_of_a_mixed_step_waits_on_nothing(family: str) -> None:
    """A step with prompt chunks of unequal lengths (padded queries) beside decodes: once its
    metadata is built, the model's forward records no op that makes the host wait (the padded
    rows are dropped by an index found on the host, not by a boolean mask each layer)."""
    config = {"head_dim": 16, "sliding_window": 6} if family == "gemma2" else {}
    runner = ModelRunner(tiny_model(family, **config), CacheConfig(num_blocks=32, block_size=4))
    sequences = [
        ScheduledSequence(
            request_id="a", token_ids=(1, 2, 3, 4, 5), num_computed_tokens=0, block_table=(1, 2)
        ),
        ScheduledSequence(
            request_id="b", token_ids=(6, 7), num_computed_tokens=0, block_table=(3,)
        ),
        ScheduledSequence(
            request_id="c", token_ids=(8,), num_computed_tokens=6, block_table=(4, 5)
        ),
    ]
    metadata = runner.attention_metadata(sequences)
    ids = torch.tensor([t for s in sequences for t in s.token_ids])
    positions = torch.cat(
        [
            torch.arange(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))
            for s in sequences
        ]
    )
    with SyncAudit() as audit:
        runner.model.forward(ids, positions, metadata, runner.kv_cache)
    assert dict(audit.ops) == {}
