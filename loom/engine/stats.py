"""What the engine tells about itself (the server's GetServerStats and GetModelInfo)."""

from __future__ import annotations

from collections import Counter

import attrs

from loom.core.request import Request
from loom.core.scheduler import Scheduler
from loom.core.speculative import Speculation
from loom.engine.config import EngineConfig
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner


@attrs.frozen(kw_only=True)
class TenantStats:
    num_running: int  # scheduled and not paused
    num_waiting: int  # queued (not paused), or still being admitted
    num_prompt_tokens: int  # admitted, all time
    num_generated_tokens: int  # all time
    num_cached_tokens: int  # prompt tokens found in the prefix cache, of those ended
    num_refused: int  # refused for its share of the queue (or its place taken), all time
    weight: float


MAX_TENANTS = 4096  # the ledger's: beyond, the least recently active tenant is forgotten


@attrs.define
class TenantLedger:
    """Each tenant's figures, all time, recorded by the engine's stepping loop. Bounded: past
    MAX_TENANTS tenants (a client per address can make many), the least recently active one's
    figures are forgotten (they start again from 0 if it comes back)."""

    prompt_tokens: Counter[str] = attrs.field(factory=Counter)
    generated_tokens: Counter[str] = attrs.field(factory=Counter)
    cached_tokens: Counter[str] = attrs.field(factory=Counter)
    refused: Counter[str] = attrs.field(factory=Counter)
    # Speculative decoding, of the requests ended: (drafts, draft tokens, accepted tokens).
    spec: dict[str, tuple[int, int, int]] = attrs.field(factory=dict)
    weights: dict[str, float] = attrs.field(factory=dict)  # each one's latest
    recent: dict[str, None] = attrs.field(factory=dict)  # least recently active first

    def admitted(self, tenant: str, num_prompt_tokens: int, weight: float) -> None:
        self.seen(tenant)
        self.prompt_tokens[tenant] += num_prompt_tokens
        self.weights[tenant] = weight

    def generated(self, tenant: str, num_tokens: int = 1) -> None:
        self.seen(tenant)
        self.generated_tokens[tenant] += num_tokens

    def ended(self, request: Request) -> None:
        tenant = request.tenant
        self.seen(tenant)
        self.cached_tokens[tenant] += request.num_cached_tokens
        if request.num_drafts:
            drafts, tokens, accepted = self.spec.get(tenant, (0, 0, 0))
            self.spec[tenant] = (
                drafts + request.num_drafts,
                tokens + request.num_draft_tokens,
                accepted + request.num_accepted_tokens,
            )

    def refusal(self, tenant: str) -> None:
        self.seen(tenant)
        self.refused[tenant] += 1

    def seen(self, tenant: str) -> None:
        self.recent.pop(tenant, None)
        self.recent[tenant] = None
        if len(self.recent) > MAX_TENANTS:
            forgotten = next(iter(self.recent))
            for figures in (self.prompt_tokens, self.generated_tokens, self.cached_tokens):
                figures.pop(forgotten, None)
            self.refused.pop(forgotten, None)
            self.spec.pop(forgotten, None)
            self.weights.pop(forgotten, None)
            del self.recent[forgotten]

    def of(
        self, scheduler: Scheduler, pending: Counter[str], only: str | None
    ) -> dict[str, TenantStats]:
        """Every tenant's figures, or (`only`) that tenant's alone."""
        running = Counter(r.tenant for r in scheduler.running if not r.paused)
        waiting = pending + Counter(r.tenant for r in scheduler.waiting if not r.paused)
        known = set(self.recent) | set(waiting) if only is None else {only}
        return {
            tenant: TenantStats(
                num_running=running[tenant],
                num_waiting=waiting[tenant],
                num_prompt_tokens=self.prompt_tokens[tenant],
                num_generated_tokens=self.generated_tokens[tenant],
                num_cached_tokens=self.cached_tokens[tenant],
                num_refused=self.refused[tenant],
                weight=self.weights.get(tenant, 1.0),
            )
            for tenant in known
        }


