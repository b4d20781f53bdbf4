"""Model loading: a saved folder, GGUF conversion into the cache, and the default model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.model.family import UnsupportedModelError
from loom.model.gguf_metadata import check_gguf
from loom.model.loader import (
    TENSORS_FILE,
    ModelConfig,
    converted_gguf_folder,
    default_model_path,
    load_model,
    model_cache_root,
    model_name,
)
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.support.gguf_writer import small_tokenizer_fields, write_model_gguf
from tests.support.greedy import GreedyRequest, reference_tokens, run_greedy

CPU = torch.device("cpu")


def test_loader_loads_a_hugging_face_folder_in_the_asked_dtype(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2")
    tiny.model.save_pretrained(tmp_path / "tiny-qwen2")
    loaded = load_model(str(tmp_path / "tiny-qwen2"), dtype=torch.bfloat16, device=CPU)
    assert loaded.name == "tiny-qwen2"
    assert loaded.model.config.model_type == "qwen2"
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    original = tiny.model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    reloaded = loaded.model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(original.bfloat16(), reloaded)


def test_loader_model_config_loads_its_folder_on_the_cpu_in_float32(
    tiny_folder: Path, smollm2_tokenizer: Any
) -> None:
    loaded = ModelConfig(model=str(tiny_folder), device="cpu").load()
    assert (loaded.name, loaded.dtype, loaded.device) == (tiny_folder.name, torch.float32, CPU)
    # The tiny config names no EOS: the tokenizer's is taken.
    assert loaded.eos_token_ids == (smollm2_tokenizer.eos_token_id,)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dtype": "int3"}, "dtype must be one of auto, float32"),
        ({"dtype": "float16", "device": "cpu"}, "float16 is supported on cuda only"),
        ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ],
)
def test_loader_model_config_refuses_bad_names_when_made(
    settings: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**settings)


def test_loader_cache_root_prefers_flag_then_env_then_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "env"))
    assert model_cache_root(tmp_path / "flag") == tmp_path / "flag"
    assert model_cache_root() == tmp_path / "env"
    monkeypatch.delenv("LOOM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_root() == tmp_path / "xdg" / "loom"


def test_loader_rejects_a_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        converted_gguf_folder(tmp_path / "absent.gguf", tmp_path)


def test_loader_default_model_is_the_smollm2_gguf_of_the_wheel() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert model_name(None) == "SmolLM2-135M-Instruct"


@pytest.mark.smollm2
def test_loader_converts_gguf_once_then_reads_its_weights_as_transformers_does(
    tmp_path: Path,
) -> None:
    """The cache keeps the config, the tokenizer and the tensors' names (megabytes, no
    weights); each load reads the weights from the file, the bits transformers' reader gives."""
    first = load_model(None, dtype=torch.float32, device=CPU, cache_dir=tmp_path)
    (folder,) = (tmp_path / "gguf").iterdir()
    assert {"config.json", "tokenizer.json", TENSORS_FILE} <= {p.name for p in folder.iterdir()}
    assert not list(folder.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in folder.iterdir()) < 5e6
    stamp = (folder / TENSORS_FILE).stat().st_mtime_ns
    second = load_model(None, dtype=torch.float32, device=CPU, cache_dir=tmp_path)
    assert (folder / TENSORS_FILE).stat().st_mtime_ns == stamp  # not converted again
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [folder.name]  # no leftovers
    assert first.model.config.num_hidden_layers == second.model.config.num_hidden_layers == 30
    assert_same_weights(second.model, transformers_read(default_model_path()))


