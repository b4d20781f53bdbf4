"""The linear layers' methods (`--quantization`): each computes `x @ W.T + b` through the runner,
the quantised ones within a stated tolerance of the exact one."""

from __future__ import annotations

import attrs
import pytest
import torch

from loom.bench.quality import logits, runner_for
from loom.model.linear import Int8Linear, check_method, make_linear
from loom.model.loader import LoadedModel, ModelConfig


def test_linear_int8_weights_are_within_half_a_step_of_the_exact_ones() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * torch.rand(96, 1)  # rows of different ranges
    layer = Int8Linear(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantized() - weight).abs() <= step / 2 + 1e-6).all()


def test_linear_int8_products_stay_within_two_percent_of_the_exact_ones() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(5, 64)
    exact = make_linear(weight, bias)(x)
    int8 = make_linear(weight, bias, method="int8")(x)
    assert float((int8 - exact).norm() / exact.norm()) < 0.02


def test_linear_unknown_or_unsupported_methods_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8, got 'int3'"):
        make_linear(torch.zeros(2, 2), method="int3")
    with pytest.raises(ValueError, match="quantization=int8 runs on cpu in float32, not on cuda"):
        check_method("int8", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="not on cpu in bfloat16"):
        ModelConfig(quantization="int8", dtype="bf16", device="cpu")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="fp4")


def test_linear_int8_through_the_runner_stays_close_to_the_exact_logits(
    tiny: LoadedModel,
) -> None:
    """Over a 40-token prompt, every position's int8 logits are within 20% of the exact ones
    (relative L2 norm; measured 4 to 12% on these random models: activations quantised to 7
    bits a tensor lose that much) and pick the same top token at most positions."""
    prompt = [
        int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    ]
    exact = logits(runner_for(tiny, "none", 64), prompt)
    int8 = logits(runner_for(tiny, "int8", 64), prompt)
    error = (int8 - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(error.max()) < 0.20, error
    agree = (int8.argmax(dim=-1) == exact.argmax(dim=-1)).float().mean()
    assert float(agree) >= 0.8, agree


def test_linear_the_loaded_method_reaches_every_linear_layer(tiny: LoadedModel) -> None:
    runner = runner_for(attrs.evolve(tiny, quantization="none"), "int8", 16)
    model = runner.model
    layers = [
        model.lm_head,
        *(getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")),
    ]
    assert all(isinstance(layer, Int8Linear) for layer in layers)
