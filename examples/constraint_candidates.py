"""Measure the structured-output libraries Loom could use, on SmolLM2's tokenizer (49,152 ids).

    python examples/constraint_candidates.py            # the ones installed
    pip install --no-deps --target /tmp/cand xgrammar outlines-core apache-tvm-ffi
    PYTHONPATH=/tmp/cand python examples/constraint_candidates.py

For each library it prints the cold compile time of a realistic JSON schema (nested objects,
an array, enums, an integer range, optional fields, no additional properties), the same
schema again (its own cache, where it has one), and the time to compute the token masks of one
decode step for 1, 8 and 64 sequences, each walking a valid document of its own token by token
(so that no two rows share a parser state, as in a real batch). The figures are the "Why
llguidance" table of docs/structured-outputs.md (BENCHMARKS.md, run N); the first line is
Loom's own path (the masks made into the logits' bias on the mask thread, then added in the
sampler). Nothing else may run beside it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from loom.model.loader import converted_gguf_folder, default_model_path, model_cache_root

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "tags": ["math", "engines"],
    "active": True,
}
ROWS = (1, 8, 64)


def documents(tokenizer: Any, n: int) -> list[list[int]]:
    """n valid documents, each its own, as tokens, cut to the shortest."""
    rows = [
        tokenizer.encode(
            json.dumps(
                {**DOCUMENT, "name": f"Person {i}", "age": i % 150, "tags": ["t"] * (i % 8)}
            ),
            add_special_tokens=False,
        )
        for i in range(n)
    ]
    length = min(map(len, rows))
    return [r[:length] for r in rows]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1000, value


def llguidance_figures(tokenizer: Any) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    cold, _ = timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
    warm, _ = timed(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
    executor = llguidance.LLExecutor()
    figures = {"compile cold": cold, "compile again": warm}
    for n in ROWS:
        matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(n)]
        mask = llguidance.torch.allocate_token_bitmask(n, ll_tokenizer.vocab_size)
        steps = []
        for tokens in zip(*documents(tokenizer, n), strict=True):
            pairs = [(m, i) for i, m in enumerate(matchers)]
            ms, _ = timed(
                lambda p=pairs, m=mask: llguidance.torch.fill_next_token_bitmask_par(executor, p, m)
            )
            steps.append(ms)
            for m, token in zip(matchers, tokens, strict=True):
                assert m.consume_token(token), m.get_error()
        figures[f"mask x{n}"] = statistics.median(steps)
    return figures


def xgrammar_figures(tokenizer: Any) -> dict[str, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    schema = json.dumps(SCHEMA)
    cold, _ = timed(lambda: xgrammar.GrammarCompiler(info).compile_json_schema(schema))
    compiler = xgrammar.GrammarCompiler(info)
    compiled = compiler.compile_json_schema(schema)
    warm, _ = timed(lambda: compiler.compile_json_schema(schema))
    figures = {"compile cold": cold, "compile again": warm}
    batch = xgrammar.BatchGrammarMatcher()
    for n in ROWS:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(n)]
        mask = xgrammar.allocate_token_bitmask(n, info.vocab_size)
        steps = []
        for tokens in zip(*documents(tokenizer, n), strict=True):
            ms, _ = timed(lambda ms=matchers, m=mask: batch.batch_fill_next_token_bitmask(ms, m))
            steps.append(ms)
            for m, token in zip(matchers, tokens, strict=True):
                assert m.accept_token(token)
        figures[f"mask x{n}"] = statistics.median(steps)
    return figures


def outlines_figures(tokenizer: Any) -> dict[str, float]:
    import outlines_core

    eos = tokenizer.eos_token_id
    vocab: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos:
            vocab.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    cold, index = timed(lambda: outlines_core.Index(regex, vocabulary))
    figures = {"compile cold": cold, "compile again": cold}  # no cache of its own
    words = (len(tokenizer) + 31) // 32
    for n in ROWS:
        guides = [outlines_core.Guide(index) for _ in range(n)]
        mask = torch.zeros(n, words, dtype=torch.int32)
        steps = []
        for tokens in zip(*documents(tokenizer, n), strict=True):

            def fill(guides: list[Any] = guides, mask: torch.Tensor = mask) -> None:
                for i, g in enumerate(guides):
                    g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())

            ms, _ = timed(fill)
            steps.append(ms)
            for g, token in zip(guides, tokens, strict=True):
                g.advance(token)
        figures[f"mask x{n}"] = statistics.median(steps)
    return figures


def loom_figures(tokenizer: Any) -> dict[str, float]:
    """Loom's own path on llguidance: Grammars.fill (the masks and the bias made from them, on
    the mask thread) and apply_masks (the sampler's add), per decode step."""
    from loom.core.config import ConstraintConfig
    from loom.core.constraint import Constraint, ConstraintKind
    from loom.model.grammar import Grammars, apply_masks

    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], ConstraintConfig())
    grammars.prepare()
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMA))
    cold, _ = timed(lambda: grammars.compile(constraint))
    cached, _ = timed(lambda: grammars.compile(constraint))
    figures = {"compile cold": cold, "compile again": cached}
    for n in ROWS:
        matchers = [grammars.compile(constraint) for _ in range(n)]
        logits = torch.randn(n, len(tokenizer))
        fills, applies = [], []
        for tokens in zip(*documents(tokenizer, n), strict=True):
            ms, bias = timed(lambda ms=matchers: grammars.fill(ms))
            fills.append(ms)
            ms, _ = timed(lambda b=bias, n=n, x=logits: apply_masks(x, range(n), b))
            applies.append(ms)
            for m, token in zip(matchers, tokens, strict=True):
                m.consume(token)
        figures[f"fill x{n}"] = statistics.median(fills)
        figures[f"apply x{n}"] = statistics.median(applies)
    return figures


CANDIDATES = {
    "loom (llguidance, fill + apply)": loom_figures,
    "llguidance": llguidance_figures,
    "xgrammar": xgrammar_figures,
    "outlines-core": outlines_figures,
}


def main() -> None:
    folder = converted_gguf_folder(default_model_path(), model_cache_root())
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; documents of {len(documents(tokenizer, 64)[0])} tokens"
    )
    for name, figures in CANDIDATES.items():
        try:
            found = figures(tokenizer)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        except Exception as exc:  # a library that cannot do it is a finding
            print(f"{name}: failed: {type(exc).__name__}: {exc}")
            continue
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in found.items()))


if __name__ == "__main__":
    main()
