"""The linear layers' arithmetic, chosen by `--quantization` as in vLLM: `none`, the exact path
and correctness oracle, or a quantised method that changes the arithmetic openly.

- `none`: the weights in the model's dtype. On CPU they are prepacked for oneDNN, the path
  torch's own compiler takes there: on this project's 2-core CPU machines 1.5 to 3 times faster
  than `F.linear` (MKL) at 1 to 64 rows. Elsewhere, or without oneDNN: `F.linear`.
- `int8`: weights in int8, one symmetric scale per output channel; activations quantised to
  int8 as they come, the products in int8 with int32 sums, in fbgemm (x86; qnnpack elsewhere):
  torch's dynamic quantised Linear without its module. Each row of activations is brought to
  the same range first, so that each row has in effect its own scale; the activations' outlier
  channels are moved into the weights beforehand (loom/model/smoothing.py). The layers where
  int8 costs the most quality, measured (the MLP's down projection, whose input is SiLU(gate) *
  up, and the LM head), stay exact. CPU and float32 only. It reads a quarter of fp32's bytes,
  which is what a decode step at small batch is bound by.
- `q4`: llama.cpp's Q4_1 blocks (4-bit weights with a scale and a minimum per 32) for the
  layers, Q8_0 blocks for the LM head, activations quantised to int8 per block of 32 as they
  come, in Loom's own kernels (loom/model/blocks.py). The default model's file is Q4_1 with a
  Q8_0 embedding, so its weights are held with no loss beyond the file's own, and only as
  blocks: they are multiplied in place at every row count, decode and prefill. A layer whose
  input size is not a multiple of 32 stays exact. CPU (AVX2) and float32 only.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812

from loom.model import kernels
from loom.model.blocks import BLOCK, BlockLinear, pack

METHODS = ("none", "int8", "q4")


class LinearLayer(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# Where a layer computes otherwise than its method says: int8's costliest layers stay exact;
# q4's LM head is in 8-bit blocks, as the default model's file holds it.
LAYER_METHODS = {"int8": {"down": "none", "lm_head": "none"}, "q4": {"lm_head": "q8"}}


def method_for(method: str, layer: str) -> str:
    """The method a layer of this kind (qkv, o, gate_up, down, lm_head) computes with."""
    return LAYER_METHODS.get(method, {}).get(layer, method)


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, method: str = "none"
) -> LinearLayer:
    """`x @ weight.T + bias`, computed by `method` (one of METHODS)."""
    if method == "none":
        return Linear(weight, bias)
    if method == "int8":
        return Int8Linear(weight, bias)
    if method in ("q4", "q8") and weight.shape[1] % BLOCK:  # not whole blocks: exact
        return Linear(weight, bias)
    if method in ("q4", "q8"):
        return BlockLinear(pack(weight, bits=int(method[1:])), bias)
    raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")


def check_method(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Whether `method` runs on `device` in `dtype`, else a ValueError that says why not."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "none" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"quantization={method} runs on cpu in float32, not on {device.type} in "
            f"{str(dtype).removeprefix('torch.')}"
        )
    if method == "q4" and (reason := kernels.unavailable()) is not None:
        raise ValueError(f"quantization=q4 needs Loom's CPU kernels: {reason}")


class Linear:
    """The exact path: the weight as loaded, prepacked for oneDNN where it can be."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        if weight.device.type == "cpu" and onednn:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self.weight = None
            except RuntimeError:  # a dtype or build oneDNN does not take
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out


class Int8Linear:
    """Dynamic int8: int8 weights (per output channel), activations quantised per row at run
    time. The packed layout depends on the CPU it is packed on, so it is made at load and
    never kept on disk."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero_point = torch.zeros(weight.shape[0], dtype=torch.long)
        select_quantized_engine()
        with warnings.catch_warnings():  # quantised tensors are deprecated; the kernels are not
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scale, zero_point, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm quantises activations with one scale a call (7 bits, so that its int16 pair
        sums cannot overflow): rows are scaled to one range first and back after."""
        rows = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(x / rows, self.packed, True)
        out = out * rows
        return out if self.bias is None else out + self.bias


def select_quantized_engine() -> None:
    """fbgemm on x86, qnnpack elsewhere (the first this build has)."""
    engines = torch.backends.quantized.supported_engines
    for engine in ("fbgemm", "x86", "qnnpack"):
        if engine in engines:
            torch.backends.quantized.engine = engine
            return
    raise ValueError(f"quantization=int8 needs fbgemm or qnnpack; this torch has {engines}")
