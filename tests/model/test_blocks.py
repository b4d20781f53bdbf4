"""Weights in llama.cpp's blocks (`--quantization q4`): packing round-trips the default model's
file exactly, the kernels compute the quantised product they promise, and the method runs
through the runner close to the exact path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from loom.bench.quality import logits, runner_for
from loom.model import kernels
from loom.model.blocks import (
    BLOCK,
    BLOCK_ROWS,
    Q4_ROWS,
    Q8_ROWS,
    BlockLinear,
    pack,
    repack,
    unpack,
    unrepack,
)
from loom.model.linear import Linear, check_method, make_linear
from loom.model.loader import LoadedModel, default_model_path

pytestmark = pytest.mark.skipif(
    kernels.unavailable() is not None, reason=f"Loom's CPU kernels: {kernels.unavailable()}"
)


def quantised_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the kernels do to activations, in float64: per block of 32, int8 with scale
    max|x| / 127 (q4 weights), or int16 with scale max|x| / 32767 (q8 weights).
    The integers are rounded as the kernels round them, in float32 (x times max_q / max|x|):
    in float64, a value a hair from a half rounds the other way, one step off."""
    top = 127.0 if bits == 4 else 32767.0
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # (a tensor divided, not `top / amax`: torch computes that as a reciprocal times top)
    inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax.clamp(min=1e-30), 0.0)
    q = (blocks * inverse).round().double()
    return (q * (amax / top).double()).reshape(x.shape)


@pytest.mark.parametrize(
    ("bits", "outputs", "inputs"), [(4, 72, 96), (4, 70, 96), (4, 5, 576), (8, 72, 96)]
)
def test_blocks_kernels_compute_the_quantised_product_to_float_rounding(
    bits: int, outputs: int, inputs: int
) -> None:
    """Every row count up to the switch (the kernels tile rows by 4: each remainder) and one
    above it, with a bias: the product of the blocks' weights and the block-quantised
    activations, to within float32 rounding of the output's scale (measured: up to 1.1e-5).
    Q4_1 computes 8 outputs at a time: 70 of them leave a last group of 6, 5 a lone group."""
    torch.manual_seed(0)
    weight = torch.randn(outputs, inputs) * torch.rand(outputs, 1)
    bias = torch.randn(outputs)
    layer = make_linear(weight, bias, method=f"q{bits}")
    assert isinstance(layer, BlockLinear)
    dequantised = unpack(layer.blocks).double()
    switch = Q4_ROWS if bits == 4 else Q8_ROWS
    for rows in range(1, switch + 2):
        x = torch.randn(rows, inputs) * 3
        out = layer(x)
        if rows <= switch:
            expected = quantised_activations(x, bits) @ dequantised.T + bias.double()
        else:  # above the switch: the exact path over the same weights
            expected = x.double() @ dequantised.T + bias.double()
        error = (out.double() - expected).abs().max() / expected.abs().max()
        assert float(error) < 5e-5, (rows, error)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_packing_round_trips_and_stays_within_half_a_step(bits: int) -> None:
    torch.manual_seed(1)
    weight = torch.randn(16, 128) * torch.rand(16, 1)
    blocks = pack(weight, bits)
    dequantised = unpack(blocks)
    step = blocks.d.repeat_interleave(BLOCK, dim=1)
    assert ((dequantised - weight).abs() <= step / 2 + 1e-3 * step + 1e-7).all()
    again = pack(dequantised, bits)
    assert torch.equal(again.q, blocks.q)
    assert torch.equal(unpack(again), dequantised)


@pytest.mark.parametrize("outputs", [1, 8, 70])
def test_blocks_q4_repacking_round_trips(outputs: int) -> None:
    """The 8-output layout holds the blocks whole: unrepacked, the same bytes, scales and
    minimums; and the nibbles of output 1, block 0 sit in their runs of 4."""
    torch.manual_seed(2)
    blocks = pack(torch.randn(outputs, 64), 4)
    packed = repack(blocks)
    assert packed.q.shape == (-(-outputs // 8), 2, 128)
    again = unrepack(packed)
    assert torch.equal(again.q, blocks.q)
    assert torch.equal(again.d, blocks.d)
    assert torch.equal(again.m, blocks.m)  # type: ignore[arg-type]
    if outputs > 1:
        runs = [packed.q[0, 0, 32 * i + 4 : 32 * i + 8] for i in range(4)]
        assert torch.equal(torch.cat(runs), blocks.q[1, :16])


def test_blocks_q4_kernel_refuses_a_layout_that_does_not_match() -> None:
    """The op checks what it is handed: an output count of another group count, scales in
    the wrong dtype, a bias of another shape."""
    kernels.load()
    packed = repack(pack(torch.randn(72, 64), 4))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="r8 layout for 80 outputs"):
        torch.ops.loom.q4r8_linear(x, packed.q, packed.dm, 80, None)
    with pytest.raises(RuntimeError, match="expected layout"):
        torch.ops.loom.q4r8_linear(x, packed.q, packed.dm.float(), 72, None)
    with pytest.raises(RuntimeError, match="the bias does not match"):
        torch.ops.loom.q4r8_linear(x, packed.q, packed.dm, 72, torch.zeros(72, 1))
    with pytest.raises(RuntimeError, match="input size 96 does not match"):
        torch.ops.loom.q4r8_linear(torch.randn(2, 96), packed.q, packed.dm, 72, None)


def test_blocks_refuse_an_input_size_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="input size 40 is not a multiple of the block size 32"):
        pack(torch.zeros(4, 40), 4)