def transformers_read(path: Path) -> Any:
    """The model transformers' own GGUF reader makes of the file at `path`, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


def assert_same_weights(model: Any, reference: Any) -> None:
    """The same weights, bit for bit, by the same names (tied ones tied alike)."""
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name
    tied = reference.config.tie_word_embeddings
    embeddings = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (embeddings[0].data_ptr() == embeddings[1].data_ptr()) == tied


@pytest.mark.smollm2
def test_loader_tokenizer_has_a_chat_template(smollm2: object) -> None:
    tokenizer = smollm2.tokenizer  # type: ignore[attr-defined]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "Hi" in text
    assert text.rstrip().endswith("assistant")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 2]}},
            "rope_parameters.mrope_section is not supported for rope_type 'linear'",
        ),
        (
            {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
            "model_type 'gpt2' is not supported (supported: llama, mistral, qwen2",
        ),
    ],
)
def test_serve_refuses_a_model_it_does_not_implement_by_name(
    tiny_folder: Path, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    """`loom serve` on a folder whose config names what Loom does not run: exit 1 with the
    field in one line, no traceback, never serving."""
    folder = tmp_path / "refused"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    command = [sys.executable, "-m", "loom", "serve", "--model", str(folder), "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"loom: {message}" in result.stderr
    assert "Traceback" not in result.stderr


def write_gguf(path: Path, arch: str, keys: dict[str, Any], tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF file of `arch` with these metadata keys (floats, ints, strings) and tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        add = {float: writer.add_float32, int: writer.add_uint32, str: writer.add_string}
        add[type(value)](key, value)
    for name in (*tensors, "token_embd.weight"):
        writer.add_tensor(name, np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GEMMA2_KEYS = {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}


@pytest.mark.parametrize(
    ("arch", "keys", "tensors", "message"),
    [
        ("llama", {}, ("rope_freqs.weight",), "GGUF tensor rope_freqs.weight"),
        ("phi3", {}, ("rope_factors_long.weight", "rope_factors_short.weight"),
         "GGUF tensor rope_factors_long.weight \\(rope scaling factors: Phi-3's long context\\)"),
        ("gemma2", {**GEMMA2_KEYS, "gemma2.attention.key_length": 128}, (),
         "GGUF gemma2.attention.key_length 128: the file does not say query_pre_attn_scalar"),
        ("gemma3", {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0},
         (), "GGUF gemma3.rope.scaling.type 'linear' is not read by transformers' GGUF reader"),
        ("gemma2", {**GEMMA2_KEYS, "gemma2.final_logit_softcapping": 15.0}, (),
         "GGUF gemma2.final_logit_softcapping 15.0 is not read .* \\(it would take 30.0\\)"),
        ("qwen2", {"qwen2.attention.sliding_window": 4096}, (),
         "GGUF qwen2.attention.sliding_window 4096 is not read"),
        ("mamba", {}, (), "GGUF general.architecture 'mamba' is not supported"),
    ],
)  # fmt: skip
def test_loader_refuses_gguf_metadata_transformers_would_drop(
    tmp_path: Path, arch: str, keys: dict[str, Any], tensors: tuple[str, ...], message: str
) -> None:
    """transformers builds a GGUF model's config from a fixed set of keys: a file that says
    more (Llama 3.1's rope factors, Gemma 3's rope scaling, other soft caps) would load with
    the defaults and give other tokens. Refused by name, before any conversion."""
    path = write_gguf(tmp_path / "model.gguf", arch, keys, tensors)
    with pytest.raises(UnsupportedModelError, match=message):
        converted_gguf_folder(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing converted, nothing cached


def test_loader_checks_pass_gguf_metadata_transformers_reads(tmp_path: Path) -> None:
    """Gemma 2's mapped window and default soft caps, and the default model's file, pass."""
    keys = {
        **GEMMA2_KEYS,
        "gemma2.attention.sliding_window": 4096,
        "gemma2.rope.scaling.type": "none",
    }
    check_gguf(write_gguf(tmp_path / "gemma2.gguf", "gemma2", keys))
    check_gguf(default_model_path())


# Each family's tiny config, within what transformers' GGUF reader maps (the rest takes its
# config class's defaults, which these match: Qwen3's head_dim 128, Qwen2-MoE's expert sizes).
GGUF_FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 128},
    "phi3": {},
    "gemma2": {"head_dim": 256, "sliding_window": 12},  # the only head size a file can say
    "gemma3_text": {"head_dim": 256, "sliding_window": 12, "num_hidden_layers": 6},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
}  # fmt: skip


@pytest.fixture(scope="module")
def gguf_tokenizer() -> list[tuple[str, Any, Any, Any]]:
    """SmolLM2's tokenizer cut to the tiny models' 512 tokens: read in milliseconds."""
    return small_tokenizer_fields(default_model_path(), 512)


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_loader_serves_each_familys_gguf_file_token_for_token(
    family: str, tmp_path: Path, gguf_tokenizer: list[tuple[str, Any, Any, Any]]
) -> None:
    """A GGUF file of each family (written here as llama.cpp names it: the families' real
    files cannot be downloaded), loaded through `--model FILE.gguf` (the model cache, the
    weights read from the file: transformers' bits), then served by Loom's runner: the tokens
    the original model gives."""
    original = tiny_model(family, **GGUF_FAMILIES[family])
    with torch.no_grad():  # norms away from their initial values: Gemma's `1 + w` must be right
        for name, weight in original.model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    path = write_model_gguf(original.model, tmp_path / f"{family}.gguf", gguf_tokenizer)
    loaded = load_model(str(path), dtype=torch.float32, device=CPU, cache_dir=tmp_path / "cache")
    assert loaded.model.config.model_type == family
    assert_same_weights(loaded.model, transformers_read(path))
    requests = [GreedyRequest(request_id="r", prompt=list(range(3, 33)), max_tokens=12)]
    runner = ModelRunner(loaded, CacheConfig(num_blocks=16, block_size=4))
    run_greedy(runner, BlockManager(num_blocks=16, block_size=4), requests, chunk_size=7)
    assert requests[0].output == reference_tokens(original.model, requests[0].prompt, 12)
