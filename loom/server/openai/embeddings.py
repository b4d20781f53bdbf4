"""POST /v1/embeddings: OpenAI's embeddings, each input an engine request that pools its
prompt (loom/core/pooling.py), all of a call's inputs relayed together as a request's choices
are (loom/server/relay.py): one refused, every one ends; the client gone, every one aborts.

Taken: input (a string, strings, token ids, lists of token ids; at most
--max-embedding-inputs of them, counted before any is read), model, encoding_format (float,
or base64: the float32 vector's little-endian bytes, the `openai` client's default),
dimensions (a Matryoshka model's shorter vectors), user; vLLM's `normalize` (false: the raw
pooled vector) and `cache_salt`. The answer is OpenAI's list of `{"object": "embedding",
"index", "embedding"}` with usage (prompt tokens, which are all the tokens). A vector that is
not finite (a half-precision model's overflow) is a 500, never JSON's invalid NaN.
"""

from __future__ import annotations

import base64
import math
import struct
import time
from collections.abc import Sequence
from typing import Any

import attrs

from loom.core.pooling import Pooling
from loom.core.prompt import Prompt
from loom.core.request_output import RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy
from loom.server.openai.errors import HttpError, finish_error, invalid
from loom.server.openai.fields import int_list, json_object, optional
from loom.server.openai.json_body import Whole
from loom.server.openai.requests import MAX_USER_CHARS
from loom.server.relay import EngineRequest

FORMATS = ("float", "base64")


@attrs.frozen(kw_only=True)
class EmbeddingsAsk:
    """What one embeddings request asks of the engine: a vector for each input."""

    model: str | None
    prompts: tuple[Prompt, ...]
    pooling: Pooling
    encoding_format: str = "float"
    cache_salt: str = ""
    # What a generation's Ask has, as the route reads it: nothing streams, echoes or calls.
    stream: bool = False
    echo: bool = False
    tools: None = None
    tokens_as_ids: bool = False

    def submissions(self, tenancy: Tenancy) -> list[EngineRequest]:
        sampling, salt = SamplingParams(pooling=self.pooling), self.cache_salt
        return [
            EngineRequest(prompt=p, sampling=sampling, cache_salt=salt, tenancy=tenancy)
            for p in self.prompts
        ]


def embeddings_ask(body: Any, max_inputs: int, max_ids: int, vocab_size: int) -> EmbeddingsAsk:
    """`max_inputs`: --max-embedding-inputs; `max_ids`: the most token ids an input may hold
    (the context); `vocab_size`: what each id must be below."""
    body = json_object(body)
    encoding = optional(body, "encoding_format", str) or "float"
    if encoding not in FORMATS:
        raise invalid(
            f"encoding_format must be one of {', '.join(FORMATS)}, got {encoding!r}",
            "encoding_format",
        )
    user = optional(body, "user", str) or ""
    if len(user) > MAX_USER_CHARS:
        raise invalid(f"user has {len(user)} characters; the limit is {MAX_USER_CHARS}", "user")
    pooling = Pooling(
        dimensions=optional(body, "dimensions", int), normalize=optional(body, "normalize", bool)
    )
    return EmbeddingsAsk(
        model=optional(body, "model", str),
        prompts=embedding_inputs(body.get("input"), max_inputs, max_ids, vocab_size),
        pooling=pooling,
        encoding_format=encoding,
        cache_salt=optional(body, "cache_salt", str) or "",
    )


def embedding_inputs(
    value: Any, max_inputs: int, max_ids: int, vocab_size: int
) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of such lists; no input
    empty (OpenAI's rule), at most `max_inputs` of them."""
    if isinstance(value, list) and len(value) > max_inputs and not isinstance(value[0], int):
        raise invalid(
            f"input has {len(value)} items; the limit is {max_inputs} "
            "(--max-embedding-inputs, at most --max-waiting-requests)",
            "input",
        )
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, list) and value:
        if isinstance(value[0], int):
            return (token_ids(value, max_ids, vocab_size),)
        if all(isinstance(v, str) and v for v in value):
            return tuple(value)
        if all(isinstance(v, list) and v for v in value):
            return tuple(token_ids(v, max_ids, vocab_size) for v in value)
    raise invalid(
        "input must be a non-empty string, a list of non-empty strings, a list of token ids "
        "or a list of non-empty lists of token ids",
        "input",
    )


def token_ids(value: list[Any], max_ids: int, vocab_size: int) -> list[int]:
    ids = int_list(value, "input", max_ids)
    if not all(0 <= t < vocab_size for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise invalid(f"input: token id {bad} is not in the vocabulary [0, {vocab_size})", "input")
    return ids


class EmbeddingsFraming:
    """The relay's framing of an embeddings request: nothing until every input has its
    vector, then OpenAI's whole list."""

    def __init__(self, ask: EmbeddingsAsk, *, request_id: str, model: str) -> None:
        self.ask = ask
        self.id = f"embd-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.vectors: list[tuple[float, ...]] = [() for _ in ask.prompts]
        self.num_tokens = 0

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> None:
        return None  # an embedding has no tokens to say

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> Whole | None:
        last = batch[-1]
        self.vectors[index] = last.embedding or ()
        self.num_tokens += last.usage.prompt_tokens if last.usage is not None else 0
        return Whole(self.whole()) if done else None

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        return None, finish_error(batch[-1])

    def whole(self) -> dict[str, Any]:
        if not all(math.isfinite(v) for vector in self.vectors for v in vector):
            raise HttpError(500, "the model's hidden states overflowed: an embedding not finite")
        data = [
            {"object": "embedding", "index": i, "embedding": self.encoded(vector)}
            for i, vector in enumerate(self.vectors)
        ]
        usage = {"prompt_tokens": self.num_tokens, "total_tokens": self.num_tokens}
        return {
            "id": self.id,
            "object": "list",
            "created": self.created,
            "model": self.model,
            "data": data,
            "usage": usage,
        }

    def encoded(self, vector: tuple[float, ...]) -> list[float] | str:
        if self.ask.encoding_format == "float":
            return list(vector)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
