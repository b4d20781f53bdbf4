"""Fixtures of the server tests."""

from __future__ import annotations

from typing import Any

import pytest

from loom.model.loader import LoadedModel
from tests.conftest import tiny_model


@pytest.fixture
def tiny_chat(smollm2_tokenizer: Any) -> LoadedModel:
    """A tiny random Llama over SmolLM2's tokenizer: text and chat prompts work."""
    return tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
