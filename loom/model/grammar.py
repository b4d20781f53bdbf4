"""Constraints compiled with llguidance, and the token masks of a step's constrained rows.

    Constraint ── Grammars.compile (a compile thread: loom/engine/compiling.py schedules it,
        │          shares it and keeps it, per tenant, under a time limit)
        │          checked: size, then llguidance's own parse of the schema, regex or grammar,
        │          and its first mask, on a copy
        ▼
    GrammarMatcher on the request (`Grammars.copy` of the compiled template)
        │  ── Grammars.fill (a thread of its own, while the forward pass runs): one bitmask
        │                   row per constrained row
        ▼
    StepMasks (loom/model/masks.py): the few tokens a row allows, or its logits' bias; the
                                      sampler samples among the first, adds the second

llguidance builds its lexer lazily and bounds every step by "fuel" (LLParserLimits): a
grammar too complex for a step puts its matcher in an error state, never a step that hangs;
the request then ends with the error (`Request.stop_status`). Why llguidance:
docs/structured-outputs.md, "Why llguidance", with the figures of
examples/constraint_candidates.py.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.core.errors import InvalidRequestError
from loom.model.deep_threads import deep_stack_threads
from loom.model.grammar_tokenizer import llguidance_tokenizer
from loom.model.masks import StepMasks, masks_of

MAX_ERROR_CHARS = 500  # of llguidance's message, in a refusal
COMPILE_NICE = 19
# The masks' expected CPU time (their rows' token_seconds) from which two threads fill them:
# below it the hand-over costs more than it saves (16 rows of a 2,000-property schema: 0.07
# ms of masks, 0.4 ms more to give half to the other thread).
SPLIT_SECONDS = 0.002
JSON_OPTIONS: Any = {"whitespace_flexible": False}


@attrs.define
class Template:
    """A compiled constraint that each request takes a copy of (`Grammars.copy`), and what a
    copy's first token costs its grammar: its first mask, measured as it compiled, then each
    copy's first token (mask and consume) as it is taken, at their recent peak (a dearer one
    at once, a cheaper one halving the figure at most): the cost the scheduler counts for a
    new copy until it has taken a token of its own."""

    matcher: llguidance.LLMatcher
    token_seconds: float


class GrammarMatcher:
    """One request's llguidance matcher (loom.core.constraint.Matcher). `token_seconds`: the
    CPU time its recent tokens cost the grammar (a token's mask, `fill_rows`, and the consume
    of the token sampled under it) at their peak, what the scheduler's mask budget counts;
    `step_seconds`, the last step's, what the fair share charges (loom/core/mask_budget.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, template: Template) -> None:
        self.matcher = matcher
        self.token_seconds = template.token_seconds
        self.step_seconds = 0.0
        self.template: Template | None = template  # until its first token is taken
        self.opening: int | None = None  # allowed beside the grammar's first tokens

    def consume(self, token_id: int) -> None:
        """Advance by a sampled token (an error state if the grammar refuses it, which `error`
        tells). The token's cost to the grammar is its mask and this consume, in this thread's
        CPU time: a dearer one raises `token_seconds` at once, a cheaper one halves it at most
        (a grammar whose dear states come between cheap ones is counted dear); a copy's first
        token is its template's figure too. The consume holds the GIL, every thread of the
        server waiting: constraint_step_items bounds it."""
        started = time.thread_time()
        self.matcher.consume_token(token_id)
        self.step_seconds += time.thread_time() - started
        self.token_seconds = recent_peak(self.step_seconds, self.token_seconds)
        if self.template is not None:
            self.template.token_seconds = recent_peak(
                self.step_seconds, self.template.token_seconds
            )
            self.template = None

    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str:
        message = self.matcher.get_error()
        return f"the constraint failed: {message[:MAX_ERROR_CHARS]}" if message else ""


Drafted = tuple[GrammarMatcher, tuple[int, ...]]  # a constrained row and its draft tokens


