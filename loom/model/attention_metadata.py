"""A step's attention metadata, built once and read by every layer: where each new token's K/V
go, and how each sequence's keys are read back.

A step packs the scheduled tokens of all its sequences into one flat batch of `T` tokens. Each
sequence `s` brings `q_len[s]` new tokens, at absolute positions `num_computed[s] ..
num_computed[s] + q_len[s] - 1`, and attends to all `seq_len[s] = num_computed[s] + q_len[s]`
keys so far. New keys and values are written to the pool through `slot_mapping`; every key is
then read back through the sequence's block table, never from a per-request cache.

Worked example, block_size 4. Sequence A has 5 tokens cached and decodes 1; sequence B prefills
a first chunk of 3 tokens:

    A: num_computed 5, q_len 1, block_table [7, 2]  ->  positions [5]
    B: num_computed 0, q_len 3, block_table [4]     ->  positions [0, 1, 2]
    flat tokens:    A5  B0  B1  B2
    slot_mapping:   [2*4+1, 4*4+0, 4*4+1, 4*4+2] = [9, 16, 17, 18]
    A's keys:       blocks [7, 2] gathered whole: slots 28..31, 8..11; positions 6, 7 masked

Keys are read a whole block at a time (a block is `block_size` contiguous rows of the pool, so
one large copy per block rather than one small copy per token). Sequences are attended in
groups padded to a common query length `Q` and block count `B` (`L = B * block_size` keys): one
group for single-token (decode) sequences, one for sequences verifying draft tokens (at most
MAX_ROWS_IN_PLACE), one for the rest (prefill chunks), so that a long chunk does not pad every
decode and every verification to its length. With the in-place kernel
(loom/model/attention.py), a sequence verifying draft tokens is that many decode rows: row j a
query at num_computed + j attending keys up to its own, so that a verifying step stays one
decode group, and each token is computed as a decode computes it. Padding blocks are block 0,
the null block; every key past a query's position is masked out. Query padding repeats the
sequence's last token and is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

# With the in-place kernel, a sequence with at most this many new tokens is attended as that
# many decode rows (a step verifying draft tokens stays one decode group: the one-call path).
MAX_ROWS_IN_PLACE = 16

Member = tuple[int, int, Sequence[int], int]  # num_computed, q_len, block table, first flat token


@attrs.frozen(kw_only=True)
class AttentionGroup:
    """Sequences attended together in one padded SDPA call."""

    query_index: torch.Tensor  # [S, Q] flat token index of each query (padding repeats one)
    block_index: torch.Tensor  # [S * B] block of each key block, row by row (padding: block 0)
    mask: torch.Tensor  # [S, 1, G * Q or 1, B * block_size] additive: 0 where row g * Q + i attends
    window_masks: dict[int, torch.Tensor]  # the same, for each sliding window: the nearest keys
    valid: torch.Tensor  # [S, Q] True for real (unpadded) queries
    output_index: torch.Tensor  # [N] flat token index of each real query, in `valid` order
    valid_rows: torch.Tensor  # [N] where each real query is among the S * Q padded ones
    seq_lens: torch.Tensor  # [S] keys each sequence attends


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, used by every layer."""

    slot_mapping: torch.Tensor  # [T] pool slot for each new token's K and V
    groups: tuple[AttentionGroup, ...]
    decode_in_place: bool = False  # decode groups read the pool in place (Loom's CPU kernel)


def build_attention_metadata(
    *,
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    num_queries_per_kv: int = 1,
    dtype: torch.dtype = torch.float32,
    decode_in_place: bool = False,
    windows: Sequence[int] = (),
    verifying: Sequence[bool] = (),
) -> AttentionMetadata:
    """`num_queries_per_kv` (G): query heads per KV head, folded into the query axis. `dtype`: the
    queries' (the additive mask is built in it, once per step rather than by SDPA per layer).
    `windows`: the layers' sliding windows, a mask each. `verifying`: which sequences verify
    draft tokens (a decode token and its drafts: at most MAX_ROWS_IN_PLACE)."""
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    slot_mapping = torch.cat(
        [
            slots_for(block_tables[s], range(num_computed[s], num_computed[s] + q_len), block_size)
            for s, q_len in enumerate(query_lens)
        ]
    )
    verifying = verifying or [False] * len(query_lens)
    members = group_members(
        num_computed, query_lens, block_tables, starts, verifying, decode_in_place
    )
    groups = tuple(
        build_group(
            group,
            block_size,
            device,
            num_queries_per_kv,
            dtype,
            windows,
            masks=not (decode_in_place and i == 0),  # the kernel reads no mask
        )
        for i, group in enumerate(members)
        if group
    )
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device), groups=groups, decode_in_place=decode_in_place
    )


