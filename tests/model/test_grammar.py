"""Compiling constraints (loom/model/grammar.py): templates and their copies, the masks of a
step, and hostile grammars that once killed the process (the cache and the queue:
tests/engine/test_compiling.py).

Rules: SmolLM2's real tokenizer; a grammar that may crash runs in a process of its own.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.core.errors import InvalidRequestError
from loom.model.grammar import GrammarMatcher, Grammars
from loom.model.masks import apply_masks
from tests.support.compile_timing import LARGE, LLGUIDANCE_STEP_ITEMS, schema


def regex(spec: str) -> Constraint:
    return Constraint(kind=ConstraintKind.REGEX, spec=spec)


def test_grammar_copies_of_a_compiled_template_each_hold_their_own_state(
    smollm2_tokenizer: Any,
) -> None:
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig())
    template = grammars.compile(regex("[0-9]+"))
    first, second = grammars.copy(template), grammars.copy(template)
    assert first.matcher is not second.matcher  # each request its own state
    first.consume(smollm2_tokenizer.encode("7")[0])
    assert first.matcher.get_error() == ""
    assert len(grammars.fill([(first, ()), (second, ())]).allowed) == 2


def test_grammar_masks_a_row_after_each_draft_the_grammar_takes_and_rolls_back(
    smollm2_tokenizer: Any,
) -> None:
    """Speculative decoding: a matcher with k drafts fills k + 1 rows, each what the grammar
    allows after the drafts before it; from a draft it refuses on, all ones (the row before
    refuses it, so nothing after it is kept); its state is as it was."""
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig())
    matcher = grammars.copy(grammars.compile(regex("ab(c|d)[0-9]{3}")))
    a, b, c = (smollm2_tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    x = smollm2_tokenizer.encode("x", add_special_tokens=False)[0]
    masks = grammars.fill([(matcher, (a, b, x, c))])
    rows = masks.allowed
    assert len(rows) == 5
    assert rows[0] is not None
    assert a in rows[0].tolist()
    assert rows[1] is not None
    assert b in rows[1].tolist()
    assert rows[2] is not None
    assert c in rows[2].tolist()
    assert x not in rows[2].tolist()
    assert rows[3] is None
    assert rows[4] is None
    assert bool(torch.isfinite(masks.bias).all())
    assert matcher.matcher.validate_tokens([a, b, c]) == 3  # rolled back to its start
    assert matcher.error() == ""


def test_grammar_an_added_token_that_is_text_is_matched_as_its_text(
    smollm2_tokenizer: Any,
) -> None:
    """Qwen3's `<think>` is an added token, not a special one: a constraint that spells it
    allows it where its text fits and takes it as that text; special tokens (EOS, an added
    special token before it) stay special, never renumbered."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})  # first: Qwen3's
    tokenizer.add_tokens(["<think>", "</think>"])  # layout, specials before the text ones
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    grammars = Grammars(tokenizer, len(tokenizer), [2], ConstraintConfig())
    matcher = grammars.copy(grammars.compile(regex("(<think>[a-z]+</think>)?Paris")))
    [first] = grammars.fill([(matcher, ())]).allowed
    assert first is not None
    assert think in first.tolist()
    assert 2 not in first.tolist()
    assert tokenizer.convert_tokens_to_ids("<|tool|>") not in first.tolist()
    for token in [think, *tokenizer.encode("abc", add_special_tokens=False), end_think]:
        matcher.consume(token)
        assert matcher.error() == ""
    matcher.consume(tokenizer.encode("Paris", add_special_tokens=False)[0])
    assert matcher.error() == ""