class Grammars:
    """The model's tokenizer as llguidance sees it, and the threads that compile for it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: ConstraintConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.config = config
        self.lock = threading.Lock()  # the tokenizer is made on whichever thread comes first
        self.ll_tokenizer: llguidance.LLTokenizer | None = None
        self.limits = llguidance.LLParserLimits(
            verbose_errors=False, step_max_items=config.constraint_step_items
        )

    # Compiles and masks run on threads of their own, with deep stacks, started on first use
    # (by the trio thread): twice compile_threads compiling (a compile past its time limit is
    # abandoned, and keeps its thread until llguidance's own limits end it: the second half
    # is room for those), two filling a step's masks. The compiles, work a client sets, run at
    # the lowest priority, with the thread that serves both fronts: at the default they took
    # both cores of two from it while they ran, refusals and other requests waiting on it.
    @functools.cached_property
    def compiling(self) -> ThreadPoolExecutor:
        return deep_stack_threads(2 * self.config.compile_threads, "loom-compile", COMPILE_NICE)

    @functools.cached_property
    def masking(self) -> ThreadPoolExecutor:
        return deep_stack_threads(2, "loom-masks")

    def check(self, constraint: Constraint) -> None:
        """Refuse at once what needs no compiling to refuse: no tokenizer, too large."""
        if self.tokenizer is None:
            raise InvalidRequestError("constraints need a tokenizer; this model has none")
        limit = self.config.max_constraint_bytes
        if constraint.size > limit:
            raise InvalidRequestError(
                f"{constraint.kind.value} has {constraint.size} bytes; the limit is "
                f"max_constraint_bytes={limit}"
            )

    def prepare(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, made on first use (half a second for a 49k vocabulary)."""
        with self.lock:
            if self.ll_tokenizer is None:
                n_vocab = max(self.vocab_size, len(self.tokenizer))
                eos = self.eos_token_ids or None
                self.ll_tokenizer = llguidance_tokenizer(self.tokenizer, n_vocab, eos)
            return self.ll_tokenizer

    def compile(self, constraint: Constraint) -> Template:
        """The constraint compiled: a template each request takes a copy of (`copy`), or
        InvalidRequestError naming what is wrong with it. The first mask is computed here
        too, on the template itself, so that each copy starts with the lexer it built (74 ms
        for a schema of 3,000 properties; a copy of a template without it built its own in
        its first step, row by row, every copy of a flood stalling every tenant's tokens).
        A grammar that fails there, or whose lexer takes longer than constraint_mask_timeout
        to build, is refused now, never in a step. A copy's first mask is timed here too:
        Template.token_seconds, which its copies' first tokens then raise or lower."""
        self.check(constraint)
        template = llguidance.LLMatcher(
            self.prepare(), grammar_of(constraint), log_level=0, limits=self.limits
        )
        started = time.monotonic()
        if not template.is_error():
            template.compute_bitmask()  # on the template: every copy starts with its lexer
        took = time.monotonic() - started
        message = template.get_error()[:MAX_ERROR_CHARS]
        if message:
            raise InvalidRequestError(f"{constraint.kind.value} is not valid: {message}")
        if took > self.config.constraint_mask_timeout:  # each copy would take as long
            raise InvalidRequestError(
                f"{constraint.kind.value}'s first token mask took {took:.2f}s; the limit is "
                f"constraint_mask_timeout={self.config.constraint_mask_timeout}s"
            )
        probe = template.deep_copy()
        started = time.thread_time()
        probe.compute_bitmask()
        return Template(template, time.thread_time() - started)

    @staticmethod
    def copy(template: Template) -> GrammarMatcher:
        """A request's own matcher, from a compiled template."""
        return GrammarMatcher(template.matcher.deep_copy(), template)

    def fill(self, rows: Sequence[Drafted]) -> StepMasks:
        """What each matcher allows next (`masks_of`), and, for one with k draft tokens, what
        it allows after each of them: k + 1 rows (`fill_rows`). A matcher in error allows every
        token: its request ends with the error when its next token is applied (an all-zero
        row would leave nothing to sample). From SPLIT_SECONDS of expected work on, the
        second half is filled on the other mask thread at once (llguidance drops the GIL as
        it computes a mask)."""
        words = (self.prepare().vocab_size + 31) // 32
        mask = torch.full((sum(1 + len(d) for _, d in rows), words), -1, dtype=torch.int32)
        work = sum(m.token_seconds * (1 + len(d)) for m, d in rows)
        if len(rows) < 2 or work < SPLIT_SECONDS:
            fill_rows(rows, mask, words)
            return masks_of(mask, self.vocab_size)
        half = len(rows) // 2
        at = sum(1 + len(d) for _, d in rows[:half])
        other = self.masking.submit(fill_rows, rows[half:], mask[at:], words)
        fill_rows(rows[:half], mask[:at], words)
        other.result()
        return masks_of(mask, self.vocab_size)