@attrs.frozen(kw_only=True)
class EngineStats:
    num_running: int  # scheduled and not paused
    num_waiting: int  # queued (not paused), or still being admitted
    num_paused: int  # their consumer's buffer is full (running, or preempted while paused)
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions: int
    num_chunked_prefills: int
    # The token and prefix-cache figures are a viewer's own (no tenant sees another's prompt
    # lengths or cache hits), every tenant's without one (an admin, the metrics port).
    num_prompt_tokens: int  # admitted prompt tokens, all time
    num_generated_tokens: int  # sampled tokens, all time
    finished: dict[str, int]  # finished requests by finish reason
    num_cached_blocks: int  # holding a reusable prefix, free (evictable) or held
    prefix_cache_queries: int  # tokens of the requests admitted, all time
    prefix_cache_hits: int  # of those, found in the prefix cache
    tenants: dict[str, TenantStats]  # each the viewer may see: its own, or all
    num_waiting_tokens: int  # prompt tokens of the queued requests (not paused)
    gen_throughput: float  # tokens generated a second, every tenant's, lately (Throughput)
    # Speculative decoding's figures: a viewer's own (of its requests ended), every tenant's
    # without one; None with it off.
    spec_decode: SpecDecodeStats | None = None

    @classmethod
    def of(
        cls,
        scheduler: Scheduler,
        pending: Counter[str],
        tenants: dict[str, TenantStats],
        gen_throughput: float,
        viewer: str | None = None,
        spec_of_viewer: tuple[int, int, int] = (0, 0, 0),
    ) -> EngineStats:
        """The figures as `viewer` may see them (`tenants`: that tenant's alone, then)."""
        prompt, generated = scheduler.num_prompt_tokens, scheduler.num_generated_tokens
        queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
        if viewer is not None:
            own = tenants[viewer]
            prompt, generated = own.num_prompt_tokens, own.num_generated_tokens
            queries, hits = own.num_prompt_tokens, own.num_cached_tokens
        return cls(
            num_running=scheduler.num_active(),
            num_waiting=scheduler.num_waiting() + pending.total(),
            num_paused=sum(r.paused for r in scheduler.requests.values()),
            num_total_blocks=scheduler.block_manager.num_total_blocks,
            num_free_blocks=scheduler.block_manager.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_chunked_prefills=scheduler.num_chunked_prefills,
            num_prompt_tokens=prompt,
            num_generated_tokens=generated,
            finished={reason.value: n for reason, n in scheduler.finished.items()},
            num_cached_blocks=scheduler.block_manager.num_cached_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            tenants=tenants,
            num_waiting_tokens=scheduler.num_waiting_tokens(viewer),
            gen_throughput=gen_throughput,
            spec_decode=SpecDecodeStats.of(
                scheduler.spec, None if viewer is None else spec_of_viewer
            ),
        )


@attrs.frozen(kw_only=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters: acceptance rate = accepted / draft tokens; mean accepted
    length (tokens a drafted step gives) = 1 + accepted / drafts."""

    num_drafts: int  # steps of a request with drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...] = ()  # accepted at draft position 0, 1, ... (all's)

    @classmethod
    def of(
        cls, spec: Speculation, viewer: tuple[int, int, int] | None = None
    ) -> SpecDecodeStats | None:
        """Every tenant's, or a `viewer`'s own (drafts, draft tokens, accepted tokens)."""
        if spec.config.speculative_method is None:
            return None
        if viewer is not None:
            drafts, tokens, accepted = viewer
            return cls(num_drafts=drafts, num_draft_tokens=tokens, num_accepted_tokens=accepted)
        return cls(
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_pos=tuple(spec.accepted_per_pos),
        )


class Throughput:
    """The generation rate between two samples at least WINDOW apart (the last rate in
    between; 0 before the second)."""

    WINDOW = 1.0  # seconds

    def __init__(self) -> None:
        self.since: tuple[float, int] | None = None  # (when, tokens generated then)
        self.last = 0.0

    def rate(self, num_generated_tokens: int, now: float) -> float:
        if self.since is None:
            self.since = (now, num_generated_tokens)
        elif now - self.since[0] >= self.WINDOW:
            then, before = self.since
            self.last = max(num_generated_tokens - before, 0) / (now - then)
            self.since = (now, num_generated_tokens)
        return self.last


@attrs.frozen(kw_only=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    block_size: int
    max_num_seqs: int
    max_waiting_requests: int
    max_waiting_tokens: int
    output_buffer_size: int
    stall_timeout: float
    # The tokens a client that tokenizes needs (a gateway: loom/server/vllm/), and the
    # model's architecture ("" for the simulated model).
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    architecture: str
    has_tokenizer: bool
    is_generation: bool = True  # False: an embedding model (--task embed)

    @classmethod
    def of(
        cls, loaded: LoadedModel, runner: ModelRunner, max_model_len: int, config: EngineConfig
    ) -> ModelInfo:
        tokenizer = loaded.tokenizer
        hf_config = getattr(loaded.model, "config", None)  # None: the simulated model
        architecture = "" if hf_config is None else type(loaded.model).__name__
        return cls(
            model=loaded.name,
            max_model_len=max_model_len,
            vocab_size=runner.vocab_size,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            block_size=runner.block_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens,
            output_buffer_size=config.output_buffer_size,
            stall_timeout=config.stall_timeout,
            eos_token_ids=loaded.eos_token_ids,
            bos_token_id=getattr(tokenizer, "bos_token_id", None),
            pad_token_id=getattr(tokenizer, "pad_token_id", None),
            architecture=architecture,
            has_tokenizer=tokenizer is not None,
            is_generation=getattr(loaded, "embedding", None) is None,
        )
