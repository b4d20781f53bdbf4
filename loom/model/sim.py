"""A simulated model, `loom serve --model sim`: everything but the forward pass is real.

The engine, scheduler, block manager, bridge and server run unchanged; `SimRunner` replaces the
forward pass and sampling with a sleep (a step costs `step_ms + seq_ms * sequences + token_ms *
tokens` milliseconds) and a deterministic next token: a function of the sequence's last token
and its position, as if the model were greedy over fixed logits (or, with `cycle=P`, the last
token's successor modulo P: an output that repeats, which speculative decoding's n-gram drafts
predict; a grammar's mask is honoured:
the first token it allows from that one on; a seeded, sampled request's token is moved by its
seed). There is no KV memory: blocks are bookkeeping only. Without a tokenizer, prompts are
token ids and nothing ends a request but max_tokens or a stop token id; `tokenizer=` gives it
one (its vocabulary, EOS and chat template), so that text, chat and a gateway that tokenizes
(SMG) work as with a real model: `default` for the default model's (converted once into the
model cache), or a folder of tokenizer files, or a GGUF file.
What it is for: thousands of concurrent streams on two cores, for testing clients, gateways,
cancellation, backpressure and the server's own overhead. Never for output quality.

    --model sim
    --model sim:step_ms=10,seq_ms=0.1,token_ms=0.02,vocab=32000,max_len=8192,blocks=65536
    --model sim:step_ms=2,tokenizer=default
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import attrs
import torch

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.request_output import Logprobs, TokenLogprob
from loom.core.speculative import emitted, sampling_rows
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model.family import UnsupportedModelError
from loom.model.kv_cache import KVCacheShape
from loom.model.launched import Launched
from loom.model.loader import (
    LoadedModel,
    converted_gguf_folder,
    default_model_path,
    model_cache_root,
)
from loom.model.masks import StepMasks
from loom.model.model_runner import ModelRunner
from loom.model.sampler import Masks

PREFIX = "sim"
# Each parameter's least value; the counts (at least 1) are whole numbers, the times are not.
MINIMUMS = {
    "step_ms": 0.0,
    "seq_ms": 0.0,
    "token_ms": 0.0,
    "vocab": 1,
    "max_len": 1,
    "blocks": 2,
    "cycle": 1,
}


@attrs.frozen(kw_only=True)
class SimModel:
    """The simulated model's parameters (each a `key=value` of the model string)."""

    step_ms: float = 10.0  # each step
    seq_ms: float = 0.1  # and each sequence in it
    token_ms: float = 0.02  # and each token computed (prefill costs more than a decode)
    vocab: int = 32000
    max_len: int = 8192
    blocks: int = 65536  # KV blocks, unless --num-blocks says otherwise
    cycle: int | None = None  # the next token is the last one's successor modulo this
    generation_config: SimpleNamespace = attrs.field(
        factory=lambda: SimpleNamespace(eos_token_id=None)
    )

    def step_seconds(self, num_seqs: int, num_tokens: int) -> float:
        return (self.step_ms + self.seq_ms * num_seqs + self.token_ms * num_tokens) / 1000

    def next_token(self, last: int, position: int) -> int:
        if self.cycle is not None:
            return (last + 1) % min(self.cycle, self.vocab)
        return (31 * last + 17 * position + 7) % self.vocab


def is_sim(model: str | None) -> bool:
    return model is not None and (model == PREFIX or model.startswith(PREFIX + ":"))


def load_sim(spec: str, cache_dir: Path | None = None) -> LoadedModel:
    """`sim` or `sim:key=value,...`; an unknown key or a bad value names itself. A tokenizer's
    vocabulary is the model's unless `vocab` says otherwise."""
    values: dict[str, float] = {}
    tokenizer, folder = None, None
    for item in filter(None, spec.removeprefix(PREFIX).removeprefix(":").split(",")):
        key, _, text = item.partition("=")
        if key == "tokenizer":
            from transformers import AutoTokenizer

            folder = tokenizer_folder(text, cache_dir)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            values.setdefault("vocab", len(tokenizer))
            continue
        if key not in MINIMUMS:
            known = ", ".join([*MINIMUMS, "tokenizer"])
            raise ValueError(f"sim model: unknown parameter {key!r} (known: {known})")
        kind = int if MINIMUMS[key] >= 1 else float
        try:
            values[key] = kind(text)
        except ValueError:
            raise ValueError(f"sim model: {key} takes a {kind.__name__}, got {text!r}") from None
        if not values[key] >= MINIMUMS[key]:
            raise ValueError(f"sim model: {key} must be at least {MINIMUMS[key]}, got {text}")
    eos = None if tokenizer is None else tokenizer.eos_token_id
    model = SimModel(**values, generation_config=SimpleNamespace(eos_token_id=eos))  # type: ignore[arg-type]
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        dtype=torch.float32,
        device=torch.device("cpu"),
        tokenizer_folder=folder,
    )