def group_members(
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    verifying: Sequence[bool],
    in_place: bool,
) -> tuple[list[Member], list[Member], list[Member]]:
    """The members of the decode group, the verifying group and the prefill group. Decode:
    each one-token sequence; `in_place`, also each token of a sequence verifying drafts, as a
    row attending its first num_computed + j + 1 keys (all written before any is read), so
    that a token is computed alike whether it was drafted or decoded. Verifying: without
    `in_place`, those sequences whole, not padded to a long prompt chunk. Prefill: the rest
    (prompt chunks, whatever their length: a prompt is computed alike, whether a prefix of it
    was cached or not)."""
    decode: list[Member] = []
    verify: list[Member] = []
    prefill: list[Member] = []
    for s, q_len in enumerate(query_lens):
        if q_len == 1 or (in_place and verifying[s]):
            decode += [
                (num_computed[s] + j, 1, block_tables[s], starts[s] + j) for j in range(q_len)
            ]
        else:
            group = verify if verifying[s] else prefill
            group.append((num_computed[s], q_len, block_tables[s], starts[s]))
    return decode, verify, prefill


def slots_for(block_table: Sequence[int], positions: range, block_size: int) -> torch.Tensor:
    pos = torch.tensor(positions, dtype=torch.long)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def build_group(
    members: list[Member],
    block_size: int,
    device: torch.device,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    windows: Sequence[int] = (),
    *,
    masks: bool = True,
) -> AttentionGroup:
    """The group's padded queries, block index and lengths; without `masks` (a group the
    in-place kernel reads: it masks by length), no masks, which cost the most to build."""
    computed = torch.tensor([m[0] for m in members], dtype=torch.long)
    q_lens = torch.tensor([m[1] for m in members], dtype=torch.long)
    block_tables, starts = [m[2] for m in members], [m[3] for m in members]
    max_q = int(q_lens.max())
    max_blocks = -(-int((computed + q_lens).max()) // block_size)
    tables = torch.zeros(len(block_tables), max_blocks, dtype=torch.long)  # padded with block 0
    for s, table in enumerate(block_tables):
        used = table[:max_blocks]
        tables[s, : len(used)] = torch.tensor(used, dtype=torch.long)

    q_offset = torch.arange(max_q)
    valid = q_offset[None, :] < q_lens[:, None]  # [S, Q]
    last_offset = torch.minimum(q_offset, q_lens[:, None] - 1)
    query_index = torch.tensor(starts)[:, None] + last_offset
    # A query at absolute position p attends keys 0..p. Padded queries repeat the last real one,
    # so every row has at least one key and SDPA never sees a fully masked row.
    query_pos = computed[:, None] + last_offset  # [S, Q]
    key_pos = torch.arange(max_blocks * block_size if masks else 0)
    distance = query_pos[:, :, None] - key_pos[None, None, :]  # [S, Q, L]
    mask = additive_mask(distance >= 0, max_q > 1, num_queries_per_kv, dtype)
    # A window w keeps the keys 0 <= distance < w (transformers' sliding window), the query's
    # own key among them: no row is ever fully masked.
    window_masks = {
        w: additive_mask((distance >= 0) & (distance < w), max_q > 1, num_queries_per_kv, dtype)
        for w in (windows if masks else ())
    }
    return AttentionGroup(
        query_index=query_index.to(device),
        block_index=tables.reshape(-1).to(device),
        mask=mask.to(device),
        window_masks={w: m.to(device) for w, m in window_masks.items()},
        valid=valid.to(device),
        output_index=query_index[valid].to(device),
        valid_rows=valid.flatten().nonzero()[:, 0].to(device),  # found here, on the host
        seq_lens=(computed + q_lens).to(device),
    )


def additive_mask(
    allowed: torch.Tensor, prefill: bool, num_queries_per_kv: int, dtype: torch.dtype
) -> torch.Tensor:
    """[S, Q, L] allowed -> [S, 1, G * Q or 1, L]: 0 where allowed, -inf elsewhere; one row per
    folded query, where a decode's single row broadcasts over G."""
    if prefill:
        allowed = allowed.repeat(1, num_queries_per_kv, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return mask[:, None]
