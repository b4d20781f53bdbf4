"""Shared fixtures: tiny random-weight models of each family built from configs, and SmolLM2.

Rules for every test: loopback only, port 0, a timeout on every I/O test, real components.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The Triton kernels run under Triton's interpreter where the tests run on the CPU. Set before
# torch (which may import triton) is imported: triton decorates its own library's functions
# for the interpreter or the compiler when it is first imported.
if os.environ.get("LOOM_TEST_DEVICE", "cpu").startswith("cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import trio
import trio.testing
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from loom.model.loader import (
    LoadedModel,
    converted_gguf_folder,
    default_model_path,
    load_model,
    model_cache_root,
)
from tests.support.placement import DEVICE, DTYPE

TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # Larger than the usual 0.02, so that greedy choices are not near-ties decided by rounding.
    "initializer_range": 0.1,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}

FAMILIES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}
LLAMA_SHAPED = ("llama", "mistral", "qwen2")  # the `tiny` fixture's (the others: test_families)


def tiny_model(
    family: str,
    seed: int = 0,
    *,
    vocab_size: int = 512,
    tokenizer: Any = None,
    context: int = 512,
    **config: Any,
) -> LoadedModel:
    """A random-weight model, on the tests' device in their dtype (tests/support/placement.py:
    the CPU and float32 unless LOOM_TEST_DEVICE and LOOM_TEST_DTYPE say); with a tokenizer,
    give `vocab_size=len(tokenizer)`; `config` adds to or overrides the tiny shape
    (`attention_bias=True`, say)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    shape = {**TINY_SHAPE, "vocab_size": vocab_size, "max_position_embeddings": context, **config}
    model = model_cls(config_cls(**shape)).eval()  # initialised on the CPU: the same weights
    return LoadedModel(
        name=f"tiny-{family}",
        model=model.to(DEVICE, DTYPE),
        tokenizer=tokenizer,
        dtype=DTYPE,
        device=DEVICE,
    )


@pytest.fixture(params=LLAMA_SHAPED)
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real default model, converted once into the user's model cache."""
    return load_model(None, dtype=DTYPE, device=DEVICE)


@pytest.fixture
def idle_jump_clock(mock_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    """Virtual time that jumps to the next timer once every task has idled for 0.5 s of real time.

    Plain `autojump_clock` also jumps while a step runs in the worker thread (the trio tasks
    all wait on it), which would fire deadlines and `fail_after` mid-step. Tiny-model steps
    take milliseconds, so half a second of idleness means there is truly nothing to do; a
    shorter threshold let a slow step on a loaded machine jump to `fail_after`."""
    mock_clock.autojump_threshold = 0.5
    return mock_clock


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2's byte-level BPE tokenizer (from the converted default model in the cache)."""
    folder = converted_gguf_folder(default_model_path(), model_cache_root())
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> Path:
    """A tiny random Llama saved with SmolLM2's tokenizer: a model folder for `loom` processes."""
    return saved_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_tokenizer)


def saved_tiny(folder: Path, family: str, tokenizer: Any) -> Path:
    """A tiny random model of `family` saved in `folder` with `tokenizer`."""
    loaded = tiny_model(family, vocab_size=len(tokenizer), tokenizer=tokenizer)
    loaded.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def random_prompt() -> Callable[[int, int], list[int]]:
    generator = torch.Generator().manual_seed(1234)

    def make(length: int, vocab: int = 512) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    return make