def tokenizer_folder(where: str, cache_dir: Path | None) -> Path:
    """The folder of the tokenizer `tokenizer=` names: `default`, a folder, or a GGUF file."""
    path = default_model_path() if where == "default" else Path(where)
    if path.suffix == ".gguf":
        path = converted_gguf_folder(path, model_cache_root(cache_dir))
    if not path.is_dir():
        raise ValueError(f"sim model: tokenizer={where}: no such folder or GGUF file")
    return path


class SimRunner(ModelRunner):
    """A `ModelRunner` whose step sleeps and returns the simulated model's tokens."""

    def __init__(  # no super(): no model
        self, loaded: LoadedModel, cache: CacheConfig, *, steps: SchedulerConfig | None = None
    ) -> None:
        if loaded.draft_quantization is not None:
            raise UnsupportedModelError(
                "the simulated model has no draft model: use --speculative-method ngram"
            )
        self.sim: SimModel = loaded.model
        self.device, self.dtype = loaded.device, loaded.dtype
        self.frees_cpu = True  # a step sleeps
        self.block_size = cache.block_size
        self.kv_cache_shape = KVCacheShape(
            num_layers=0,
            block_size=cache.block_size,
            num_kv_heads=0,
            head_dim=0,
            dtype=torch.float32,
        )
        self.sim_blocks = cache.num_blocks or self.sim.blocks
        self.last: dict[str, int] = {}  # the last launch's token of each request that sampled

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

    def launch(self, output: SchedulerOutput, masks: Masks | None = None) -> Launched:
        """The step slept and its tokens made; a pending token is the last launch's."""
        sequences = output.sequences
        num_tokens = sum(len(s.token_ids) for s in sequences)
        time.sleep(self.sim.step_seconds(len(sequences), num_tokens))
        sampling = [s for s in sequences if s.sampling is not None]
        rows = sampling_rows(sampling)
        tokens = [self.token(s, i) for s in sampling for i in range(len(s.draft_token_ids) + 1)]
        constrained = [i for i, row in enumerate(rows) if row.constrained]
        if constrained:
            if masks is None:
                raise ValueError("a step with constrained rows needs their masks")
            for i, allowed in zip(constrained, allowed_of(masks()), strict=True):
                tokens[i] = first_allowed(tokens[i], allowed)
        found = [logprobs(row, t, self.sim.vocab) for row, t in zip(rows, tokens, strict=True)]
        result = emitted(sampling, tokens, found)
        self.last = dict(zip(result.request_ids, result.token_ids, strict=True))  # each one's last
        return Launched.done(result)

    def token(self, seq: ScheduledSequence, row: int) -> int:
        """The next token at the sequence's `row`-th sampled position (its last, or with k
        drafts one of its last k + 1); a sampled request with a seed: that one moved by the
        seed, so that seeds repeat and differ as a real model's do."""
        at = len(seq.token_ids) - 1 - len(seq.draft_token_ids) + row  # the token sampled after
        last = self.last[seq.request_id] if seq.pending_token else seq.token_ids[at]
        token = self.sim.next_token(last, seq.num_computed_tokens + at + 1)
        params = seq.sampling.params if seq.sampling is not None else None
        if params is None or params.greedy or params.seed is None:
            return token
        return (token + 7919 * (params.seed + 1)) % self.sim.vocab


def allowed_of(step: StepMasks) -> list[torch.Tensor]:
    """Each constrained row's allowed token ids, ascending (from its ids or its bias row)."""
    rows = iter(step.bias)
    return [
        ids if ids is not None else torch.nonzero(next(rows) == 0).flatten() for ids in step.allowed
    ]


def first_allowed(token: int, allowed: torch.Tensor) -> int:
    """The first of `allowed` (ascending) from `token` on, wrapping round: greedy over the
    fixed logits, which fall from the preferred token on. None allowed: the token itself."""
    if len(allowed) == 0:
        return token
    later = allowed[allowed >= token]
    return int(later[0] if len(later) else allowed[0])


def logprobs(row: SamplingInput, token: int, vocab: int) -> Logprobs | None:
    """As from fixed logits: the chosen token the likeliest (-0.1), then the tokens after it,
    each 1 less likely (as many as asked for: a message as large as a real model's)."""
    if row.params.logprobs is None:
        return None
    count = min(row.params.logprobs, vocab)
    top = tuple(TokenLogprob(token_id=(token + k) % vocab, logprob=-0.1 - k) for k in range(count))
    return Logprobs(chosen=TokenLogprob(token_id=token, logprob=-0.1), top=top)
