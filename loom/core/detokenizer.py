"""Incremental, UTF-8-safe detokenisation with stop strings matched across token boundaries.

A byte-level tokenizer can split one character over several tokens; decoding such a prefix ends
in U+FFFD. The window method (as in vLLM and TGI): decode `ids[prefix:read]` and `ids[prefix:]`;
the new text is what the second adds to the first, held back while it ends in U+FFFD. Starting
the window a few tokens before the output keeps leading spaces right.

Stop strings: text is emitted only once no stop string can still begin in it, so the last
`max(len(stop)) - 1` characters are held back; a match truncates the text before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: tuple[str, ...]
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded, not yet emitted: may be the start of a stop string

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Text to emit now, and the stop string that ended the output (None: none did)."""
        self.ids.append(token_id)
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(INCOMPLETE):
            return "", None
        self.pending += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.release()

    def flush(self) -> str:
        """All text held back, at the end of the output (an incomplete character included)."""
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        self.pending += self.decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        text, self.pending = self.pending[: min(found, default=len(self.pending))], ""
        return text

    def release(self) -> tuple[str, str | None]:
        found = [(i, stop) for stop in self.stop if (i := self.pending.find(stop)) >= 0]
        if found:
            at, stop = min(found)  # the earliest; of two there, the shorter
            text, self.pending = self.pending[:at], ""
            return text, stop
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return "", None
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, None

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