def test_grammar_masks_allow_what_the_grammar_allows(smollm2_tokenizer: Any) -> None:
    """Two digits, two letters: few tokens each, given by their ids; anything but a newline
    allows nearly all, given as the logits' bias, which cuts its row and no other."""
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig())
    digits = grammars.copy(grammars.compile(regex("[0-9]{2}")))
    letters = grammars.copy(grammars.compile(regex("[a-z]{2}")))
    lines = grammars.copy(grammars.compile(regex("[^\\n]{1,100}")))
    masks = grammars.fill([(digits, ()), (letters, ()), (lines, ())])
    decode = smollm2_tokenizer.decode
    assert masks.allowed[0] is not None
    assert masks.allowed[1] is not None
    assert all(decode([t]).isdigit() for t in masks.allowed[0].tolist())
    assert all(decode([t]).isalpha() for t in masks.allowed[1].tolist())
    assert masks.allowed[2] is None
    logits = apply_masks(torch.zeros(2, 49152), [1], masks.bias)
    allowed = [torch.isfinite(row).nonzero()[:, 0].tolist() for row in logits]
    assert len(allowed[0]) == 49152  # the free row beside it is untouched
    assert 45000 < len(allowed[1]) < 49152
    assert not any("\n" in decode([t]) for t in allowed[1])


def consume_timed(matcher: GrammarMatcher, token_id: int) -> tuple[float, float]:
    """`matcher.consume(token_id)`: how long it took, and the worst gap meanwhile of a thread
    that ticks every half millisecond."""
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.monotonic()
    matcher.consume(token_id)
    ended = time.monotonic()
    done.set()
    ticker.join()
    during = [t for t in ticks if started <= t <= ended]
    return ended - started, max(b - a for a, b in itertools.pairwise([started, *during, ended]))


def test_grammar_the_items_one_token_may_build_are_bounded(smollm2_tokenizer: Any) -> None:
    """The "{" that opens an object of 3,000 untyped properties builds an Earley row of
    12,007 items before llguidance's limit of 2,000 a row ends the request: 36 ms, work a
    client sets, with the GIL held (every thread stopped: one that ticks every half
    millisecond had its worst gap as long as the consume), growing as the square of the
    items. Under constraint_step_items (4,000) such a schema is refused as it compiles, and
    the largest of its kind that compiles (990 properties, 3,967 items: a third of the rows,
    about a ninth of the work) costs its "{" a small part of that. The consume's CPU time
    counts as the token's cost (its mask's is added by `fill`)."""
    brace = smollm2_tokenizer.encode("{")[0]
    free = ConstraintConfig(max_constraint_bytes=LARGE, constraint_step_items=LLGUIDANCE_STEP_ITEMS)
    unbounded = Grammars(smollm2_tokenizer, 49152, [2], free)
    control = unbounded.copy(unbounded.compile(schema("p", 3000)))
    took, worst = consume_timed(control, brace)
    assert "Current row has 12007 items" in control.error()
    assert worst > took / 2  # the GIL held throughout
    assert control.step_seconds > took / 2  # counted, in this thread's CPU time
    bounded = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig(max_constraint_bytes=LARGE))
    with pytest.raises(InvalidRequestError, match=r"Too many items \(limit 4000"):
        bounded.compile(schema("p", 3000))
    largest = bounded.copy(bounded.compile(schema("p", 990)))
    bounded_took, _ = consume_timed(largest, brace)
    assert "Current row has 3967 items" in largest.error()
    # The times are printed, not asserted (one consume each, a few ms: a machine's noise
    # decided it: 7.5 ms against 19.2 once in CI); the rows' sizes above are what bounds them.
    print(f"the consume: {took * 1e3:.1f} ms unbounded (the ticker's worst gap "
          f"{worst * 1e3:.1f} ms), {bounded_took * 1e3:.1f} ms at the bound")  # fmt: skip


