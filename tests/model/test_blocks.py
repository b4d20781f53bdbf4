"""Weights in llama.cpp's blocks (`--quantization q4`): packing round-trips the default model's
file exactly, the kernels compute the quantised product they promise, and the method runs
through the runner close to the exact path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from loom.bench.quality import logits, runner_for
from loom.model import kernels
from loom.model.blocks import BLOCK, BlockLinear, pack, repack, unpack, unrepack
from loom.model.linear import check_method, make_linear
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


# Rows: every remainder of the tiles of 4, and past the chunks of rows whose activations stay
# in L1 (at 576 inputs: 28 rows for q4, 12 for q8). Outputs: a last group of 6 (70), a lone
# group of 5, and more groups than one block of them in L2 (520 for q4, 300 for q8 at 576).
ROWS = [*range(1, 10), 13, 30, 61]
SHAPES = [(4, 72, 96), (4, 70, 96), (4, 5, 576), (4, 520, 576), (8, 72, 96), (8, 300, 576)]


def layer_and_input(bits: int, outputs: int, inputs: int) -> tuple[BlockLinear, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(outputs, inputs) * torch.rand(outputs, 1)
    layer = make_linear(weight, torch.randn(outputs), method=f"q{bits}")
    assert isinstance(layer, BlockLinear)
    return layer, torch.randn(max(ROWS), inputs) * 3


@pytest.mark.parametrize(("bits", "outputs", "inputs"), SHAPES)
def test_blocks_kernels_compute_the_quantised_product_to_float_rounding(
    bits: int, outputs: int, inputs: int
) -> None:
    """At every row count, with a bias: the product of the blocks' weights and the
    block-quantised activations, to within float32 rounding of the output's scale (measured:
    up to 1.1e-5). The kernels compute 8 outputs at a time, 4 rows at a time."""
    layer, x_all = layer_and_input(bits, outputs, inputs)
    dequantised = unpack(layer.blocks).double()
    assert layer.bias is not None
    for rows in ROWS:
        x = x_all[:rows]
        out = layer(x)
        expected = quantised_activations(x, bits) @ dequantised.T + layer.bias.double()
        error = (out.double() - expected).abs().max() / expected.abs().max()
        assert float(error) < 5e-5, (rows, error)


AVX2_SCRIPT = """
import sys, torch
from tests.model.test_blocks import SHAPES, layer_and_input
torch.save([layer(x) for layer, x in (layer_and_input(*s) for s in SHAPES)], sys.argv[1])
"""


@pytest.mark.skipif(kernels.isa() == "avx2", reason="the tests above check the AVX2 products")
def test_blocks_vnni_products_equal_the_avx2_ones_bit_for_bit(tmp_path: Path) -> None:
    """Where the kernels use VNNI, the AVX2 build (LOOM_KERNELS=avx2, another process) gives
    the same outputs to the bit: both sum the same integers exactly, then apply the same
    float operations in the same order."""
    env = {**os.environ, "LOOM_KERNELS": "avx2"}
    path = tmp_path / "avx2.pt"
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-c", AVX2_SCRIPT, str(path)], env=env, check=True, cwd=root)
    avx2 = torch.load(path)
    vnni = [layer(x) for layer, x in (layer_and_input(*shape) for shape in SHAPES)]
    for shape, a, b in zip(SHAPES, avx2, vnni, strict=True):
        assert torch.equal(a, b), shape


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


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("outputs", [1, 8, 70])
def test_blocks_repacking_round_trips(bits: int, outputs: int) -> None:
    """The 8-output layout holds the blocks whole: unrepacked, the same bytes, scales (and
    minimums); and the bytes of output 1, block 0 sit in their runs (4 bytes for Q4_1, 2 for
    Q8_0)."""
    torch.manual_seed(2)
    blocks = pack(torch.randn(outputs, 64), bits)
    packed = repack(blocks)
    assert packed.bits == bits
    assert packed.q.shape == (-(-outputs // 8), 2, 128 if bits == 4 else 256)
    again = unrepack(packed)
    assert torch.equal(again.q, blocks.q)
    assert torch.equal(again.d, blocks.d)
    assert again.m is None if bits == 8 else torch.equal(again.m, blocks.m)  # type: ignore[arg-type]
    if outputs > 1:
        run, row_bytes = (4, 16) if bits == 4 else (2, 32)
        at = [8 * run * i + run for i in range(row_bytes // run)]  # run i of row 1
        runs = [packed.q[0, 0, start : start + run] for start in at]
        assert torch.equal(torch.cat(runs), blocks.q[1, :row_bytes])


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_rows_are_the_weights_rows(bits: int) -> None:
    """An embedding looked up in the repacked blocks: each row id's dequantised row, bit for
    bit, in the order asked, repeats and the padded last group's rows included."""
    blocks = pack(torch.randn(70, 64), bits)
    ids = torch.tensor([69, 0, 7, 8, 69, 33, 64])
    packed = repack(blocks)
    assert torch.equal(packed.rows(ids), unpack(blocks)[ids])
    assert packed.rows(ids[:0]).shape == (0, 64)
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 70\)"):
        packed.rows(torch.tensor([70]))  # a padded row of the last group


def test_blocks_q4_kernel_refuses_a_layout_that_does_not_match() -> None:
    """The op checks what it is handed: an output count of another group count, scales in
    the wrong dtype, a bias of another shape, Q8_0 blocks."""
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
    q8 = repack(pack(torch.randn(72, 64), 8))
    with pytest.raises(RuntimeError, match="expected layout"):
        torch.ops.loom.q4r8_linear(x, q8.q, q8.dm, 72, None)
    with pytest.raises(RuntimeError, match="r8 layout for 72 outputs"):
        torch.ops.loom.q8r8_linear(x, q8.q.view(torch.int8), packed.dm, 72, None)


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
    """A 40-token prompt scored as q4 prefills it, one forward, then as it decodes, a token a
    forward: each position's logits within 5% of the exact ones over the same weights
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
    prefilled = logits(runner, prompt)
    decoded = torch.cat([logits(runner, prompt[: start + 1], start) for start in range(40)])
    for q4 in (prefilled, decoded):
        error = (q4 - exact).norm(dim=-1) / exact.norm(dim=-1)
        assert float(error.max()) < 0.05, error
        agree = (q4.argmax(dim=-1) == exact.argmax(dim=-1)).float().mean()
        assert float(agree) >= 0.85, agree
