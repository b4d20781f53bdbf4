"""A GGUF file's weights, read from the file at every start, as transformers reads them.

transformers reads SmolLM2's GGUF file in about 20 s. Most of that is not the weights: it parses
the metadata field by field (the tokenizer's 49,152 tokens and 48,900 merges) twice, and builds
gguf's table of tensor names once for every module of the model. Dequantising the weights takes
under a second. So Loom asks transformers once, when it converts a file into the model cache,
for what is small (the config, the tokenizer, and `names`: which of the file's tensors is which
of the model's weights), and at every start reads the weights here:

- the header is read in milliseconds (loom/model/gguf_file.py);
- each tensor is dequantised by gguf's own `dequantize`, then passed through transformers' own
  processor for the architecture (Llama's q/k rows put back in Hugging Face's order, Gemma's
  norms less one, a mixture's experts stacked), as transformers' `load_gguf_checkpoint` does.

The weights are the same bits as transformers' (tests/model/test_gguf_weights.py, for the
default model and a file of every family), and the cache holds megabytes, not a float32 copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom.model.gguf_file import TensorInfo, mapped, read_header


def tensor_data(buffer: Any, tensor: TensorInfo) -> np.ndarray:
    """The tensor's bytes as gguf's reader gives them: its elements for the float and integer
    types, rows of blocks (uint8) for the quantised ones."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(tensor.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[kind]
    num_bytes = int(np.prod(tensor.shape)) * type_size // block_size
    raw = np.frombuffer(buffer, np.uint8, num_bytes, tensor.offset)
    elements = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip
    if kind.name in elements:
        return raw.view(elements[kind.name]).reshape(tensor.shape)
    return raw.reshape(quant_shape_to_byte_shape(tensor.shape, kind))


def names(model: Any, architecture: str) -> dict[str, str]:
    """Which of the model's weights each of the file's tensors is (GGUF name -> Hugging Face
    name) for `model` (a skeleton on the meta device will do): transformers' mapping (gguf's
    name table, then the processor's renames and fallbacks, as for a mixture's stacked
    experts), with the table built once rather than once for every module."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    (arch,) = [key for key, value in MODEL_ARCH_NAMES.items() if value == architecture]
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    steps = processor(architecture, model.config.to_dict())
    mapping: dict[str, str] = {}
    for hf_name in model.state_dict():
        hf_name = steps.preprocess_name(hf_name)
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(base)
        if gguf_name is None:
            steps.perform_fallback_tensor_mapping(mapping, dot + suffix, "", hf_name)
        else:
            mapping[gguf_name + dot + suffix] = hf_name
    return mapping


def processor(architecture: str, config: dict[str, Any]) -> Any:
    """transformers' tensor processor for the architecture."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor_class: Any = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return processor_class(config=config)


def read_weights(
    path: Path, architecture: str, config: dict[str, Any], mapping: dict[str, str]
) -> dict[str, torch.Tensor]:
    """The model's weights from the file at `path`, named as the model names them, float32
    (float16 tensors of the file widened, as transformers does)."""
    from gguf import GGMLQuantizationType, dequantize

    steps = processor(architecture, config)
    parsed: dict[str, Any] = {"tensors": {}}
    buffer = mapped(path)
    header = read_header(buffer)
    if header.architecture != architecture:
        raise ValueError(f"{path} is a {header.architecture!r} file, not {architecture!r}")
    for tensor in header.tensors:
        weights = dequantize(tensor_data(buffer, tensor), GGMLQuantizationType(tensor.ggml_type))
        result = steps.process(
            weights=weights, name=tensor.name, tensor_key_mapping=mapping,
            parsed_parameters=parsed,
        )  # fmt: skip
        if result.name in mapping:
            parsed["tensors"][mapping[result.name]] = torch.from_numpy(np.copy(result.weights))
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    return tensors
