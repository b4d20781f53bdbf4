"""Prompts (text, chat messages or token ids): tokenising, and the checks that refuse at once
what could never be served.

Refused: an empty prompt, a token id outside the vocabulary (given, or made by a tokenizer with
more tokens than the model has embeddings), prompt + max_tokens beyond the context length (the
model's, or what the whole KV pool holds if that is less), a chat the template refuses, and a
prompt too large to be worth tokenising: more characters than `max_prompt_chars` (roles and
contents of every message counted), more messages or token ids than the context length.
`tokenize` can take a while on a long text or chat (`needs_tokenizer`): callers run those off
their event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from loom.core.errors import InvalidRequestError
from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import SHARED, Tenancy

MAX_CACHE_SALT_CHARS = 256


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str
    content: str


Prompt = str | Sequence[int] | Sequence[ChatMessage]


def needs_tokenizer(prompt: Prompt) -> bool:
    """Text and chat go through the tokenizer, which takes a while on a long prompt; token ids
    are only checked against the vocabulary."""
    return isinstance(prompt, str) or any(isinstance(item, ChatMessage) for item in prompt)


@attrs.frozen(kw_only=True)
class PromptChecker:
    """What requests are checked and built against: the model's tokenizer and limits."""

    tokenizer: Any  # None for models loaded without one: token-id prompts only
    vocab_size: int
    max_model_len: int  # the model's context length, or what the whole KV pool holds if less
    eos_token_ids: tuple[int, ...]
    max_prompt_chars: int

    def check_size(self, prompt: Prompt) -> None:
        """Refuse an oversized prompt at once, before the work of tokenising it."""
        if isinstance(prompt, str):
            num_chars = len(prompt)
        else:  # the count first: a 4 MiB message holds millions of token ids
            if len(prompt) > self.max_model_len:
                field = "messages" if needs_tokenizer(prompt[:1]) else "token_ids"
                raise InvalidRequestError(
                    f"{field} has {len(prompt)} items; the context length is {self.max_model_len}"
                )
            messages = [m for m in prompt if isinstance(m, ChatMessage)]
            num_chars = sum(len(m.role) + len(m.content) for m in messages)
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"prompt has {num_chars} characters; the limit is "
                f"max_prompt_chars={self.max_prompt_chars}"
            )

    @staticmethod
    def check_cache_salt(cache_salt: str) -> None:
        if len(cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(
                f"cache_salt has {len(cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}"
            )
        try:
            cache_salt.encode()
        except UnicodeEncodeError:  # a lone surrogate: only from Python callers
            raise InvalidRequestError("cache_salt is not valid Unicode text") from None

    def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids, each checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt text must not be empty")
            return self.check_made(self.need_tokenizer().encode(prompt))
        items = list(prompt)
        if not items:
            raise InvalidRequestError("prompt must not be empty (text, messages or token_ids)")
        messages = [m for m in items if isinstance(m, ChatMessage)]
        if len(messages) == len(items):
            return self.check_made(self.encode_chat(messages))
        if not all(isinstance(t, int) for t in items):
            raise InvalidRequestError("prompt must be text, chat messages or token ids")
        self.check_token_ids("token_ids", items)  # type: ignore[arg-type]
        return tuple(items)  # type: ignore[arg-type]

    def check_token_ids(self, field: str, token_ids: Sequence[int]) -> None:
        """Refuse a token id of the request's `field` outside the vocabulary."""
        for t in token_ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequestError(
                    f"{field} must be in [0, {self.vocab_size}) (the vocabulary size), got {t}"
                )

    def encode_chat(self, messages: list[ChatMessage]) -> tuple[int, ...]:
        tokenizer = self.need_tokenizer()
        if tokenizer.chat_template is None:
            raise InvalidRequestError("messages need a chat template; this model has none")
        try:
            encoded = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                tokenize=True,
            )
        except Exception as exc:  # the template's own check (roles, order) of the client's chat
            raise InvalidRequestError(f"messages: the chat template refused them: {exc}") from exc
        return tuple(encoded if isinstance(encoded, list) else encoded["input_ids"])

    def check_made(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Token ids a tokenizer made: one with added tokens can exceed the embedding."""
        beyond = [t for t in token_ids if not (0 <= t < self.vocab_size)]
        if beyond:
            raise InvalidRequestError(
                f"the tokenizer made token id {beyond[0]}, beyond this model's vocabulary of "
                f"{self.vocab_size}: the prompt holds a token the model has no embedding for"
            )
        return tuple(token_ids)

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; this model has none")
        return self.tokenizer

    def request(
        self,
        request_id: str,
        token_ids: tuple[int, ...],
        sampling: SamplingParams,
        *,
        arrival_time: float,
        deadline: float | None,
        cache_salt: str = "",
        tenancy: Tenancy = SHARED,
    ) -> Request:
        """A checked request for a tokenised prompt."""
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            max_tokens=self.check(token_ids, sampling.max_tokens, sampling.pooling is None),
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
            deadline=deadline,
            cache_salt=cache_salt,
            tenancy=tenancy,
        )

    def check(
        self, token_ids: Sequence[int], max_tokens: int | None, generates: bool = True
    ) -> int:
        """The request's resolved max_tokens, or why it can never be served (an embedding,
        which `generates` nothing, may fill the context)."""
        num_prompt = len(token_ids)
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty")
        room = (max_tokens or 1) if generates else 0
        if num_prompt + room > self.max_model_len:
            asked = f" + max_tokens ({room})" if generates else ""
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens){asked} exceeds the context length of "
                f"{self.max_model_len} tokens"
            )
        return max_tokens or self.max_model_len - num_prompt
