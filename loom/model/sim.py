"""A simulated model, `loom serve --model sim`: everything but the forward pass is real.

The engine, scheduler, block manager, bridge and server run unchanged; `SimRunner` replaces the
forward pass and sampling with a sleep (a step costs `step_ms + seq_ms * sequences + token_ms *
tokens` milliseconds) and a deterministic next token: a function of the sequence's last token
and its position, as if the model were greedy over fixed logits. There is no tokenizer (prompts
are token ids), no EOS (requests run to max_tokens or a stop token id), and no KV memory: blocks
are bookkeeping only. What it is for: thousands of concurrent streams on two cores, for testing
clients, cancellation, backpressure and the server's own overhead. Never for output quality.

    --model sim
    --model sim:step_ms=10,seq_ms=0.1,token_ms=0.02,vocab=32000,max_len=8192,blocks=65536
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import attrs
import torch

from loom.core.config import CacheConfig
from loom.core.request_output import Logprobs, TokenLogprob
from loom.core.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from loom.model.kv_cache import KVCacheShape
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.model.sampler import Masks

PREFIX = "sim"
# Each parameter's least value; the counts (at least 1) are whole numbers, the times are not.
MINIMUMS = {"step_ms": 0.0, "seq_ms": 0.0, "token_ms": 0.0, "vocab": 1, "max_len": 1, "blocks": 2}


@attrs.frozen(kw_only=True)
class SimModel:
    """The simulated model's parameters (each a `key=value` of the model string)."""

    step_ms: float = 10.0  # each step
    seq_ms: float = 0.1  # and each sequence in it
    token_ms: float = 0.02  # and each token computed (prefill costs more than a decode)
    vocab: int = 32000
    max_len: int = 8192
    blocks: int = 65536  # KV blocks, unless --num-blocks says otherwise
    generation_config: SimpleNamespace = attrs.field(
        factory=lambda: SimpleNamespace(eos_token_id=None)
    )

    def step_seconds(self, num_seqs: int, num_tokens: int) -> float:
        return (self.step_ms + self.seq_ms * num_seqs + self.token_ms * num_tokens) / 1000

    def next_token(self, last: int, position: int) -> int:
        return (31 * last + 17 * position + 7) % self.vocab


def is_sim(model: str | None) -> bool:
    return model is not None and (model == PREFIX or model.startswith(PREFIX + ":"))


def load_sim(spec: str) -> LoadedModel:
    """`sim` or `sim:key=value,...`; an unknown key or a bad value names itself."""
    values: dict[str, float] = {}
    for item in filter(None, spec.removeprefix(PREFIX).removeprefix(":").split(",")):
        key, _, text = item.partition("=")
        if key not in MINIMUMS:
            known = ", ".join(MINIMUMS)
            raise ValueError(f"sim model: unknown parameter {key!r} (known: {known})")
        kind = int if MINIMUMS[key] >= 1 else float
        try:
            values[key] = kind(text)
        except ValueError:
            raise ValueError(f"sim model: {key} takes a {kind.__name__}, got {text!r}") from None
        if not values[key] >= MINIMUMS[key]:
            raise ValueError(f"sim model: {key} must be at least {MINIMUMS[key]}, got {text}")
    model = SimModel(**values)  # type: ignore[arg-type]
    return LoadedModel(
        name=spec, model=model, tokenizer=None, dtype=torch.float32, device=torch.device("cpu")
    )


class SimRunner(ModelRunner):
    """A `ModelRunner` whose step sleeps and returns the simulated model's tokens."""

    def __init__(self, loaded: LoadedModel, cache: CacheConfig) -> None:  # no super(): no model
        self.sim: SimModel = loaded.model
        self.device, self.dtype = loaded.device, loaded.dtype
        self.block_size = cache.block_size
        self.kv_cache_shape = KVCacheShape(
            num_layers=0,
            block_size=cache.block_size,
            num_kv_heads=0,
            head_dim=0,
            dtype=torch.float32,
        )
        self.sim_blocks = cache.num_blocks or self.sim.blocks

    @property
    def num_blocks(self) -> int:
        return self.sim_blocks

    @property
    def vocab_size(self) -> int:
        return self.sim.vocab

    @property
    def max_model_len(self) -> int:
        return self.sim.max_len

    @property
    def kv_window(self) -> int | None:
        return None  # every key is attended

    def execute_model(
        self, output: SchedulerOutput, masks: Masks | None = None
    ) -> ModelRunnerOutput:
        sequences = output.sequences
        num_tokens = sum(len(s.token_ids) for s in sequences)
        time.sleep(self.sim.step_seconds(len(sequences), num_tokens))
        sampling = [s for s in sequences if s.sampling is not None]
        tokens = tuple(self.token(s) for s in sampling)
        return ModelRunnerOutput(
            request_ids=tuple(s.request_id for s in sampling),
            token_ids=tokens,
            logprobs=tuple(
                logprobs(s, t, self.sim.vocab) for s, t in zip(sampling, tokens, strict=True)
            ),
        )

    def token(self, seq: ScheduledSequence) -> int:
        return self.sim.next_token(seq.token_ids[-1], seq.num_computed_tokens + len(seq.token_ids))


def logprobs(seq: ScheduledSequence, token: int, vocab: int) -> Logprobs | None:
    """As from fixed logits: the chosen token the likeliest (-0.1), then the tokens after it,
    each 1 less likely (as many as asked for: a message as large as a real model's)."""
    assert seq.sampling is not None
    if seq.sampling.params.logprobs is None:
        return None
    count = min(seq.sampling.params.logprobs, vocab)
    top = tuple(TokenLogprob(token_id=(token + k) % vocab, logprob=-0.1 - k) for k in range(count))
    return Logprobs(chosen=TokenLogprob(token_id=token, logprob=-0.1), top=top)
