"""Overlapped scheduling, the scheduler's side: which requests may be scheduled one step ahead.

`Scheduler.schedule` counts a step's tokens as computed at once, and each token it samples as
a placeholder in `Request.num_tokens` (vLLM v1's way), so that the next step can be scheduled
before this one's result is applied (the loop: loom/engine/engine_core.py). A request whose
step is in flight decodes its placeholder next (the runner puts the sampled token in its place,
`ScheduledSequence.pending_token`, loom/model/launched.py), unless it `waits_for_flight`. A
request in flight is never preempted (its blocks are being written): where the policy picks it
as a victim, it is left out of the step, with the request that needed its blocks, and is
preempted in the next (it is no longer in flight then). `Scheduler.update` replaces
the placeholders with the tokens, rolls back rejected drafts, and drops the tokens of a request
that ended meanwhile: a request that finished at step N computes one token in step N + 1 that
is never emitted. Worked example, a decode of request R with P prompt and O output tokens:

    schedule N      R computes its last token (position P+O-1), samples a placeholder:
                    num_computed P+O, num_tokens P+O+1
    schedule N + 1  R computes the placeholder (position P+O), samples another:
                    num_computed P+O+1, num_tokens P+O+2
    update N        the first placeholder becomes R's token O+1; num_tokens stays P+O+2
    update N + 1    the second becomes token O+2: num_computed P+O+1, num_tokens P+O+2
"""

from __future__ import annotations

from collections.abc import Mapping

from loom.core.config import SchedulerConfig
from loom.core.request import Request
from loom.core.step import SchedulerOutput


def runs_ahead(request: Request) -> bool:
    """Whether its next step may be scheduled before the token its last step samples is
    known: nothing of that step needs the token's value (its position is enough). Not a
    grammar's (its next mask follows the token), penalties' (they count it) or an embedding's
    (its pooled rows are counted as the step is applied)."""
    plain = request.matcher is None and request.held is None and request.sampling.pooling is None
    return plain and not request.sampling.has_penalties


def in_flight(request: Request) -> bool:
    """Whether it is in a step scheduled and not yet applied."""
    return request.num_steps_in_flight > 0


def waits_for_flight(request: Request) -> bool:
    """Whether, with a token in flight, it waits for that step's result before its next: it
    does not run ahead, or that step samples its last token (max_tokens), or fills its
    consumer's buffer (which pauses it: a full buffer never takes more)."""
    if not request.num_output_placeholders:
        return False  # (a prompt chunk in flight: the next chunk's tokens are known)
    num_output = len(request.output_token_ids) + request.num_output_placeholders
    fills = request.output_room is not None and request.output_room <= 1
    return num_output >= request.max_tokens or fills or not runs_ahead(request)


def step_runs_ahead(
    config: SchedulerConfig, requests: Mapping[str, Request], output: SchedulerOutput
) -> bool:
    """Whether the step after `output` may be scheduled before its result is applied: with
    async scheduling on, no drafts (each step's drafts follow the tokens before it), no
    constrained row (its masks may still be filling: one fill at a time, for a fill waits on
    its other half in the same two threads, loom/model/grammar.py), and every request of it
    still unfinished (in `requests`) `runs_ahead`."""
    if not config.async_scheduling or config.speculative.speculative_method is not None:
        return False
    if any(seq.sampling is not None and seq.sampling.constrained for seq in output.sequences):
        return False
    found = (requests.get(seq.request_id) for seq in output.sequences)
    return all(runs_ahead(r) for r in found if r is not None)
