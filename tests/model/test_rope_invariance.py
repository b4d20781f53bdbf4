"""A sequence's rotary embedding does not depend on what shares its batch.

transformers' dynamic NTK and longrope tables are chosen by the largest position the rotary
module is given, and Loom gives it the whole step's flat positions: a sequence batched with a
longer one would be turned by the longer one's table. Loom keeps every position within
`max_position_embeddings` (and longrope within its original length: loom/model/family.py,
`max_model_len_of`), where the table never changes: a sequence's hidden states are the same
alone and beside the longest sequence Loom admits, bit for bit. Past that length (what lifting
the cap would allow) they are not, which the second half of the test shows.
"""

from __future__ import annotations

import pytest
import torch

from loom.core.step import ScheduledSequence
from loom.model.attention_metadata import build_attention_metadata
from loom.model.decoder import DecoderModel
from loom.model.kv_cache import KVCache
from loom.model.model_runner import positions
from tests.model.test_families import case_model

BLOCK = 16


def sequence(name: str, length: int, first_block: int) -> ScheduledSequence:
    blocks = tuple(range(first_block, first_block + -(-length // BLOCK)))
    tokens = tuple((7 * i + 3) % 500 + 1 for i in range(length))
    return ScheduledSequence(
        request_id=name, token_ids=tokens, num_computed_tokens=0, block_table=blocks
    )


@torch.inference_mode()
def hidden(model: DecoderModel, sequences: list[ScheduledSequence]) -> torch.Tensor:
    """The step's last hidden states, over a fresh pool."""
    cache = KVCache.allocate(model.kv_cache_shape(BLOCK), 128, torch.device("cpu"))
    metadata = build_attention_metadata(
        num_computed=[0] * len(sequences),
        query_lens=[len(s.token_ids) for s in sequences],
        block_tables=[s.block_table for s in sequences],
        block_size=BLOCK,
        device=torch.device("cpu"),
        num_queries_per_kv=model.num_heads // model.num_kv_heads,
        dtype=model.dtype,
        decode_in_place=model.decode_in_place,
        windows=model.family.window_sizes,
        verifying=[False] * len(sequences),
    )
    ids = torch.tensor([t for s in sequences for t in s.token_ids])
    return model.forward(ids, positions(sequences), metadata, cache)


@pytest.mark.parametrize("case", ["llama-rope-dynamic", "phi3-longrope"])
def test_a_sequence_is_turned_alike_whatever_shares_its_batch(case: str) -> None:
    model = DecoderModel(case_model(case).model)
    short = sequence("short", 10, first_block=1)
    alone = hidden(model, [short])
    longest = model.family.max_model_len
    beside = hidden(model, [short, sequence("long", longest, first_block=2)])[:10]
    assert torch.equal(alone, beside)
    # Past the cap the table would change with the batch: the difference the cap prevents.
    past = hidden(model, [short, sequence("long", 2 * longest, first_block=2)])[:10]
    assert not torch.allclose(alone, past, atol=1e-4)
