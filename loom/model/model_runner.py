"""The model runner: one forward pass per step for every scheduled sequence, over the KV pool,
then sampling for the sequences that sample.

`execute_model` takes the step's `SchedulerOutput` and returns a `ModelRunnerOutput`: one token
per sampling sequence, or, for one with k draft tokens, a token sampled at each of its last
k + 1 positions, of which it emits the accepted drafts and the one after them
(loom/core/speculative.py). The LM head runs only on those positions (a prompt chunk
with more to come needs none), and on every position of a chunk that scores its prompt
(prompt_logprobs: each position's log-probability of the prompt token after it). The runner
owns the KV pool and the sampler; it never decides which blocks a request holds (the
BlockManager does), keeps no per-request cache, and keeps no per-request state between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import attrs
import torch

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.request_output import Logprobs
from loom.core.speculative import emitted, sampling_rows
from loom.core.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput, check_scheduled
from loom.model.attention_metadata import AttentionMetadata, build_attention_metadata
from loom.model.decoder import DecoderModel
from loom.model.device import DTYPES, available_memory, used_memory
from loom.model.drafter import Drafter, draft_model
from loom.model.kv_cache import KVCache
from loom.model.launched import Launched, SampledTokens
from loom.model.loader import LoadedModel
from loom.model.memory_plan import MemoryPlan, profiled_plan
from loom.model.prompt_rows import pool_hidden, score_prompt
from loom.model.sampler import Masks, Sampler
from loom.model.static_decode import MAX_GRAPH_SEQS, StaticDecode

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs batched steps of a loaded model over a paged KV pool sized by `cache`."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache: CacheConfig,
        *,
        static_decode: bool | None = None,
        steps: SchedulerConfig | None = None,
    ) -> None:
        """`static_decode`: decode steps over persistent buffers (loom/model/static_decode.py),
        where the decode attention reads the pool in place; None: on a GPU (captured in CUDA
        graphs, unless `loaded.enforce_eager`), not on a CPU (the C++ kernels' dynamic step is
        as fast there); True on a CPU runs it eagerly (the tests). `steps`: the scheduler's limits,
        which size the static step's buckets and the step a GPU profiles to plan its memory."""
        self.device, self.dtype = loaded.device, loaded.dtype  # the model's (the pool's may differ)
        self.frees_cpu = self.device.type != "cpu"  # a step leaves the cores free: overlap steps
        if self.device.type == "cuda":  # this thread's current device: Triton launches there
            torch.cuda.set_device(self.device)
        steps = steps or SchedulerConfig(max_num_seqs=MAX_GRAPH_SEQS, max_num_batched_tokens=8192)
        self.block_size = cache.block_size
        kv_dtype = loaded.dtype if cache.kv_cache_dtype == "auto" else DTYPES[cache.kv_cache_dtype]
        self.model = DecoderModel(
            loaded.model, quantization=loaded.quantization, tokenizer=loaded.tokenizer,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        self.kv_cache_shape = self.model.kv_cache_shape(cache.block_size)
        draft = draft_model(loaded, kv_dtype)  # built before the pools are sized
        pools = 1 if draft is None else 2  # the draft model's pool: the target's shape
        graphs = self.device.type == "cuda" and not loaded.enforce_eager
        static_decode = self.takes_static(graphs if static_decode is None else static_decode)
        self.static: StaticDecode | None = None  # built once the pool is
        self.plan = self.memory_plan(cache, pools, steps)
        log.info("%s", self.plan.describe())
        num_blocks = self.plan.num_blocks
        # The static step's padded rows write to a scratch block past the BlockManager's.
        self.kv_cache = KVCache.allocate(
            self.kv_cache_shape, num_blocks + static_decode, self.device
        )
        if static_decode:
            max_seqs = min(steps.max_num_seqs, MAX_GRAPH_SEQS)
            self.static = StaticDecode(
                self.model, self.kv_cache, block_size=cache.block_size, scratch_block=num_blocks,
                max_seqs=max_seqs, graphs=graphs,
            )  # fmt: skip
        self.sampler = Sampler(self.model.vocab_size, self.device)
        self.last_sampled = SampledTokens.none()  # the last launch's tokens (pending tokens')
        self.drafter: Drafter | None = None
        if draft is not None:
            pool = KVCache.allocate(self.kv_cache_shape, num_blocks, self.device)
            self.drafter = Drafter(draft, partial(self.forward, model=draft, kv_cache=pool))

    def takes_static(self, asked: bool) -> bool:
        """Whether decode steps go static: where asked, decode attention reads the pool in
        place, and the model is no mixture of experts (its routing picks rows by value: a
        data-dependent shape no graph can hold)."""
        return asked and self.model.decode_in_place and self.model.layers[0].experts is None

    def memory_plan(self, cache: CacheConfig, pools: int, steps: SchedulerConfig) -> MemoryPlan:
        """The KV pool's size (loom/model/memory_plan.py): on a GPU, what the budget leaves
        after profiled steps, unless the cache's settings give a size; else theirs."""
        per_block, device = pools * self.kv_cache_shape.bytes_per_block, self.device
        if device.type != "cuda" or cache.num_blocks or cache.kv_cache_memory:
            num_blocks = cache.num_blocks_for(per_block, partial(available_memory, device))
            in_use = used_memory(device)
            return MemoryPlan(
                device=str(device),
                bytes_per_block=per_block,
                block_size=cache.block_size,
                num_blocks=num_blocks,
                in_use=in_use,
            )
        return profiled_plan(
            partial(self.forward, model=self.model),
            self.model,
            self.kv_cache_shape,
            pools,
            steps.max_num_batched_tokens,
            min(steps.max_num_seqs, MAX_GRAPH_SEQS),
            utilization=cache.gpu_memory_utilization,
        )

    @property
    def num_blocks(self) -> int:
        """The blocks the BlockManager hands out (the static step's scratch block is not)."""
        return self.kv_cache.num_blocks - (self.static is not None)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def kv_window(self) -> int | None:
        """Where every layer slides its window: the widest (the KV blocks wholly before it may
        be freed as a sequence grows); else None."""
        return self.model.family.kv_window

    def execute_model(
        self, output: SchedulerOutput, masks: Masks | None = None
    ) -> ModelRunnerOutput:
        """The step launched and its output waited for."""
        return self.launch(output, masks).output()

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, masks: Masks | None = None) -> Launched:
        """One forward for the whole step, then one sampled token per sampling sequence;
        `masks()` (waited for after the forward) gives the constrained rows' masks. A pending
        token takes the last launch's (loom/model/launched.py); a greedy static step's output
        waits for the device, which the launch does not."""
        sequences = output.sequences
        if not sequences:
            raise ValueError("a step needs at least one scheduled sequence")
        if self.device.type == "cuda":  # a worker thread's current device: Triton's launches'
            torch.cuda.set_device(self.device)
        if self.drafter is not None:
            sequences = tuple(self.drafter.draft(sequences))
        if self.static is not None and self.static.takes(sequences):
            return self.static_step(self.static, sequences, masks)
        hidden = self.forward(sequences)
        ends = torch.tensor([len(seq.token_ids) for seq in sequences]).cumsum(0)
        ended = list(zip(sequences, ends.tolist(), strict=True))
        chunks = [(seq, hidden[end - len(seq.token_ids) : end]) for seq, end in ended]
        scored = {
            s.request_id: score_prompt(self.model, rows, s.scoring)
            for s, rows in chunks
            if s.scoring is not None
        }
        pooled = {
            s.request_id: pool_hidden(self.model, rows, s.pooling)
            for s, rows in chunks
            if s.pooling is not None
        }
        sampling = [(s, end) for s, end in ended if s.sampling is not None]
        if not sampling:
            self.last_sampled = SampledTokens.none()
            return Launched.done(
                ModelRunnerOutput(
                    request_ids=(), token_ids=(), logprobs=(), prompt_logprobs=scored, pooled=pooled
                )
            )
        # A sequence's rows: its last position, or with k drafts its last k + 1 (one each).
        rows = [e - 1 - j for s, e in sampling for j in reversed(range(len(s.draft_token_ids) + 1))]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        emits = self.sample([s for s, _ in sampling], logits, masks, scored)
        return Launched.done(attrs.evolve(emits, pooled=pooled) if pooled else emits)

    def static_step(
        self, static: StaticDecode, sequences: Sequence[ScheduledSequence], masks: Masks | None
    ) -> Launched:
        """A decode step the static step takes: its logits come out of it (the LM head too is
        in its CUDA graph), one row a sequence; a step of plain greedy rows takes the tokens
        the graph's argmax found, with no sampler."""
        for seq in sequences:
            check_scheduled(seq, self.block_size)
        out = static.run(sequences, self.last_sampled)
        if all(s.sampling is not None and s.sampling.argmax_only for s in sequences):
            # Sampled in the graph (greedy rows, nothing moved): read back once it is done.
            readback = static.read(out.argmax)
            ids = {seq.request_id: i for i, seq in enumerate(sequences)}
            self.last_sampled = SampledTokens(ids, out.argmax)

            def output() -> ModelRunnerOutput:
                ids = readback.token_ids()
                return emitted(list(sequences), ids, [None] * len(ids), prompt_logprobs={})

            return Launched(output, readback.ready)
        logits = out.logits
        rows = [i for i, seq in enumerate(sequences) if seq.sampling is not None]
        if len(rows) < len(sequences):  # a one-token prompt chunk that does not end its prompt
            logits = logits[torch.tensor(rows, device=self.device)]
        return Launched.done(self.sample([sequences[i] for i in rows], logits.float(), masks, {}))

    def sample(
        self,
        sequences: Sequence[ScheduledSequence],
        logits: torch.Tensor,
        masks: Masks | None,
        scored: dict[str, tuple[Logprobs, ...]],
    ) -> ModelRunnerOutput:
        """Each sampling sequence's tokens from its rows of float32 `logits`; kept on the
        device for the next step's pending tokens."""
        if not sequences:
            self.last_sampled = SampledTokens.none()
            return ModelRunnerOutput(
                request_ids=(), token_ids=(), logprobs=(), prompt_logprobs=scored
            )
        sampled = self.sampler.sample(logits, sampling_rows(sequences), masks)
        rows, at = {}, 0
        for seq in sequences:  # (a drafted sequence's rows: never a pending token's)
            rows[seq.request_id] = at
            at += len(seq.draft_token_ids) + 1
        self.last_sampled = SampledTokens(rows, sampled.on_device)
        return emitted(sequences, sampled.token_ids, sampled.logprobs, prompt_logprobs=scored)

    @torch.inference_mode()
    def logits(self, seq: ScheduledSequence) -> torch.Tensor:
        """Logits [T, vocab] after each of one sequence's new tokens, K/V written as in a
        step; nothing sampled (scoring a text: perplexity, the quantised methods' checks)."""
        return self.model.compute_logits(self.forward([seq])).float()

    def forward(
        self,
        sequences: Sequence[ScheduledSequence],
        model: DecoderModel | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The model's (or the draft `model`'s, over its own pool) forward over the step."""
        for seq in sequences:
            check_scheduled(seq, self.block_size)
        if model is None and self.static is not None and self.static.takes(sequences):
            return self.static.run(sequences, self.last_sampled).hidden
        model, kv_cache = model or self.model, kv_cache or self.kv_cache
        flat = [t for seq in sequences for t in seq.token_ids]
        input_ids = torch.tensor(flat, device=self.device)
        self.last_sampled.fill(input_ids, sequences)  # the pending tokens, from the last launch
        return model.forward(
            input_ids,
            positions(sequences).to(self.device),
            self.attention_metadata(sequences, model),
            kv_cache,
        )

    def attention_metadata(
        self, sequences: Sequence[ScheduledSequence], model: DecoderModel | None = None
    ) -> AttentionMetadata:
        """The step's slot mapping, gather indices and masks, shared by every layer."""
        model = model or self.model
        return build_attention_metadata(
            num_computed=[seq.num_computed_tokens for seq in sequences],
            query_lens=[len(seq.token_ids) for seq in sequences],
            block_tables=[seq.block_table for seq in sequences],
            block_size=self.block_size,
            device=self.device,
            num_queries_per_kv=model.num_heads // model.num_kv_heads,
            dtype=model.dtype,
            decode_in_place=model.decode_in_place,
            windows=model.family.window_sizes,
            verifying=[bool(seq.draft_token_ids) for seq in sequences],
        )


def positions(sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
    """The absolute position of every new token, flat."""
    return torch.cat(
        [
            torch.arange(seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids))
            for seq in sequences
        ]
    )
