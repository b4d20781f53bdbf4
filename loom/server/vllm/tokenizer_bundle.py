"""The tokenizer as GetTokenizer hands it to a gateway (SMG builds its own from it, so that it
needs nothing but the worker's address): the served tokenizer saved as transformers saves it
(tokenizer.json, tokenizer_config.json, its chat template), zipped flat, in chunks, the SHA-256
of the whole zip on the last chunk.

Made once, on the first call, in a worker thread (saving and zipping SmolLM2's takes about half
a second): never in the I/O thread, which no call may hold.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import attrs

CHUNK_BYTES = 64 * 1024


@attrs.frozen
class Bundle:
    data: bytes
    sha256: str

    def chunks(self) -> list[bytes]:
        return [self.data[i : i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]


def bundle_of(tokenizer: Any) -> Bundle:
    """The zip of `tokenizer`'s files, flat, deflated, in a stable order."""
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="loom-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(folder).iterdir()):
                if path.is_file():
                    info = zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return Bundle(data, hashlib.sha256(data).hexdigest())


class TokenizerBundle:
    """The bundle, made once for every caller (in the I/O thread's loop)."""

    def __init__(self) -> None:
        self.made: asyncio.Future[Bundle] | None = None

    async def get(self, tokenizer: Any) -> Bundle:
        if self.made is None or (self.made.done() and self.made.exception() is not None):
            loop = asyncio.get_running_loop()
            self.made = loop.run_in_executor(None, bundle_of, tokenizer)
        return await asyncio.shield(self.made)
