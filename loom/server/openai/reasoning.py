"""A reasoning model's thinking split from its answer (`--reasoning-parser`), as vLLM's parsers
of the same names split it, for chat's `reasoning_content` (streamed and whole):

- `qwen3`: what a choice writes between a leading `<think>` and `</think>` is reasoning, the
  rest its answer; a choice that does not begin with `<think>` (Qwen3 with thinking off)
  answers from its first token.
- `deepseek_r1`: everything before `</think>` is reasoning (DeepSeek-R1's chat template opens
  the thinking, so the model writes only its end; a leading `<think>` is dropped as well); a
  choice that never writes `</think>` is all reasoning.

The markers are matched on the text, so a marker cut across two steps' text is held until it
is whole. The tokens of the steps written while thinking are counted as reasoning tokens
(usage's `completion_tokens_details.reasoning_tokens`), the one that closes it included.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class Reasoning:
    """One choice's split, fed its text as it comes: `feed` says what each piece adds to the
    reasoning and to the answer; `reasoning` and `content` hold all of each so far."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}")
        self.opened = parser == "deepseek_r1"  # thinking from the first token
        self.state = "start"  # start (not yet known), thinking, answering
        self.held = ""  # text that may be the beginning of a marker
        self.reasoning = ""
        self.content = ""
        self.tokens = 0  # reasoning tokens
        self.held_tokens = 0  # the tokens of held text not yet known to be thinking

    def feed(self, text: str, num_tokens: int, last: bool = False) -> tuple[str, str]:
        """What `text` (of `num_tokens` tokens) adds to the reasoning and to the answer;
        `last`: the choice's end, nothing held back."""
        text, self.held = self.held + text, ""
        if self.state == "start":
            if START.startswith(text) and text != START and not last:
                self.held = text  # perhaps the start of `<think>`: decide when it is whole
                self.held_tokens += num_tokens
                return "", ""
            if text.startswith(START):
                self.state, text = "thinking", text[len(START) :]
            else:
                self.state = "thinking" if self.opened else "answering"
            if self.state == "thinking":
                self.tokens += self.held_tokens
        thought = said = ""
        if self.state == "thinking":
            self.tokens += num_tokens
            end = text.find(END)
            if end < 0:
                keep = 0 if last else partial_end(text)
                thought, self.held = text[: len(text) - keep], text[len(text) - keep :]
            else:
                thought, said, self.state = text[:end], text[end + len(END) :], "answering"
        else:
            said = text
        self.reasoning += thought
        self.content += said
        return thought, said


def partial_end(text: str) -> int:
    """How many characters at the end of `text` could begin `</think>`."""
    for size in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-size:]):
            return size
    return 0
