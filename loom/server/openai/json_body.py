"""JSON read from a request body, and written for a whole response, off the I/O thread and in
slices that never hold the GIL long.

`json.loads` is one C call: it holds the GIL for the whole body, so in any thread it stops the
thread that serves both fronts (4 MiB of numbers took 0.64 s on a loaded machine, twelve such
bodies 6.2 s). `read` gives what `json.loads` gives, for the same text, but calls C only on
pieces: a string, a number, a literal, or a run of at most RUN numbers in an array (token ids),
walking the containers in Python between them, and offering the GIL every YIELD_S (1 ms)
between pieces (`Pacer`), so the I/O thread waits at most that plus one piece (a string is
the largest: about 2 ms a MiB, 9 ms for 4 MiB of escapes) while `parse` reads a large body
on a thread of its own.

It also refuses what `json.loads` takes but no request can hold: a lone surrogate (an escape
such as \\ud800: JSON, but no text a tokenizer takes) and nesting past MAX_DEPTH.

The other way, `render` writes what `json.dumps(value, ensure_ascii=False)` writes, a list of
scalars (or of small containers of them) at most RUN items at a time: a whole response's
log-probabilities (up to 131,072 of them, 1.7 MB) took 60 ms of the I/O thread in one call.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from json.decoder import JSONDecodeError
from json.scanner import c_make_scanner  # type: ignore[attr-defined]
from typing import Any, TypeVar

import attrs

T = TypeVar("T")
MAX_DEPTH = 256  # containers within containers (a schema's own limit, 64, names its field first)
RUN = 1024  # numbers an array's run may hold, parsed (or written) by one C call
FLAT = 64  # values a container may hold, in all, to be written in a run
YIELD_S = 0.001  # seconds of reading between two offers of the GIL
BLANK = re.compile(r"[ \t\n\r]*")
# A run of numbers (token ids) up to the array's next delimiter: one C call reads it.
NUMBER = "-?(?:0|[1-9][0-9]*)(?:[.][0-9]+)?(?:[eE][-+]?[0-9]+)?"
NUMBERS = re.compile(rf"{NUMBER}(?:[ \t\n\r]*,[ \t\n\r]*{NUMBER}){{0,{RUN - 1}}}")
SCAN = c_make_scanner(json.JSONDecoder())
# Bodies up to this size are read on the I/O thread itself (a few milliseconds at most: 16,000
# numbers); larger ones on PARSER's one thread, in turn, so that no number of them holds more
# than one thread's share of the GIL, and a small body never waits behind them.
INLINE_BYTES = 64 << 10
PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-json")


class BodyError(ValueError):
    """Not JSON a request can hold: the message says where and why."""


async def parse(body: bytes | bytearray, then: Callable[[Any], T]) -> T:
    """`then(read(body))`, on the parser's thread where the body is large: what a request
    reads from its body (every field checked, a list of a million token ids among them) is
    work its size sets too."""
    if len(body) <= INLINE_BYTES:
        return then(read(body))
    whole = bytes(body)
    return await asyncio.get_running_loop().run_in_executor(PARSER, lambda: then(read(whole)))


def read(body: bytes | bytearray) -> Any:
    """The body's JSON value (as `json.loads` gives it), or BodyError."""
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not UTF-8: {exc}") from None
    reader = Reader(text)
    value = reader.value(BLANK.match(text, 0).end(), 0)  # type: ignore[union-attr]
    end = BLANK.match(text, reader.at).end()  # type: ignore[union-attr]
    if end != len(text):
        raise BodyError(f"extra data after the JSON value at character {end}")
    return value


class Pacer:
    """Called between two pieces of work: every YIELD_S, offers the GIL to another thread (the
    I/O thread, waiting for it, would otherwise wait out the interpreter's switch interval,
    5 ms, each time it takes it back)."""

    def __init__(self) -> None:
        self.since = time.perf_counter()  # the last offer of the GIL

    def __call__(self) -> None:
        if time.perf_counter() - self.since >= YIELD_S:
            time.sleep(0)  # releases the GIL; a waiting thread takes it (~70 us)
            self.since = time.perf_counter()


class Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0  # where the last value read ends
        self.piece = Pacer()

    def value(self, at: int, depth: int) -> Any:
        """The value at `at` (after any blanks), with `self.at` past its end."""
        char = self.text[at : at + 1]
        if char == "{":
            return self.object(at + 1, depth + 1)
        if char == "[":
            return self.array(at + 1, depth + 1)
        try:
            value, self.at = SCAN(self.text, at)
        except StopIteration:
            raise BodyError(f"expected a value at character {at}") from None
        except (JSONDecodeError, ValueError) as exc:  # a string's bad escape; a huge integer
            raise BodyError(str(exc)) from None
        if isinstance(value, str):
            check_text(value, at)
        return value

    def array(self, at: int, depth: int) -> list[Any]:
        deeper(depth, at)
        items: list[Any] = []
        at = self.blank(at)
        if self.text.startswith("]", at):
            self.at = at + 1
            return items
        while True:
            self.piece()
            numbers = self.numbers(at)
            if numbers:
                try:
                    items.extend(json.loads(f"[{numbers}]"))
                except ValueError as exc:  # an integer past int()'s digit limit
                    raise BodyError(str(exc)) from None
                self.at = at + len(numbers)
            else:
                items.append(self.value(at, depth))
            at = self.blank(self.at)
            if self.text.startswith("]", at):
                self.at = at + 1
                return items
            at = self.blank(self.expect(",", at))

    def numbers(self, at: int) -> str:
        """The run of numbers of an array at `at`, up to a comma or the array's end (the
        text one C call reads), or "". A run whose last number is followed by anything else
        ends before it: each number is matched once."""
        run = NUMBERS.match(self.text, at)
        if run is None:
            return ""
        numbers = run.group()
        after = self.blank(run.end())
        if self.text[after : after + 1] not in (",", "]"):
            numbers = numbers[: max(numbers.rfind(","), 0)]
        return numbers

    def object(self, at: int, depth: int) -> dict[str, Any]:
        deeper(depth, at)
        items: dict[str, Any] = {}
        at = self.blank(at)
        if self.text.startswith("}", at):
            self.at = at + 1
            return items
        while True:
            if not self.text.startswith('"', at):
                raise BodyError(f"expected a property name in double quotes at character {at}")
            self.piece()
            key = self.value(at, depth)
            at = self.blank(self.expect(":", self.blank(self.at)))
            items[key] = self.value(at, depth)
            at = self.blank(self.at)
            if self.text.startswith("}", at):
                self.at = at + 1
                return items
            at = self.blank(self.expect(",", at))

    def blank(self, at: int) -> int:
        return BLANK.match(self.text, at).end()  # type: ignore[union-attr]

    def expect(self, char: str, at: int) -> int:
        if not self.text.startswith(char, at):
            raise BodyError(f"expected {char!r} at character {at}")
        return at + 1


@attrs.frozen
class Whole:
    """A whole response's JSON value, for the sink to render (`rendered`) as it sends it."""

    value: Any


async def rendered(value: Any) -> bytes:
    """`render(value)`, on the parser's thread."""
    return await asyncio.get_running_loop().run_in_executor(PARSER, render, value)


def render(value: Any) -> bytes:
    """What `json.dumps(value, ensure_ascii=False).encode()` gives, in slices."""
    parts: list[str] = []
    Writer(parts).write(value)
    return "".join(parts).encode()


class Writer:
    def __init__(self, parts: list[str]) -> None:
        self.parts = parts
        self.piece = Pacer()

    def write(self, value: Any) -> None:
        self.piece()
        if isinstance(value, dict):
            self.parts.append("{")
            for i, (key, item) in enumerate(value.items()):
                self.parts.append((", " if i else "") + dumps(str(key)) + ": ")
                self.write(item)
            self.parts.append("}")
        elif isinstance(value, (list, tuple)):
            self.parts.append("[")
            for start in range(0, len(value), RUN):  # a run of scalars at a time, or one item
                run = list(value[start : start + RUN])
                if all(map(is_flat, run)):
                    self.parts.append((", " if start else "") + dumps(run)[1:-1])
                    continue
                for i, item in enumerate(run):
                    self.parts.append(", " if start + i else "")
                    self.write(item)
            self.parts.append("]")
        else:
            self.parts.append(dumps(value))


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float))


def is_flat(value: Any) -> bool:
    """A scalar, or a container of at most FLAT values in all (a token's log-probabilities
    and their alternatives): RUN of them are one short C call."""
    return room(value, FLAT) >= 0


def room(value: Any, budget: int) -> int:
    """`budget` less the values `value` holds, itself included; below 0 once it runs out."""
    budget -= 1
    if budget < 0 or is_scalar(value):
        return budget
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return -1
    for item in value:
        budget = room(item, budget)
        if budget < 0:
            break
    return budget


def deeper(depth: int, at: int) -> None:
    if depth > MAX_DEPTH:
        raise BodyError(f"the body nests deeper than {MAX_DEPTH} levels (at character {at})")


def check_text(value: str, at: int) -> None:
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BodyError(
            f"the string at character {at} holds a lone surrogate: not valid Unicode text"
        ) from None
