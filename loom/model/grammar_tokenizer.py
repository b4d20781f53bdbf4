"""The model's tokenizer as llguidance reads it, with the added tokens that are text read as
text.

llguidance takes every added token of a tokenizer.json as a special token, a token no text
spells (its bytes `\\xff[id]`). A tokenizer's added tokens that are not special are text the
model writes: Qwen3's `<think>` and `</think>`, tool-call tags. Taken as special, a constraint
whose text spells one (the regex `<think>abc</think>Paris`) can never match the token the
model writes for it, and the request fails ("token [49152] doesn't satisfy the grammar").
So, for a byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM's), those added tokens
are given to llguidance as ordinary vocabulary entries, their text in the byte-level alphabet:
each one's bytes are its text's, masks allow it wherever its text fits, and consuming it
advances the grammar by that text. Every added token goes into the vocabulary at its own id
(so that none is renumbered when the text ones leave the added list); special ones stay added,
and special. Where a text token is spelled as another entry already, or where the result does
not decode each id as before, llguidance's own reading is kept. The tokenizer the model runs
with is not changed.
"""

from __future__ import annotations

import functools
import json
from copy import copy
from typing import Any

import llguidance

from loom.core.constraint import THINKING_OPENS, Constraint, Thinking
from loom.core.errors import InvalidRequestError


def llguidance_tokenizer(tokenizer: Any, n_vocab: int, eos: list[int] | None) -> Any:
    """An llguidance.LLTokenizer for a fast transformers tokenizer (a half-second's work for a
    49k vocabulary: made once)."""
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    eos_token = eos if eos is not None else tokenizer.eos_token_id
    plain = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos_token)
    added_decoder = getattr(tokenizer, "added_tokens_decoder", {})
    if all(token.special for token in added_decoder.values()):
        return plain  # no added token is text (SmolLM2's): llguidance's reading, as it was
    data = json.loads(text)
    if not (byte_level(data) and data.get("model", {}).get("type") == "BPE"):
        return plain
    vocab, added = data["model"]["vocab"], data.get("added_tokens", [])
    moved = {}  # id: text, the added tokens that are text
    for token in added:  # every added token in the vocabulary, at its own id: none renumbered
        key = token["content"] if token.get("special", True) else as_byte_level(token["content"])
        if vocab.get(key, token["id"]) != token["id"]:
            return plain  # spelled as another token already: left as llguidance takes it
        vocab[key] = token["id"]
        if not token.get("special", True):
            moved[token["id"]] = token["content"]
    if not moved:
        return plain
    data["added_tokens"] = [t for t in added if t.get("special", True)]
    made = llguidance.LLTokenizer(json.dumps(data), n_vocab=n_vocab, eos_token=eos_token)
    specials = [t["id"] for t in data["added_tokens"]]
    same = all(made.decode_bytes([i]) == text.encode() for i, text in moved.items()) and all(
        made.is_special_token(i) and made.decode_bytes([i]) == plain.decode_bytes([i])
        for i in specials
    )
    return made if same else plain  # checked: each id still the token it was


def byte_level(data: dict[str, Any]) -> bool:
    """Whether the tokenizer decodes byte-level BPE (its decoder ByteLevel, alone or in a
    sequence)."""
    decoder = data.get("decoder") or {}
    decoders = (
        decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    )
    return any(d.get("type") == "ByteLevel" for d in decoders)


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character its vocabulary spells it with
    (printable bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


def as_byte_level(text: str) -> str:
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in text.encode())


def thinking_tokens(tokenizer: Any, constraint: Constraint | None) -> Thinking | None:
    """For a constraint that waits for the reasoning to end: the ids of the model's `</think>`
    and `<think>`, each one token of the vocabulary where the parser needs it (`</think>`
    always; `<think>` for qwen3, whose model opens its thinking itself), as vLLM's parsers
    need them."""
    reasoning = constraint.reasoning if constraint is not None else None
    if reasoning is None:
        return None
    model_opens = THINKING_OPENS[reasoning]
    start, end = (tokenizer.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    if len(end) != 1 or (model_opens and len(start) != 1):
        needed = "<think> and </think>" if model_opens else "</think>"
        raise InvalidRequestError(
            f"a constraint after the reasoning ({reasoning}) needs {needed} to be single "
            "tokens of the model's vocabulary"
        )
    return Thinking(
        end=end[0], start=start[0] if len(start) == 1 else None, model_opens=model_opens
    )
