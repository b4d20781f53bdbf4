"""The model runner: one forward pass per step for every scheduled sequence, over the KV pool.

Its only input is the step's scheduled sequences (from the scheduler); its output is, for each,
the logits of its last scheduled position. It owns the KV pool; it never decides which blocks a
request holds (the BlockManager does) and never keeps a per-request cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from loom.attention import AttentionMetadata, build_attention_metadata
from loom.kv_cache import KVCache
from loom.llama import LlamaModel
from loom.loader import LoadedModel


@attrs.frozen(kw_only=True)
class ScheduledSequence:
    """One request's share of a step: `token_ids` to compute on top of its cached tokens."""

    request_id: str
    token_ids: tuple[int, ...]  # the new tokens (a prefill chunk, or one decode token)
    num_computed_tokens: int  # tokens already in the KV pool, before `token_ids`
    block_table: tuple[int, ...]  # blocks covering num_computed_tokens + len(token_ids)


class ModelRunner:
    """Runs batched steps of a loaded model over a paged KV pool of `num_blocks` blocks."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        kv_cache_memory_fraction: float | None = None,
    ) -> None:
        """A pool of `num_blocks` blocks, or as many as a budget (bytes or a fraction) holds."""
        self.device = loaded.device
        self.block_size = block_size
        self.model = LlamaModel(loaded.model)
        self.kv_cache_shape = self.model.kv_cache_shape(block_size)
        if num_blocks is None:
            num_blocks = self.kv_cache_shape.num_blocks_for(
                memory_bytes=kv_cache_memory,
                memory_fraction=kv_cache_memory_fraction,
                device=self.device,
            )
        self.kv_cache = KVCache.allocate(self.kv_cache_shape, num_blocks, self.device)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @torch.inference_mode()
    def execute(self, sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Float32 logits [len(sequences), vocab] at each sequence's last scheduled token."""
        if not sequences:
            raise ValueError("a step needs at least one scheduled sequence")
        for seq in sequences:
            check_scheduled(seq, self.block_size)
        query_lens = [len(seq.token_ids) for seq in sequences]
        metadata = self.attention_metadata(sequences)
        input_ids = torch.tensor([t for seq in sequences for t in seq.token_ids])
        positions = torch.cat(
            [
                torch.arange(seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids))
                for seq in sequences
            ]
        )
        logits_index = torch.tensor(query_lens).cumsum(0) - 1
        logits = self.model.forward(
            input_ids.to(self.device),
            positions.to(self.device),
            metadata,
            self.kv_cache,
            logits_index.to(self.device),
        )
        return logits.float()

    def attention_metadata(self, sequences: Sequence[ScheduledSequence]) -> AttentionMetadata:
        """The step's slot mapping, gather indices and masks, shared by every layer."""
        return build_attention_metadata(
            num_computed=[seq.num_computed_tokens for seq in sequences],
            query_lens=[len(seq.token_ids) for seq in sequences],
            block_tables=[seq.block_table for seq in sequences],
            block_size=self.block_size,
            device=self.device,
            num_queries_per_kv=self.model.num_heads // self.model.num_kv_heads,
            dtype=self.kv_cache_shape.dtype,
        )


def check_scheduled(seq: ScheduledSequence, block_size: int) -> None:
    if not seq.token_ids:
        raise ValueError(f"request {seq.request_id}: no tokens scheduled")
    num_tokens = seq.num_computed_tokens + len(seq.token_ids)
    if len(seq.block_table) * block_size < num_tokens:
        raise ValueError(
            f"request {seq.request_id}: block table of {len(seq.block_table)} blocks cannot hold "
            f"{num_tokens} tokens at block size {block_size}"
        )
