"""Incremental detokenisation through SmolLM2's byte-level tokenizer: UTF-8 and stop strings."""

from __future__ import annotations

from typing import Any

import pytest

from loom.core.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! Plain ASCII.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🦀🐍 👩‍👩‍👧 ✨ and flags 🇫🇷🇯🇵.",
    "Mixed: naïve café — ½ € ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 한국어 ☃",
]


def stream(
    tokenizer: Any, prompt: list[int], output: list[int], stop: tuple[str, ...] = ()
) -> tuple[list[str], bool]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop)
    pieces = []
    for token in output:
        text, stopped = detokenizer.add(token)
        pieces.append(text)
        if stopped:
            return pieces, True
    pieces.append(detokenizer.flush())
    return pieces, False


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streamed_text_joins_to_the_full_decode(
    smollm2_tokenizer: Any, text: str
) -> None:
    prompt = smollm2_tokenizer.encode("Say something:")
    output = smollm2_tokenizer.encode(text)
    pieces, _ = stream(smollm2_tokenizer, prompt, output)
    assert "".join(pieces) == smollm2_tokenizer.decode(output) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_detokenizer_holds_back_split_characters(smollm2_tokenizer: Any) -> None:
    output = smollm2_tokenizer.encode("🦀")
    assert len(output) > 1  # one character, several byte-level tokens
    pieces, _ = stream(smollm2_tokenizer, [], output)
    assert "".join(pieces) == "🦀"
    assert [p for p in pieces if p] == ["🦀"]


def test_detokenizer_stop_string_spanning_tokens_truncates_before_it(
    smollm2_tokenizer: Any,
) -> None:
    output = smollm2_tokenizer.encode("The capital of France is Paris. It is big.")
    pieces, stopped = stream(smollm2_tokenizer, [], output, stop=("of Fra", "big"))
    assert stopped
    assert "".join(pieces) == "The capital "


def test_detokenizer_stop_string_never_leaks_a_partial_match(smollm2_tokenizer: Any) -> None:
    output = smollm2_tokenizer.encode("one two three four")
    pieces, stopped = stream(smollm2_tokenizer, [], output, stop=("three",))
    assert stopped
    assert "".join(pieces) == "one two "
    pieces, stopped = stream(smollm2_tokenizer, [], output, stop=("threx",))
    assert not stopped
    assert "".join(pieces) == "one two three four"
