"""The tokenizer as GetTokenizer hands it to a gateway (SMG builds its own from it, so that it
needs nothing but the worker's address): the files the served tokenizer was read from
(tokenizer.json, tokenizer_config.json, its chat template, ...), zipped flat, in chunks, the
SHA-256 of the whole zip on the last chunk.

Read from the files, never saved from the live tokenizer (which admission uses, one thread at a
time) and never through a temporary folder (the image's root is read-only). Made once, on the
first call, in a worker thread (zipping SmolLM2's takes about 0.2 s): never in the I/O thread,
which no call may hold; a failure is kept too, and said again.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path

import attrs

CHUNK_BYTES = 64 * 1024
# What a tokenizer is made of (as Hugging Face saves one), and the model's configs beside it.
NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.json",
        "config.json",
        "generation_config.json",
    }
)


@attrs.frozen
class Bundle:
    data: bytes
    sha256: str

    def chunks(self) -> list[bytes]:
        return [self.data[i : i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]


def bundle_of(folder: Path) -> Bundle:
    """The zip of the tokenizer's files in `folder`, flat, deflated, in a stable order."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.iterdir()):
            if path.is_file() and (path.name in NAMES or path.suffix == ".jinja"):
                info = zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())


class TokenizerBundle:
    """The bundle, made once for every caller (in the I/O thread's loop)."""

    def __init__(self) -> None:
        self.made: asyncio.Future[Bundle] | None = None

    async def get(self, folder: Path) -> Bundle:
        if self.made is None:
            self.made = asyncio.get_running_loop().run_in_executor(None, bundle_of, folder)
        return await asyncio.shield(self.made)
