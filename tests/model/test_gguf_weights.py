"""A GGUF file's weights as Loom reads them at every start: the bits transformers' own reader
gives, whatever type the file stores them in (the default model's: tests/model/test_loader.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from loom.model.gguf_file import read_file_header
from loom.model.gguf_weights import read_weights
from loom.model.loader import TENSORS_FILE, converted_gguf_folder, default_model_path, load_model
from tests.conftest import tiny_model
from tests.model.test_loader import assert_same_weights, transformers_read
from tests.support.gguf_writer import small_tokenizer_fields, write_model_gguf

CPU = torch.device("cpu")
# gguf can write these (its K-quants it only reads); llama.cpp's files hold any of them.
TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture(scope="module")
def tokenizer() -> list[tuple[str, Any, Any, Any]]:
    return small_tokenizer_fields(default_model_path(), 512)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_gguf_weights_are_transformers_bits_in_every_type(
    family: str, tmp_path: Path, tokenizer: list[tuple[str, Any, Any, Any]]
) -> None:
    """A Llama (q and k rows permuted in the file) and a mixture (experts stacked from three
    tensors) with their matrices in each type in turn: Loom's weights are transformers'."""
    config = {"num_experts": 4, "num_experts_per_tok": 2} if family == "qwen2_moe" else {}
    original = tiny_model(family, **config)
    path = write_model_gguf(original.model, tmp_path / "model.gguf", tokenizer, TYPES)
    stored = {t.ggml_type for t in read_file_header(path).tensors}
    assert {gguf.GGMLQuantizationType[name] for name in TYPES} <= stored
    loaded = load_model(str(path), dtype=torch.float32, device=CPU, cache_dir=tmp_path / "cache")
    assert_same_weights(loaded.model, transformers_read(path))


def test_gguf_weights_load_in_the_asked_dtype(
    tmp_path: Path, tokenizer: list[tuple[str, Any, Any, Any]]
) -> None:
    original = tiny_model("llama")
    path = write_model_gguf(original.model, tmp_path / "model.gguf", tokenizer, ("Q8_0",))
    loaded = load_model(str(path), dtype=torch.bfloat16, device=CPU, cache_dir=tmp_path)
    reference = transformers_read(path).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert_same_weights(loaded.model, reference)


def test_gguf_weights_of_a_file_cut_short_are_refused_by_a_value_error(
    tmp_path: Path, tokenizer: list[tuple[str, Any, Any, Any]]
) -> None:
    """A file whose last tensor runs past its end (a copy cut short): refused, nothing read
    out of bounds."""
    path = write_model_gguf(tiny_model("llama").model, tmp_path / "model.gguf", tokenizer)
    folder = converted_gguf_folder(path, tmp_path / "cache")
    tensors = json.loads((folder / TENSORS_FILE).read_text())
    config = json.loads((folder / "config.json").read_text())
    assert read_weights(path, "llama", config, tensors["names"])
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="smaller than requested"):
        read_weights(path, "llama", config, tensors["names"])
