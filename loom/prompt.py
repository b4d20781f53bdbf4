"""Prompts (text, chat messages or token ids): tokenising and the checks of admission.

A request that could never be served is refused here, before it can sit in the queue: an empty
prompt, a token id outside the vocabulary, or prompt + max_tokens beyond the context length
(the model's, or what the whole KV pool holds if that is less). A full backlog of queued
prompt tokens refuses it as overload.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import trio

from loom.block_manager import BlockManager
from loom.errors import EngineOverloadedError, InvalidRequestError
from loom.loader import LoadedModel
from loom.model_runner import ModelRunner
from loom.request import Request
from loom.request_stream import RequestStream
from loom.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class ChatMessage:
    role: str
    content: str


Prompt = str | Sequence[int] | Sequence[ChatMessage]


@attrs.frozen(kw_only=True)
class Submission:
    """A request as submitted, on its way to the admission task."""

    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    arrival_time: float
    deadline: float | None
    stream: RequestStream


@attrs.frozen(kw_only=True)
class PromptChecker:
    tokenizer: Any  # None for models loaded without one: token-id prompts only
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_waiting_tokens: int

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        runner: ModelRunner,
        block_manager: BlockManager,
        max_waiting_tokens: int,
    ) -> PromptChecker:
        eos = loaded.model.generation_config.eos_token_id
        if eos is None and loaded.tokenizer is not None:
            eos = loaded.tokenizer.eos_token_id
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        return cls(
            tokenizer=loaded.tokenizer,
            vocab_size=runner.vocab_size,
            # Never more tokens than the whole pool holds.
            max_model_len=min(
                runner.max_model_len, block_manager.num_total_blocks * block_manager.block_size
            ),
            eos_token_ids=eos_ids,
            max_waiting_tokens=max_waiting_tokens,
        )

    def check_size(self, prompt: Prompt, max_prompt_chars: int) -> None:
        """Refuse an oversized prompt at once, before the work of tokenising it."""
        if isinstance(prompt, str):
            num_chars = len(prompt)
        else:
            items = list(prompt)
            num_chars = sum(len(m.content) for m in items if isinstance(m, ChatMessage))
            if len(items) > self.max_model_len:
                raise InvalidRequestError(
                    f"token_ids has {len(items)} tokens; the context length is {self.max_model_len}"
                )
        if num_chars > max_prompt_chars:
            raise InvalidRequestError(
                f"prompt has {num_chars} characters; the limit is "
                f"max_prompt_chars={max_prompt_chars}"
            )

    async def admit(self, submission: Submission, waiting: Iterable[Request]) -> Request:
        token_ids = await self.tokenize(submission.prompt)
        max_tokens = self.check(token_ids, submission.sampling.max_tokens)
        queued = sum(r.num_prompt_tokens for r in waiting)
        if queued + len(token_ids) > self.max_waiting_tokens:
            raise EngineOverloadedError(
                f"the queued prompt tokens would exceed max_waiting_tokens="
                f"{self.max_waiting_tokens} ({queued} queued, this prompt {len(token_ids)})"
            )
        return Request(
            request_id=submission.request_id,
            prompt_token_ids=token_ids,
            sampling=submission.sampling,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            arrival_time=submission.arrival_time,
            deadline=submission.deadline,
        )

    async def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt text must not be empty")
            return await trio.to_thread.run_sync(self.encode_text, prompt)
        items = list(prompt)
        if not items:
            raise InvalidRequestError("prompt must not be empty (text, messages or token_ids)")
        messages = [m for m in items if isinstance(m, ChatMessage)]
        if len(messages) == len(items):
            return await trio.to_thread.run_sync(self.encode_chat, messages)
        if not all(isinstance(t, int) for t in items):
            raise InvalidRequestError("prompt must be text, chat messages or token ids")
        for t in items:
            if not (0 <= t < self.vocab_size):  # type: ignore[operator]
                raise InvalidRequestError(
                    f"token_ids must be in [0, {self.vocab_size}) (the vocabulary size), got {t}"
                )
        return items  # type: ignore[return-value]

    def encode_text(self, text: str) -> list[int]:
        return list(self.need_tokenizer().encode(text))

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        tokenizer = self.need_tokenizer()
        if tokenizer.chat_template is None:
            raise InvalidRequestError("messages need a chat template; this model has none")
        encoded = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=True,
        )
        return list(encoded if isinstance(encoded, list) else encoded["input_ids"])

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; this model has none")
        return self.tokenizer

    def check(self, token_ids: list[int], max_tokens: int | None) -> int:
        """The request's resolved max_tokens, or why it can never be served."""
        num_prompt = len(token_ids)
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty")
        if num_prompt + (max_tokens or 1) > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens or 1}) exceeds the "
                f"context length of {self.max_model_len} tokens"
            )
        return max_tokens or self.max_model_len - num_prompt
