"""What one choice of an OpenAI response has produced so far: its text, tokens and
log-probabilities (for a whole response), its finish and usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.core.request_output import Logprobs, RequestOutput

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length"}


Prompt = tuple[tuple[int, ...], tuple[Logprobs, ...]]  # its token ids; logprobs from the 2nd


class Choice:
    """What one choice has produced so far (for a whole response, and its usage)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] = []
        self.prompt: Prompt | None = None  # echo with logprobs
        self.offset = 0  # characters of its tokens' texts streamed so far (text_offset)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.usage: Any = None

    def add(self, batch: Sequence[RequestOutput], keep: bool) -> int:
        """Take a batch in; the log-probabilities it kept (tokens x (top + 1))."""
        kept = 0
        for output in batch:
            self.num_tokens += len(output.token_ids)
            if output.prompt_token_ids:
                self.prompt = (output.prompt_token_ids, output.prompt_logprobs)
                kept += sum(1 + len(lp.top) for lp in output.prompt_logprobs) * keep
            if keep:
                self.text.append(output.text)
                self.token_ids.extend(output.token_ids)
                self.logprobs.extend(output.logprobs)
                kept += sum(1 + len(lp.top) for lp in output.logprobs)
        last = batch[-1]
        if last.finished:
            self.finish_reason = FINISH.get(str(last.finish_reason), str(last.finish_reason))
            self.usage = last.usage
        return kept
