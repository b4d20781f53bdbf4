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
from pathlib import Path
from typing import Any, cast

import attrs

from loom.core.errors import InvalidRequestError
from loom.core.pooling import Pooling, PoolingKind
from loom.core.sampling_params import SamplingParams
from loom.model.family import UnsupportedModelError

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
                "embeddings are not served: this model generates (start the server with "
                "--task embed to serve it as an embedding model)"
            )
        return sampling
    if sampling.pooling is None:
        raise InvalidRequestError(
            "this server serves embeddings only (--task embed): use /v1/embeddings"
        )
    return attrs.evolve(sampling, pooling=model.served(sampling.pooling))


def embedding_model(
    folder: Path | None, config: Any, task: str, pooling: str | None, matryoshka: bool
) -> EmbeddingModel | None:
    """The model's embedding settings, if it serves embeddings; None if it generates."""
    found = read_sentence_transformers(folder) if folder is not None else None
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


def read_sentence_transformers(folder: Path) -> tuple[PoolingKind, bool] | None:
    """A sentence-transformers folder's pooling and whether it normalises; None for another
    kind of folder. A pooling mode Loom does not compute is refused by name."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"modules.json: {exc}") from None
    if not isinstance(modules, list):
        raise UnsupportedModelError("modules.json: not a list of modules")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in types:
        return None
    path = folder / str(types["Pooling"].get("path", "")) / "config.json"
    try:
        modes = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"the Pooling module's config: {exc}") from None
    chosen = [mode for mode, on in modes.items() if mode.startswith("pooling_mode") and on]
    if len(chosen) != 1 or chosen[0] not in MODES:
        raise UnsupportedModelError(
            f"pooling {', '.join(chosen) or 'none'}: Loom pools by one of {', '.join(MODES)}"
        )
    return MODES[chosen[0]], "Normalize" in types
