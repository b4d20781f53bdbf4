"""Compiling constraints (loom/model/grammar.py): templates and their copies, the masks of a
step, and hostile grammars that once killed the process (the cache and the queue:
tests/engine/test_compiling.py).

Rules: SmolLM2's real tokenizer; a grammar that may crash runs in a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import torch

from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.model.grammar import Grammars, apply_masks


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
    assert grammars.fill([first, second]).shape == (2, 49152)


def test_grammar_masks_allow_what_the_grammar_allows(smollm2_tokenizer: Any) -> None:
    grammars = Grammars(smollm2_tokenizer, 49152, [2], ConstraintConfig())
    digits = grammars.copy(grammars.compile(regex("[0-9]{2}")))
    letters = grammars.copy(grammars.compile(regex("[a-z]{2}")))
    bias = grammars.fill([digits, letters])
    logits = apply_masks(torch.zeros(3, 49152), [0, 2], bias)
    allowed = [torch.isfinite(row).nonzero()[:, 0].tolist() for row in logits]
    decode = smollm2_tokenizer.decode
    assert allowed[0]
    assert all(decode([t]).isdigit() for t in allowed[0])
    assert len(allowed[1]) == 49152  # the free row between them is untouched
    assert allowed[2]
    assert all(decode([t]).isalpha() for t in allowed[2])


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
