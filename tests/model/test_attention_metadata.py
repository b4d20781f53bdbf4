"""Attention metadata: the worked example of loom/model/attention_metadata.py, index by index."""

from __future__ import annotations

import torch

from loom.model.attention_metadata import (
    MAX_ROWS_IN_PLACE,
    AttentionGroup,
    build_attention_metadata,
)

CPU = torch.device("cpu")
T, F = True, False


def allowed(group: AttentionGroup) -> torch.Tensor:
    """Where the additive mask lets a query attend (0), not where it blocks (-inf)."""
    assert set(group.mask.unique().tolist()) <= {0.0, float("-inf")}
    return group.mask == 0


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
    assert decode.block_index.tolist() == [7, 2]
    assert allowed(decode)[0, 0].tolist() == [[T, T, T, T, T, T, F, F]]  # positions 0..5 of 8 slots
    assert prefill.query_index.tolist() == [[1, 2, 3]]
    assert prefill.block_index.tolist() == [4]
    assert allowed(prefill)[0, 0].tolist() == [[T, F, F, F], [T, T, F, F], [T, T, T, F]]


def test_attention_metadata_in_place_makes_a_verifying_sequence_decode_rows() -> None:
    """A sequence verifying draft tokens (5 computed, 3 new) is three decode rows beside a
    decode: one group, the one-call path's; a prompt chunk as short stays a prefill (a prompt
    is computed alike, whether a prefix of it was cached or not)."""
    metadata = build_attention_metadata(
        num_computed=[5, 2],
        query_lens=[3, 1],
        block_tables=[[7, 2], [4]],
        block_size=4,
        device=CPU,
        decode_in_place=True,
        verifying=[True, False],
    )
    (decode,) = metadata.groups
    assert decode.mask.numel() == 0  # the kernel masks by length: none built
    assert decode.query_index.tolist() == [[0], [1], [2], [3]]
    assert decode.seq_lens.tolist() == [6, 7, 8, 3]  # each row's keys: up to its own
    assert decode.block_index.tolist() == [7, 2, 7, 2, 7, 2, 4, 0]
    metadata = build_attention_metadata(
        num_computed=[5, 2],
        query_lens=[3, 1],
        block_tables=[[7, 2], [4]],
        block_size=4,
        device=CPU,
        decode_in_place=True,
    )
    assert [g.query_index.shape[1] for g in metadata.groups] == [1, 3]
    # Gathering instead: a sequence verifying is a group of its own, not padded to a long chunk.
    long = MAX_ROWS_IN_PLACE + 1
    metadata = build_attention_metadata(
        num_computed=[0, 2, 5],
        query_lens=[long, 1, 3],
        block_tables=[list(range(1, long // 4 + 2)), [4], [7, 2]],
        block_size=4,
        device=CPU,
        verifying=[False, False, True],
    )
    assert [g.query_index.shape[1] for g in metadata.groups] == [1, 3, long]


def test_attention_metadata_pads_with_the_null_block_and_repeats_padded_queries() -> None:
    metadata = build_attention_metadata(
        num_computed=[0, 2, 0],
        query_lens=[3, 2, 6],
        block_tables=[[3], [5], [6, 8]],
        block_size=4,
        device=CPU,
    )
    (prefill,) = metadata.groups
    # Two blocks for the longest; the shorter ones are padded with block 0.
    assert prefill.block_index.tolist() == [3, 0, 5, 0, 6, 8]
    # Queries padded to 6 by repeating each sequence's last token.
    assert prefill.query_index.tolist() == [
        [0, 1, 2, 2, 2, 2],
        [3, 4, 4, 4, 4, 4],
        [5, 6, 7, 8, 9, 10],
    ]
    assert prefill.valid.tolist() == [[T, T, T, F, F, F], [T, T, F, F, F, F], [T] * 6]
    assert prefill.output_index.tolist() == list(range(11))
    # The second sequence's queries sit at positions 2 and 3: keys 0..2, then 0..3.
    assert allowed(prefill)[1, 0, 0].tolist() == [T, T, T, F, F, F, F, F]
    assert allowed(prefill)[1, 0, 1].tolist() == [T, T, T, T, F, F, F, F]
    # No real query attends a padding block's slots.
    assert not allowed(prefill)[0, 0][prefill.valid[0]][:, 4:].any()


def test_attention_metadata_folds_query_groups_into_the_mask_rows() -> None:
    plain = build_attention_metadata(
        num_computed=[2, 5],
        query_lens=[3, 1],
        block_tables=[[1, 2], [3, 4]],
        block_size=4,
        device=CPU,
    )
    folded = build_attention_metadata(
        num_computed=[2, 5],
        query_lens=[3, 1],
        block_tables=[[1, 2], [3, 4]],
        block_size=4,
        device=CPU,
        num_queries_per_kv=3,
    )
    plain_decode, plain_prefill = plain.groups
    decode, prefill = folded.groups
    assert torch.equal(decode.mask, plain_decode.mask)  # one row, broadcast over the group
    assert prefill.mask.shape == (1, 1, 9, 8)
    for g in range(3):  # row g * Q + i is query i's row
        assert torch.equal(allowed(prefill)[0, 0, 3 * g : 3 * g + 3], allowed(plain_prefill)[0, 0])
