"""A GGUF file's header, read in milliseconds: its metadata (but the tokenizer's) and its tensors.

gguf's own reader decodes every value of the metadata into numpy views, the tokenizer's tens of
thousands of tokens and merges among them: 2.3 s for SmolLM2's file, each time it is opened.
Loom reads the header itself (GGUF's spec, versions 2 and 3, little-endian): the `tokenizer.*`
values are stepped over, not decoded (transformers reads those once, when it converts the
tokenizer), every other value is decoded, and each tensor's name, shape, type and place in the
file are listed. A file that ends early or says what the spec does not is refused with a
ValueError saying where.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

MAGIC = b"GGUF"
ALIGNMENT = 32  # general.alignment's default
# Metadata value types (GGUF's spec) of a fixed size: struct's format for each.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}  # fmt: skip
STRING, ARRAY = 8, 9
SKIPPED = "tokenizer."  # keys whose values are stepped over


@attrs.frozen(kw_only=True)
class TensorInfo:
    """One tensor of the file: `shape` in numpy's order (GGUF lists the fastest axis first),
    `ggml_type` (gguf's GGMLQuantizationType value), `offset` in bytes from the file's start."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@attrs.frozen(kw_only=True)
class Header:
    """`fields`: every metadata key's value (arrays as lists) but the tokenizer's."""

    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))


class Cursor:
    """Little-endian reads from a buffer, moving forward."""

    def __init__(self, buffer: Any) -> None:
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        if self.at + length > len(self.buffer):
            raise ValueError(f"a string of {length} bytes at byte {self.at} runs past the end")
        self.at += length
        return bytes(self.buffer[self.at - length : self.at]).decode("utf-8", "replace")

    def value(self, value_type: int, keep: bool) -> Any:
        """The value of `value_type` here, or None having stepped over it, where not `keep`."""
        if value_type in SCALARS:
            if not keep:
                self.at += struct.calcsize(SCALARS[value_type])
                return None
            return self.unpack(SCALARS[value_type])
        if value_type == STRING:
            if keep:
                return self.string()
            length = self.unpack("Q")
            self.at += length
            return None
        if value_type != ARRAY:
            raise ValueError(f"metadata value type {value_type} at byte {self.at} is not GGUF's")
        item_type, count = self.unpack("I"), self.unpack("Q")
        if not keep and item_type in SCALARS:
            self.at += struct.calcsize(SCALARS[item_type]) * count
            return None
        items = [self.value(item_type, keep) for _ in range(count)]
        return items if keep else None


def read_header(buffer: Any) -> Header:
    """The header of the GGUF file held in `buffer` (bytes, or a numpy memmap of the file)."""
    try:
        return parse(Cursor(buffer))
    except struct.error as error:
        raise ValueError(f"the GGUF header ends early: {error}") from None


def parse(cursor: Cursor) -> Header:
    if bytes(cursor.buffer[:4]) != MAGIC or cursor.unpack("4xI") not in (2, 3):
        raise ValueError("not a GGUF file of version 2 or 3 (little-endian)")
    num_tensors, num_fields = cursor.unpack("Q"), cursor.unpack("Q")
    fields = {}
    for _ in range(num_fields):
        key, value_type = cursor.string(), cursor.unpack("I")
        value = cursor.value(value_type, keep=not key.startswith(SKIPPED))
        if value is not None:
            fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name, num_dims = cursor.string(), cursor.unpack("I")
        dims = [cursor.unpack("Q") for _ in range(num_dims)]
        infos.append((name, tuple(reversed(dims)), cursor.unpack("I"), cursor.unpack("Q")))
    alignment = int(fields.get("general.alignment", ALIGNMENT))
    start = -(-cursor.at // alignment) * alignment  # the data begins at the next multiple
    tensors = tuple(
        TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=start + offset)
        for name, shape, ggml_type, offset in infos
    )
    return Header(fields=fields, tensors=tensors)


def mapped(path: Path) -> np.ndarray:
    """The file, mapped read-only (unmapped when the last view of it goes)."""
    return np.memmap(path, np.uint8, mode="r")


def read_file_header(path: Path) -> Header:
    return read_header(mapped(path))
