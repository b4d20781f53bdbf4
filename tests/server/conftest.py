"""Fixtures of the server tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from loom.model.loader import (
    LoadedModel,
    converted_gguf_folder,
    default_model_path,
    model_cache_root,
)
from tests.conftest import tiny_model


@pytest.fixture
def tiny_chat(smollm2_tokenizer: Any) -> LoadedModel:
    """A tiny random Llama over SmolLM2's tokenizer (and its files, for GetTokenizer): text and
    chat prompts work."""
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    folder = converted_gguf_folder(default_model_path(), model_cache_root())
    return attrs.evolve(loaded, tokenizer_folder=folder)


# Three tenants' keys: a, b (of weight 2) and an admin.
KEYS = "key-of-a a\nkey-of-b b weight=2  # b counts double\nkey-of-root ops admin\n"


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return str(path)
