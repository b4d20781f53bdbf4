"""Counters the engine exposes (the server's GetServerStats)."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class EngineStats:
    num_running: int  # scheduled and not paused
    num_waiting: int  # queued, or still being tokenised
    num_paused: int  # their consumer's buffer is full
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions: int
    num_chunked_prefills: int
    num_prompt_tokens: int  # admitted prompt tokens, all time
    num_generated_tokens: int  # sampled tokens, all time
    finished: dict[str, int]  # finished requests by finish reason


@attrs.frozen(kw_only=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    block_size: int