def recent_peak(seconds: float, figure: float) -> float:
    """A cost figure after a new measure: a dearer one at once, a cheaper one halving it."""
    return max(seconds, figure / 2)


def fill_rows(rows: Sequence[Drafted], mask: torch.Tensor, words: int) -> None:
    """Each matcher's masks, timed in this thread's CPU time (a wall clock would also count the
    forward pass's threads that share the cores: a tenant pays for its own work only), the
    first part of its step's cost (GrammarMatcher.consume adds the second). With draft tokens:
    the drafts its grammar takes (validated first: a refused token would leave the matcher in
    error for good) are taken one by one, a mask after each, then rolled back; the rows after
    a refused draft stay all ones (the row before it refuses that draft, so none is kept)."""
    at = 0
    for m, drafts in rows:  # one by one: llguidance's executor spins threads
        m.step_seconds = 0.0
        if not m.matcher.is_error():  # an error leaves the rows all ones
            started = time.thread_time()
            m.matcher.unsafe_compute_mask_ptr(mask[at].data_ptr(), words * 4)
            if m.opening is not None:  # qwen3's <think>: the answer may open its thinking
                allow(mask[at], m.opening)
            taken = drafts[: m.matcher.validate_tokens(list(drafts))] if drafts else ()
            for i, token in enumerate(taken, start=1):
                m.matcher.consume_token(token)
                m.matcher.unsafe_compute_mask_ptr(mask[at + i].data_ptr(), words * 4)
            if taken:
                m.matcher.rollback(len(taken))
            m.step_seconds = time.thread_time() - started
        if m.matcher.is_error():
            mask[at : at + 1 + len(drafts)] = -1
            m.token_seconds = 0.0  # no mask is computed for it again
        at += 1 + len(drafts)


def allow(row: torch.Tensor, token_id: int) -> None:
    """Set a token's bit in a mask row of int32 words."""
    word, bit = divmod(token_id, 32)
    value = int(row[word]) | 1 << bit
    row[word] = value - (1 << 32) if value >= 1 << 31 else value


def lark_of(spec: str) -> str:
    """A grammar in Lark (llguidance's dialect, with a `start` rule), or in GBNF (llama.cpp's,
    vLLM's EBNF: `root ::= ...`), as Lark."""
    try:
        return any_to_lark(spec)
    except Exception as exc:  # the converter's own errors, of several kinds
        raise InvalidRequestError(f"grammar is not Lark or GBNF: {exc}"[:MAX_ERROR_CHARS]) from None


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint."""
    kind, spec = constraint.kind, constraint.spec
    if kind is ConstraintKind.CHOICE:
        # Lark string literals, JSON-escaped: a choice is matched as it is written.
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(lark_of(spec))
    schema = '{"type": "object"}' if kind is ConstraintKind.JSON_OBJECT else spec
    try:
        # Compact JSON (", " and ": " between items): free whitespace lets a model pad forever.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:  # not JSON, or not an object
        raise InvalidRequestError(f"json_schema is not a JSON object: {exc}") from None
