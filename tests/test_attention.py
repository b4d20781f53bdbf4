"""Attention metadata: the worked example of loom/attention.py, checked index by index."""

from __future__ import annotations

import torch

from loom.attention import build_attention_metadata

CPU = torch.device("cpu")


def test_attention_metadata_matches_the_worked_example() -> None:
    metadata = build_attention_metadata(
        num_computed=[5, 0],
        query_lens=[1, 3],
        block_tables=[[7, 2], [4]],
        block_size=4,
        device=CPU,
    )
    assert metadata.slot_mapping.tolist() == [9, 16, 17, 18]
    decode, prefill = metadata.groups
    assert decode.query_index.tolist() == [[0]]
    assert decode.kv_index.tolist() == [[28, 29, 30, 31, 8, 9]]
    assert decode.mask.all()
    assert prefill.query_index.tolist() == [[1, 2, 3]]
    assert prefill.kv_index.tolist() == [[16, 17, 18]]
    assert prefill.mask[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]


def test_attention_metadata_pads_keys_with_the_null_block_and_repeats_padded_queries() -> None:
    metadata = build_attention_metadata(
        num_computed=[0, 2],
        query_lens=[3, 2],
        block_tables=[[3], [5]],
        block_size=4,
        device=CPU,
    )
    (prefill,) = metadata.groups
    # Second sequence: keys 0..3 in block 5; the first has only 3 keys, the 4th is padding.
    assert prefill.kv_index.tolist() == [[12, 13, 14, 0], [20, 21, 22, 23]]
    # The second sequence's 2 queries are padded to 3 by repeating its last token (flat 4).
    assert prefill.query_index.tolist() == [[0, 1, 2], [3, 4, 4]]
    assert prefill.valid.tolist() == [[True, True, True], [True, True, False]]
    assert prefill.output_index.tolist() == [0, 1, 2, 3, 4]
    # Padded key position 3 of the first sequence is never attended by a real query.
    assert not prefill.mask[0, 0, :, 3].any()
    assert prefill.mask[1, 0, 1].tolist() == [True, True, True, True]
