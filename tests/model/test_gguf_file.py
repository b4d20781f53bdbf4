"""A GGUF file's header as Loom reads it: what gguf's own reader finds, in milliseconds, and a
clear refusal of a file cut short or saying what the spec does not."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from loom.model.gguf_file import read_file_header, read_header
from loom.model.loader import default_model_path


def test_gguf_file_header_is_what_gguf_s_reader_reads() -> None:
    """The default model's file: every tensor's name, shape, type and offset, and every field
    but the tokenizer's, as gguf's reader has them."""
    path = default_model_path()
    header, reader = read_file_header(path), gguf.GGUFReader(path)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.shape == tuple(reversed(theirs.shape.tolist()))
        assert ours.ggml_type == theirs.tensor_type
        assert ours.offset == theirs.data_offset
    expected = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith(("tokenizer.", "GGUF."))
    }
    assert header.fields == expected
    assert header.architecture == "llama"
    assert "tokenizer.ggml.tokens" not in header.fields  # stepped over, not decoded


def small_file(tmp_path: Path) -> bytes:
    writer = gguf.GGUFWriter(tmp_path / "small.gguf", "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_array("general.languages", ["en", "fr"])
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return (tmp_path / "small.gguf").read_bytes()


def test_gguf_file_reads_arrays_and_the_data_s_alignment(tmp_path: Path) -> None:
    data = small_file(tmp_path)
    header = read_header(data)
    assert header.fields["general.languages"] == ["en", "fr"]
    assert header.fields["llama.block_count"] == 2
    (tensor,) = header.tensors
    assert (tensor.shape, tensor.offset % 32) == ((4, 32), 0)
    assert data[tensor.offset : tensor.offset + 4] == struct.pack("<f", 1.0)


def test_gguf_file_cut_anywhere_in_its_header_is_refused_by_a_value_error(
    tmp_path: Path,
) -> None:
    data = small_file(tmp_path)
    header_end = read_header(data).tensors[0].offset
    for end in range(header_end):
        try:
            read_header(data[:end])
        except ValueError:
            continue
        # Cut in the padding after the tensor list: the header is whole, the data is not.
        assert end > header_end - 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: b"GGML" + d[4:], "not a GGUF file"),
        (lambda d: d[:4] + struct.pack("<I", 7) + d[8:], "not a GGUF file of version 2 or 3"),
        (lambda d: d[:24] + struct.pack("<Q", 2**62) + d[32:], "runs past the end"),
    ],
)
def test_gguf_file_refuses_a_file_that_is_not_one(
    tmp_path: Path, change: object, message: str
) -> None:
    """A foreign magic, an unknown version, a key's length past the end (a hostile file's
    2**62 bytes are never allocated)."""
    data = change(small_file(tmp_path))  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        read_header(data)


def test_gguf_file_refuses_a_value_type_outside_the_spec(tmp_path: Path) -> None:
    data = small_file(tmp_path)
    key = b"llama.block_count"
    at = data.index(key) + len(key)  # the value type follows the key
    data = data[:at] + struct.pack("<I", 13) + data[at + 4 :]
    with pytest.raises(ValueError, match="metadata value type 13 at byte"):
        read_header(data)