def test_blocks_q4_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="quantization=q4 runs on cpu in float32, not on cuda"):
        check_method("q4", torch.device("cuda"), torch.bfloat16)


@pytest.mark.smollm2
def test_blocks_packing_smollm2_gives_back_the_files_own_blocks(smollm2: LoadedModel) -> None:
    """Q4_1 -> transformers' dequantised weights -> packed: the file's bytes (d, m and the
    nibbles of a layer; d and q of the Q8_0 embedding), and unpacking gives transformers'
    weights bit for bit, for every layer."""
    reader = GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    weights = smollm2.model.state_dict()

    file_blocks = np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(576, -1, 20)
    packed = pack(weights["model.layers.0.mlp.down_proj.weight"], 4)
    scales = file_blocks[..., :4].copy().view(np.float16).astype(np.float32)
    assert torch.equal(packed.d, torch.from_numpy(scales[..., 0]))
    assert packed.m is not None
    assert torch.equal(packed.m, torch.from_numpy(scales[..., 1]))
    assert torch.equal(packed.q, torch.from_numpy(file_blocks[..., 4:].reshape(576, -1).copy()))

    file_blocks = np.asarray(tensors["token_embd.weight"].data).reshape(49152, -1, 34)
    packed = pack(weights["model.embed_tokens.weight"], 8)
    d = file_blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    assert torch.equal(packed.d, torch.from_numpy(d))
    q = file_blocks[..., 2:].copy().view(np.int8).reshape(49152, -1)
    assert torch.equal(packed.q, torch.from_numpy(q))

    layer_weights = [w for name, w in weights.items() if name.endswith("proj.weight")]
    assert len(layer_weights) == 7 * 30
    for w in [*layer_weights, weights["model.embed_tokens.weight"]]:
        bits = 8 if w.shape[0] == 49152 else 4
        assert torch.equal(unpack(pack(w, bits)), w)


def as_if_from_a_gguf(loaded: LoadedModel) -> LoadedModel:
    """The model with its layers' weights in Q4_1 and its embedding and LM head in Q8_0
    already, as the default model's file has them: the exact path and q4 then share their
    weights, and differ by q4's arithmetic alone."""
    weights = loaded.model.state_dict()
    for name, w in weights.items():
        if name.endswith("proj.weight"):
            w.copy_(unpack(pack(w, 4)))
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w.copy_(unpack(pack(w, 8)))
    return loaded


def test_blocks_q4_through_the_runner_stays_close_to_the_exact_logits(tiny: LoadedModel) -> None:
    """A 40-token prompt scored as q4 decodes (BLOCK_ROWS tokens a forward, so the kernels do
    every product): each position's logits within 5% of the exact ones over the same weights
    (relative L2 norm; measured 2.3%), the same top token at 85% of positions or more
    (measured 97.5 to 100%)."""
    loaded = as_if_from_a_gguf(tiny)
    prompt = [
        int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    ]
    exact = logits(runner_for(loaded, "none", 64), prompt)
    runner = runner_for(loaded, "q4", 64)
    assert all(isinstance(layer.down, BlockLinear) for layer in runner.model.layers)
    assert isinstance(runner.model.lm_head, BlockLinear)
    assert runner.model.lm_head.blocks.bits == 8
    assert isinstance(runner.model.lm_head.dense, Linear)
    q4 = torch.cat(
        [
            logits(runner, prompt[: start + BLOCK_ROWS], start)
            for start in range(0, len(prompt), BLOCK_ROWS)
        ]
    )
    error = (q4 - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(error.max()) < 0.05, error
    agree = (q4.argmax(dim=-1) == exact.argmax(dim=-1)).float().mean()
    assert float(agree) >= 0.85, agree
