"""Each token's own text and bytes, as OpenAI's logprobs name them."""

from __future__ import annotations

import re
from typing import Any


class TokenTexts:
    """A token's own text and bytes, for logprobs (cached: the same tokens come again and
    again). Without a tokenizer, or with `as_ids`, the text is `token_id:N`. The bytes are
    the token's own, even when it holds part of a character (its text then shows U+FFFD):
    byte-level BPE spells bytes as characters (GPT-2's table), SentencePiece as <0xNN>."""

    def __init__(self, tokenizer: Any, *, as_ids: bool = False) -> None:
        self.tokenizer = None if as_ids else tokenizer
        self.texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        found = self.texts.get(token_id)
        if found is None:
            found = f"token_id:{token_id}"
            if self.tokenizer is not None:
                found = self.tokenizer.decode([token_id])
            if len(self.texts) < MAX_CACHED_TOKENS:
                self.texts[token_id] = found
        return found

    def bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return self.text(token_id).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in BYTE_OF for c in piece):
            return bytes(BYTE_OF[c] for c in piece)
        if isinstance(piece, str) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return self.text(token_id).encode()


def byte_of_character() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: the byte each of its 256 characters stands for
    (printable bytes stand for themselves; the others for 256 + their rank among them)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table |= {chr(256 + rank): b for rank, b in enumerate(others)}
    return table


BYTE_OF = byte_of_character()
MAX_CACHED_TOKENS = 1 << 16
