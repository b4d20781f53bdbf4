"""Whether a model serves embeddings, and how it pools (`--task`, `--pooling`).

A sentence-transformers folder (Qwen3-Embedding's, say) is an embedding model: its
`modules.json` names a Pooling module, whose `config.json` says how it pools
(`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`), and a Normalize module, if there is
one, that its vectors have length 1. With `--task auto` such a folder serves embeddings and
nothing else; any other model generates. `--task embed` makes any model an embedding model
(pooling its last token unless `--pooling` says otherwise, normalised), as vLLM's `--task`
(`--runner pooling`) does; `--task generate` keeps a sentence-transformers folder generating.
A request may ask for fewer `dimensions` only of a Matryoshka model: its config says so
(`matryoshka_dimensions`, `is_matryoshka`, as vLLM reads it) or `--matryoshka` does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import attrs

from loom.core.errors import InvalidRequestError
from loom.core.pooling import Pooling, PoolingKind
from loom.core.sampling_params import SamplingParams
from loom.model.family import UnsupportedModelError

log = logging.getLogger(__name__)
TASKS = ("auto", "generate", "embed")
MODES: dict[str, PoolingKind] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
}


@attrs.frozen(kw_only=True)
class EmbeddingModel:
    """How an embedding model pools, and which lengths its vectors may be cut to."""

    kind: PoolingKind
    normalize: bool  # a request's default
    hidden_size: int
    matryoshka: bool | tuple[int, ...] = False  # True: any length; a tuple: those

    def served(self, pooling: Pooling) -> Pooling:
        """A request's pooling, the model's way (its kind, its normalisation unless asked),
        or refused: dimensions it cannot give."""
        if pooling.dimensions is not None and (why := self.check_dimensions(pooling.dimensions)):
            raise InvalidRequestError(why)
        normalize = self.normalize if pooling.normalize is None else pooling.normalize
        return attrs.evolve(pooling, kind=self.kind, normalize=normalize)

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why a request may not ask for vectors of `dimensions`, if it may not."""
        if not (1 <= dimensions <= self.hidden_size):
            return f"dimensions must be in [1, {self.hidden_size}], got {dimensions}"
        if dimensions == self.hidden_size:
            return None
        if self.matryoshka is False:
            return (
                "dimensions: this model's vectors cannot be shortened (not a Matryoshka "
                "model; start the server with --matryoshka if it is one)"
            )
        if self.matryoshka is not True and dimensions not in self.matryoshka:
            allowed = ", ".join(map(str, self.matryoshka))
            return f"dimensions must be one of {allowed}, got {dimensions}"
        return None


def served_as(model: EmbeddingModel | None, sampling: SamplingParams) -> SamplingParams:
    """A request as the server's task serves it: an embedding only by an embedding model,
    generation only by a generating one."""
    if model is None:
        if sampling.pooling is not None:
            raise InvalidRequestError(
                "model: this model generates, and serves no embeddings (start the server "
                "with --task embed to serve it as an embedding model)"
            )
        return sampling
    if sampling.pooling is None:
        raise InvalidRequestError(
            "model: this server serves embeddings only (--task embed): use /v1/embeddings"
        )
    return attrs.evolve(sampling, pooling=model.served(sampling.pooling))


def embedding_model(
    location: Path | str | None, config: Any, task: str, pooling: str | None, matryoshka: bool
) -> EmbeddingModel | None:
    """The model's embedding settings, if it serves embeddings; None if it generates.
    `location`: its folder, or its hub id."""
    found = read_sentence_transformers(location) if location is not None else None
    if task == "generate" or (task == "auto" and found is None):
        return None
    kind, normalize = found or ("last", True)
    if pooling is not None:
        kind = cast(PoolingKind, pooling)  # one of POOLING_KINDS: the flag's choices
    dims = getattr(config, "matryoshka_dimensions", None)
    shorter: bool | tuple[int, ...] = (
        tuple(dims) if dims else bool(getattr(config, "is_matryoshka", False))
    )
    return EmbeddingModel(
        kind=kind,
        normalize=normalize,
        hidden_size=config.hidden_size,
        matryoshka=True if matryoshka else shorter,
    )


def read_sentence_transformers(location: Path | str) -> tuple[PoolingKind, bool] | None:
    """A sentence-transformers model's pooling and whether it normalises; None for a model
    that is not one. What Loom does not compute is refused by name: a pooling mode other than
    the last token's or the mean, a pooling without the prompt's tokens, a module after the
    pooling other than Normalize (Dense, LayerNorm: the vectors would not be the model's)."""
    text = model_file(location, "modules.json")
    if text is None:
        return None
    modules = json_of(text, "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModelError("modules.json: not a list of modules")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in types:
        return None
    if unknown := sorted(set(types) - {"Transformer", "Pooling", "Normalize"}):
        raise UnsupportedModelError(
            f"modules.json: Loom computes Transformer, Pooling and Normalize modules, not "
            f"{', '.join(unknown)}"
        )
    name = str(Path(str(types["Pooling"].get("path", ""))) / "config.json")
    modes = json_of(model_file(location, name) or "{}", name)
    chosen = [mode for mode, on in modes.items() if mode.startswith("pooling_mode") and on]
    if len(chosen) != 1 or chosen[0] not in MODES:
        raise UnsupportedModelError(
            f"pooling {', '.join(chosen) or 'none'}: Loom pools by one of {', '.join(MODES)}"
        )
    if modes.get("include_prompt", True) is not True:
        raise UnsupportedModelError("pooling without the prompt's tokens is not supported")
    return MODES[chosen[0]], "Normalize" in types


def json_of(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None


def model_file(location: Path | str, name: str) -> str | None:
    """A file of a model folder, or of a hub model (as transformers fetches its own); None
    where it has none."""
    folder = Path(location)
    if folder.is_dir():
        path = folder / name
        return path.read_text() if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(str(location), name)).read_text()
    except EntryNotFoundError:
        return None
    except Exception as exc:  # offline, and not in the cache: it is not known
        log.warning(
            "%s of %s could not be read (%s): taken as a generating model", name, location, exc
        )
        return None
