"""Admission: requests on their way from `Engine.submit` to the scheduler.

    submit ── refused at once: queue full, the tenant's share of it taken, prompt too large
       │
       ▼ admission channel (bounded by max_waiting_requests)
    admission task ── token ids: checked at once, in order
       │              text and chat: tokenised in a worker thread, in a task of their own, so
       │              that no token-id request waits behind a text (texts take turns)
       │              a constraint: compiled in that task, shared and queued by tenant,
       │              under a time limit (loom/engine/compiling.py)
       ▼
    checks: the prompt, the context length, the queued prompt tokens
       │
       ▼ admit(submission, request): the engine hands the request to the scheduler

With the fair policy the waiting queue is shared by weight between tenants
(loom/engine/queue_share.py).

A submission is pending from `submit` until it is admitted or refused. Aborting it removes it
from `pending`; it is then dropped: only the very submission still pending under its id is
admitted. A refusal found after `submit` returned ends the submission's stream with the error.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial

import attrs
import trio

from loom.core.constraint import Matcher
from loom.core.errors import EngineOverloadedError
from loom.core.prompt import Prompt, PromptChecker, needs_tokenizer
from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.tenancy import Tenancy
from loom.engine.compiling import Compiler
from loom.engine.config import CHARS_PER_TOKEN, EngineConfig
from loom.engine.queue_share import PUSHED_OUT, QueueShare, queue_full
from loom.engine.request_stream import RequestStream, in_trio
from loom.model.grammar import Grammars
from loom.model.grammar_tokenizer import thinking_tokens
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.model.pooling_config import EmbeddingModel, served_as

Admit = Callable[["Submission", Request], None]


@attrs.frozen(kw_only=True)
class Submission:
    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    arrival_time: float
    deadline: float | None
    cache_salt: str
    tenancy: Tenancy
    stream: RequestStream


class Admission:
    def __init__(
        self,
        config: EngineConfig,
        prompts: PromptChecker,
        scheduler: Scheduler,
        grammars: Grammars,
        *,
        refused: Callable[[Exception, str], None],
        push_out: Callable[[Request, str], None],
        embedding: EmbeddingModel | None = None,
    ) -> None:
        self.config = config
        self.embedding = embedding  # an embedding model's pooling: it serves embeddings only
        self.prompts = prompts
        self.scheduler = scheduler
        self.grammars = grammars
        self.compiler = Compiler(grammars, config.constraints)
        # The submissions being compiled or tokenised: an abort cancels its wait.
        self.preparing: dict[str, trio.CancelScope] = {}
        self.send, self.recv = trio.open_memory_channel[Submission](
            2 * config.max_waiting_requests  # aborted ones stay until handled
        )
        self.pending: dict[str, Submission] = {}  # submitted, not yet admitted nor refused
        # Sent and not yet handled, aborted ones included: never above the channel's capacity,
        # so that `send_nowait` cannot block.
        self.num_unhandled = 0
        # One tokenising thread: a fast tokenizer is one Rust object, whose padding and
        # truncation transformers resets around each call, so two at once can collide.
        self.tokenizers = trio.CapacityLimiter(1)
        self.done = False  # the channel is closed and every submission in it handled
        self.on_refused = refused  # a refusal counted: the exception, the tenant
        # A queued request whose place a tenant below its share takes (the engine ends it).
        self.push_out = push_out

    @classmethod
    def for_model(
        cls,
        config: EngineConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        refused: Callable[[Exception, str], None],
        push_out: Callable[[Request, str], None],
    ) -> Admission:
        # Never more tokens than the whole pool holds (block 0 is the null block).
        max_model_len = min(runner.max_model_len, (runner.num_blocks - 1) * runner.block_size)
        prompts = PromptChecker(
            tokenizer=loaded.tokenizer,
            vocab_size=runner.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=loaded.eos_token_ids,
            max_prompt_chars=config.max_prompt_chars or max_model_len * CHARS_PER_TOKEN,
        )
        grammars = Grammars(
            loaded.tokenizer, runner.vocab_size, loaded.eos_token_ids, config.constraints
        )
        make = partial(cls, refused=refused, push_out=push_out, embedding=loaded.embedding)
        return make(config, prompts, scheduler, grammars)

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        *,
        deadline: float | None,
        cache_salt: str,
        tenancy: Tenancy,
        abort: Callable[[str], None],
        resume: Callable[[str], None],
    ) -> RequestStream:
        """Queue a request under a new id of the engine's making, or refuse it at once. The
        stream's consumer reaches the engine's `abort` and `resume` for this id alone."""
        sampling = served_as(self.embedding, sampling)
        self.prompts.check_size(prompt)
        self.prompts.check_cache_salt(cache_salt)
        self.prompts.check_token_ids("logit_bias token ids", [t for t, _ in sampling.logit_bias])
        if sampling.constraint is not None:
            self.grammars.check(sampling.constraint)
        self.make_place(tenancy)
        request_id = uuid.uuid4().hex
        stream = RequestStream(
            request_id,
            self.config.output_buffer_size,
            on_drained=in_trio(partial(resume, request_id)),
            on_abort=in_trio(partial(abort, request_id)),
        )
        submission = Submission(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            arrival_time=trio.current_time(),
            deadline=deadline,
            cache_salt=cache_salt,
            tenancy=tenancy,
            stream=stream,
        )
        self.send.send_nowait(submission)
        self.pending[request_id] = submission
        self.num_unhandled += 1
        return stream

    def make_place(self, tenancy: Tenancy) -> None:
        """Refuse a request now if the waiting queue has no place for it: full, or (the fair
        policy) its tenant's share taken (loom/engine/queue_share.py)."""
        limit = self.config.max_waiting_requests
        if self.num_unhandled + 1 >= 2 * limit:  # the channel's capacity (see __init__)
            raise queue_full(self.num_unhandled, limit, "requests being admitted")
        if not self.scheduler.policy.shares_queue:
            num_queued = self.scheduler.num_waiting() + self.num_unhandled
            if num_queued >= limit:
                raise queue_full(num_queued, limit)
            return
        pending = (s.tenancy for s in self.pending.values())
        share, queued = QueueShare.of(limit, self.scheduler.waiting, pending, tenancy)
        share.check(tenancy.tenant, queued)

    def take_place(self, submission: Submission) -> None:
        """As the request is handed to the scheduler: if the queue is full, take the place of
        another tenant's queued request (it ends REFUSED), or refuse this one."""
        limit = self.config.max_waiting_requests
        if not self.scheduler.policy.shares_queue:
            return
        if self.pending.get(submission.request_id) is not submission:
            return  # aborted while it was tokenised: it takes no place
        others = (s.tenancy for s in self.pending.values() if s is not submission)
        tenancy = submission.tenancy
        share, queued = QueueShare.of(limit, self.scheduler.waiting, others, tenancy)
        if queued.total() >= limit:
            victim = share.victim(tenancy.tenant, queued, self.scheduler.waiting)
            self.push_out(victim, PUSHED_OUT.format(limit=limit))

    def abort(self, request_id: str) -> bool:
        """Drop a submission not yet admitted (a compile it waits on no longer counts it).
        False if none is pending under that id."""
        if (scope := self.preparing.get(request_id)) is not None:
            scope.cancel()
        return self.pending.pop(request_id, None) is not None

    def close(self, error: Exception | None = None) -> None:
        """Take no new submissions. Those sent are still admitted, unless an `error` (the engine
        stopped) ends them now."""
        self.send.close()
        if error is not None:
            for submission in self.pending.values():
                self.refuse(submission, error)
            self.pending.clear()

    async def run(self, admit: Admit) -> None:
        """The admission task: until the channel is closed and every submission handled."""
        async with self.recv, trio.open_nursery() as nursery:
            async for submission in self.recv:
                if self.pending.get(submission.request_id) is not submission:
                    self.handled(submission)  # aborted while queued
                elif needs_tokenizer(submission.prompt) or submission.sampling.constraint:
                    nursery.start_soon(self.prepare_then_admit, submission, admit)
                else:
                    self.admit_tokens(
                        submission, partial(self.prompts.tokenize, submission.prompt), admit
                    )
        self.done = True

    async def prepare_then_admit(self, submission: Submission, admit: Admit) -> None:
        """Compile the constraint and tokenise the prompt, each in a worker thread, then admit
        (unless it was aborted meanwhile: its wait is cancelled, and it is dropped)."""
        prompt, tenancy = submission.prompt, submission.tenancy
        constraint, salt = submission.sampling.constraint, submission.cache_salt
        with trio.CancelScope() as scope:
            self.preparing[submission.request_id] = scope
            try:
                matcher = await self.compiler.matcher(constraint, tenancy.tenant, salt)
                if needs_tokenizer(prompt):
                    tokenize = partial(self.prompts.tokenize, prompt)
                    token_ids = await trio.to_thread.run_sync(tokenize, limiter=self.tokenizers)
                else:
                    token_ids = self.prompts.tokenize(prompt)
            except Exception as exc:  # invalid, overloaded, or a tokenizer failure
                if self.handled(submission):
                    self.refuse(submission, exc)
                return
            finally:
                del self.preparing[submission.request_id]
        if scope.cancelled_caught:
            self.handled(submission)  # aborted: dropped
            return
        self.admit_tokens(submission, lambda: token_ids, admit, matcher)

    def admit_tokens(
        self,
        submission: Submission,
        tokenize: Callable[[], tuple[int, ...]],
        admit: Admit,
        matcher: Matcher | None = None,
    ) -> None:
        """Check the tokenised prompt and hand the request on, or end its stream with why not."""
        try:
            request = self.prompts.request(
                submission.request_id,
                tokenize(),
                submission.sampling,
                arrival_time=submission.arrival_time,
                deadline=submission.deadline,
                cache_salt=submission.cache_salt,
                tenancy=submission.tenancy,
            )
            if matcher is not None:  # (with a reasoning parser, bound after the thinking)
                constraint = submission.sampling.constraint
                request.constrain(matcher, thinking_tokens(self.prompts.tokenizer, constraint))
            self.check_backlog(request.num_prompt_tokens)
            self.take_place(submission)
        except Exception as exc:  # invalid or overloaded
            if self.handled(submission):
                self.refuse(submission, exc)
            return
        if self.handled(submission):  # not aborted meanwhile
            admit(submission, request)

    def refuse(self, submission: Submission, exc: Exception) -> None:
        submission.stream.fail(exc)
        self.on_refused(exc, submission.tenancy.tenant)

    def handled(self, submission: Submission) -> bool:
        """Done with a submission: whether it was still pending (not aborted, not stopped)."""
        self.num_unhandled -= 1
        return self.pending.pop(submission.request_id, None) is submission

    def check_backlog(self, num_prompt: int) -> None:
        num_queued = self.scheduler.num_waiting_tokens()
        if num_queued + num_prompt > self.config.max_waiting_tokens:
            raise EngineOverloadedError(
                f"the queued prompt tokens would exceed max_waiting_tokens="
                f"{self.config.max_waiting_tokens} ({num_queued} queued, this prompt {num_prompt})"
            )