def test_grammar_a_template_learns_what_its_copies_first_tokens_cost(
    smollm2_tokenizer: Any,
) -> None:
    """A new copy is counted (Template.token_seconds, what the mask budget takes for a new
    request) at its template's figure: the first mask as it compiled, then each copy's first
    token as it is taken, a dearer one at once, a cheaper one halving the figure at most. The
    "{" of 990 untyped properties (3,967 Earley items) makes the template dear for the next
    copy; a cheap first token after it only halves it."""
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig(max_constraint_bytes=LARGE))
    template = grammars.compile(schema("p", 990))
    compiled = template.token_seconds
    first = grammars.copy(template)
    took, _ = consume_timed(first, smollm2_tokenizer.encode("{")[0])
    dear = template.token_seconds
    print(f"a copy's first token: {compiled * 1e3:.3f} ms as compiled, {dear * 1e3:.2f} ms "
          f"after a brace ({took * 1e3:.2f} ms)")  # fmt: skip
    assert dear == first.step_seconds
    assert dear > took / 2
    assert dear > 10 * compiled
    second = grammars.copy(template)
    assert second.token_seconds == dear
    second.consume(smollm2_tokenizer.encode('"')[0])
    assert template.token_seconds == dear / 2
    second.consume(smollm2_tokenizer.encode("a")[0])  # its second token: its own figure only
    assert template.token_seconds == dear / 2


DEEP_CHAIN = """
import sys, threading
from transformers import AutoTokenizer
from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.model.grammar import Grammars, grammar_of
from loom.model.loader import converted_gguf_folder, default_model_path, model_cache_root
import llguidance

tokenizer = AutoTokenizer.from_pretrained(str(converted_gguf_folder(default_model_path(),
    model_cache_root())))
# A chain of Lark rules, each naming the next, as many as fit in max_constraint_bytes.
rules, size = ["start: r0"], 9
while size < 65000:
    rules.append(f'r{len(rules) - 1}: "x" r{len(rules)}?')
    size += len(rules[-1]) + 1
rules.append(f'r{len(rules) - 1}: "y"')
deep = Constraint(kind=ConstraintKind.GRAMMAR, spec="\\n".join(rules) + "\\n")
grammars = Grammars(tokenizer, 49152, [2], ConstraintConfig())
tokens = grammars.prepare()
if sys.argv[1] == "loom":
    template = grammars.compiling.submit(grammars.compile, deep).result()
    print("compiled", deep.size, "bytes, error:", repr(template.matcher.get_error()))
else:  # a thread with the usual stack, as the compile ran before
    thread = threading.Thread(target=llguidance.LLMatcher, args=(tokens, grammar_of(deep)))
    thread.start()
    thread.join()
"""


def test_grammar_a_deep_chain_at_the_size_limit_compiles_on_the_deep_stack() -> None:
    """A Lark grammar of some 3,700 chained rules within max_constraint_bytes: on a usual
    8 MiB thread stack llguidance overflows it (the process dies of SIGSEGV); on the compile
    threads' deep stack it compiles, and the process lives."""
    script = textwrap.dedent(DEEP_CHAIN)
    ours = subprocess.run([sys.executable, "-c", script, "loom"], capture_output=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert b"compiled" in ours.stdout
    assert b"error: ''" in ours.stdout
    usual = subprocess.run(
        [sys.executable, "-c", script, "usual"], capture_output=True, timeout=300
    )
    assert usual.returncode == -11  # SIGSEGV: what a client's grammar did to the server


def test_grammar_a_gbnf_grammar_is_taken_as_its_lark_and_a_broken_one_refused(
    smollm2_tokenizer: Any,
) -> None:
    """vLLM's `grammar` (xgrammar's EBNF) and llama.cpp's are GBNF: `root ::= ...`."""
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig())
    gbnf = Constraint(kind=ConstraintKind.GRAMMAR, spec='root ::= "yes" | "no"')
    matcher = grammars.copy(grammars.compile(gbnf))
    (allowed,) = grammars.fill([(matcher, ())]).allowed
    assert allowed is not None
    assert {smollm2_tokenizer.decode([t]) for t in allowed.tolist()} <= {
        "y",
        "ye",
        "yes",
        "n",
        "no",
    }
    broken = Constraint(kind=ConstraintKind.GRAMMAR, spec="root ::= (((")
    with pytest.raises(InvalidRequestError, match="grammar is not Lark or GBNF"):
        grammars.compile(broken)
