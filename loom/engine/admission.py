"""Admission: requests on their way from `Engine.submit` to the scheduler.

    submit ── refused at once: queue full, prompt too large
       │
       ▼ admission channel (bounded by max_waiting_requests)
    admission task ── tokenise (text and chat in a worker thread), check the prompt and the
       │              queued prompt tokens
       │
       ▼ admit(submission, request): the engine hands the request to the scheduler

A submission is pending from `submit` until the task admits or refuses it. Aborting it removes it
from `pending`, and the task then drops it: the task admits only the very submission still
pending under its id. A refusal found by the task ends the submission's stream with the error.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial

import attrs
import trio

from loom.core.errors import EngineOverloadedError
from loom.core.prompt import Prompt, PromptChecker, needs_tokenizer
from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.engine.config import EngineConfig
from loom.engine.request_stream import RequestStream, in_trio
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner


@attrs.frozen(kw_only=True)
class Submission:
    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    arrival_time: float
    deadline: float | None
    stream: RequestStream


class Admission:
    def __init__(self, config: EngineConfig, prompts: PromptChecker, scheduler: Scheduler) -> None:
        self.config = config
        self.prompts = prompts
        self.scheduler = scheduler
        self.send, self.recv = trio.open_memory_channel[Submission](config.max_waiting_requests)
        self.pending: dict[str, Submission] = {}  # submitted, not yet admitted nor refused
        # In the channel or being admitted, aborted ones included: never above the channel's
        # capacity, so that `send_nowait` cannot block.
        self.num_unhandled = 0
        self.done = False  # the channel is closed and every submission in it handled

    @classmethod
    def for_model(
        cls, config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, scheduler: Scheduler
    ) -> Admission:
        prompts = PromptChecker(
            tokenizer=loaded.tokenizer,
            vocab_size=runner.vocab_size,
            # Never more tokens than the whole pool holds (block 0 is the null block).
            max_model_len=min(runner.max_model_len, (runner.num_blocks - 1) * runner.block_size),
            eos_token_ids=loaded.eos_token_ids,
            max_prompt_chars=config.max_prompt_chars,
        )
        return cls(config, prompts, scheduler)

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        *,
        deadline: float | None,
        abort: Callable[[str], None],
        resume: Callable[[str], None],
    ) -> RequestStream:
        """Queue a request under a new id of the engine's making, or refuse it at once. The
        stream's consumer reaches the engine's `abort` and `resume` for this id alone."""
        self.prompts.check_size(prompt)
        num_queued = len(self.scheduler.waiting) + self.num_unhandled
        if num_queued >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"the waiting queue is full: {num_queued} requests "
                f"(max_waiting_requests={self.config.max_waiting_requests})"
            )
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
            stream=stream,
        )
        self.send.send_nowait(submission)
        self.pending[request_id] = submission
        self.num_unhandled += 1
        return stream

    def abort(self, request_id: str) -> bool:
        """Drop a submission not yet admitted. False if none is pending under that id."""
        return self.pending.pop(request_id, None) is not None

    def close(self, error: Exception | None = None) -> None:
        """Take no new submissions. Those sent are still admitted, unless an `error` (the engine
        stopped) ends them now."""
        self.send.close()
        if error is not None:
            for submission in self.pending.values():
                submission.stream.fail(error)
            self.pending.clear()

    async def run(self, admit: Callable[[Submission, Request], None]) -> None:
        """The admission task: until the channel is closed and emptied."""
        async with self.recv:
            async for submission in self.recv:
                try:
                    if self.pending.get(submission.request_id) is submission:
                        await self.admit_one(submission, admit)
                finally:
                    self.num_unhandled -= 1
        self.done = True

    async def admit_one(
        self, submission: Submission, admit: Callable[[Submission, Request], None]
    ) -> None:
        try:
            prompt = submission.prompt
            if needs_tokenizer(prompt):
                token_ids = await trio.to_thread.run_sync(self.prompts.tokenize, prompt)
            else:  # token ids: checked at once, so that a burst is admitted in one go
                token_ids = self.prompts.tokenize(prompt)
            request = self.prompts.request(
                submission.request_id,
                token_ids,
                submission.sampling,
                arrival_time=submission.arrival_time,
                deadline=submission.deadline,
            )
            self.check_backlog(request.num_prompt_tokens)
        except Exception as exc:  # invalid, overloaded, or a tokenizer failure
            if self.pending.pop(submission.request_id, None) is submission:
                submission.stream.fail(exc)
            return
        if self.pending.pop(submission.request_id, None) is submission:  # not aborted meanwhile
            admit(submission, request)

    def check_backlog(self, num_prompt: int) -> None:
        num_queued = self.scheduler.num_waiting_tokens()
        if num_queued + num_prompt > self.config.max_waiting_tokens:
            raise EngineOverloadedError(
                f"the queued prompt tokens would exceed max_waiting_tokens="
                f"{self.config.max_waiting_tokens} ({num_queued} queued, this prompt {num_prompt})"
            )
