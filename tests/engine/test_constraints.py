"""Structured outputs in the engine: constrained requests batched with free ones, on a tiny
random Llama with SmolLM2's tokenizer (its random choices stress the grammar far more than a
trained model: every token it picks is one the mask let through).

Rules: every output that ends `stop` must parse and validate; free requests in the same batch
stay token-identical to transformers' greedy `generate`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import trio

from loom.core.config import CacheConfig, ConstraintConfig, SchedulerConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.core.errors import InvalidRequestError
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.model.loader import LoadedModel
from tests.conftest import tiny_model
from tests.engine.test_engine import assert_idle, collect, serving, tokens_of
from tests.support.greedy import reference_tokens

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, an enum, an integer range, required and optional, no extra properties
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # a negative range and a nullable field (no "number": its digits never end)
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -50, "maximum": -10},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
        },
        "required": ["score", "note"],
        "additionalProperties": False,
    },
    {  # an enum of mixed types
        "enum": ["red", 7, True, None],
    },
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"]
# Bounded repetition (Lark's `~`): a random model left free to add terms never stops.
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any) -> LoadedModel:
    return tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)


def schema(index: int) -> Constraint:
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps(SCHEMAS[index]))


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def ended(outputs: list[RequestOutput]) -> FinishReason | None:
    return outputs[-1].finish_reason


def sampling(constraint: Constraint | None, i: int, max_tokens: int = 120) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd."""
    temperature = 0.0 if i % 2 == 0 else 1.0
    return SamplingParams(
        temperature=temperature, seed=i, max_tokens=max_tokens, constraint=constraint
    )


async def mixed_batch(
    engine: Any, prompts: list[list[int]], free_tokens: int
) -> tuple[list[list[RequestOutput]], list[list[RequestOutput]]]:
    """16 constrained requests (the schemas in turn) and 16 free greedy ones, all at once."""
    constrained: list[list[RequestOutput]] = [[] for _ in range(16)]
    free: list[list[RequestOutput]] = [[] for _ in range(16)]

    async def one(into: list[RequestOutput], prompt: list[int], params: SamplingParams) -> None:
        into += await collect(engine, prompt, params)

    free_params = SamplingParams(temperature=0, max_tokens=free_tokens)
    async with trio.open_nursery() as nursery:
        for i in range(16):
            params = sampling(schema(i % len(SCHEMAS)), i)
            nursery.start_soon(one, constrained[i], prompts[i], params)
            nursery.start_soon(one, free[i], prompts[16 + i], free_params)
    return constrained, free


def check_valid(outputs: list[list[RequestOutput]]) -> None:
    for i, out in enumerate(outputs):
        assert ended(out) is FinishReason.STOP, (i, ended(out), text_of(out))
        jsonschema.validate(json.loads(text_of(out)), SCHEMAS[i % len(SCHEMAS)])


async def test_constraints_json_schemas_validate_beside_free_requests_that_stay_exact(
    model: LoadedModel, random_prompt: Any
) -> None:
    """16 schema-constrained requests (greedy and sampled) in one batch with 16 free ones: every
    constrained output parses and validates, and the free ones equal transformers' tokens."""
    prompts = [random_prompt(12 + i, 49152) for i in range(32)]
    with trio.fail_after(300):
        async with serving(model, scheduler=SchedulerConfig(max_num_seqs=32)) as engine:
            constrained, free = await mixed_batch(engine, prompts, free_tokens=12)
            assert_idle(engine)
    check_valid(constrained)
    for i, out in enumerate(free):
        assert tokens_of(out) == reference_tokens(model.model, prompts[16 + i], 12), i


@pytest.mark.smollm2
async def test_constraints_smollm2_schemas_validate_beside_free_requests_that_stay_exact(
    smollm2: LoadedModel, random_prompt: Any
) -> None:
    """The same mixed batch on the real model: every constrained output validates, and the
    free ones equal transformers' greedy tokens; then the regexes, greedy and sampled."""
    prompts = [random_prompt(12 + i, 49152) for i in range(32)]
    with trio.fail_after(600):
        async with serving(smollm2, scheduler=SchedulerConfig(max_num_seqs=32)) as engine:
            constrained, free = await mixed_batch(engine, prompts, free_tokens=8)
            for r in REGEXES:
                for i in range(2):
                    params = sampling(Constraint(kind=ConstraintKind.REGEX, spec=r), i, 60)
                    out = await collect(engine, "Write it:", params)
                    assert ended(out) is FinishReason.STOP, (r, text_of(out))
                    assert re.fullmatch(r, text_of(out)), (r, text_of(out))
            assert_idle(engine)
    check_valid(constrained)
    for i, out in enumerate(free):
        assert tokens_of(out) == reference_tokens(smollm2.model, prompts[16 + i], 8), i


async def test_constraints_hold_through_preemption_and_prefix_cache_hits(
    model: LoadedModel, random_prompt: Any
) -> None:
    """A KV pool too small for the batch preempts requests mid-output (recompute replays their
    tokens; the matcher keeps its place), and a second round finds the prompts cached."""
    prompts = [random_prompt(32, 49152) for _ in range(32)]
    cache = CacheConfig(num_blocks=48, block_size=16)
    with trio.fail_after(600):
        async with serving(
            model, cache=cache, scheduler=SchedulerConfig(max_num_seqs=32)
        ) as engine:
            first, free = await mixed_batch(engine, prompts, free_tokens=40)
            preempted = engine.stats().num_preemptions
            again, _ = await mixed_batch(engine, prompts, free_tokens=40)
            cached = engine.stats().prefix_cache_hits
    assert preempted > 0
    assert cached > 0
    check_valid(first)
    check_valid(again)
    for i, out in enumerate(free):
        assert tokens_of(out) == reference_tokens(model.model, prompts[16 + i], 40), i


async def test_constraints_regex_choice_and_an_arithmetic_grammar(
    model: LoadedModel, random_prompt: Any
) -> None:
    cases: list[tuple[Constraint, Any]] = [
        (Constraint(kind=ConstraintKind.REGEX, spec=r), lambda t, r=r: re.fullmatch(r, t))
        for r in REGEXES
    ]
    labels = ("positive", "negative", "neutral", "mixed feelings")
    cases.append((Constraint(kind=ConstraintKind.CHOICE, choices=labels), labels.__contains__))
    cases.append((Constraint(kind=ConstraintKind.GRAMMAR, spec=ARITHMETIC), is_arithmetic))
    with trio.fail_after(300):
        async with serving(model) as engine:
            for constraint, valid in cases:
                for i in range(6):
                    params = sampling(constraint, i, max_tokens=400)
                    out = await collect(engine, random_prompt(10, 49152), params)
                    text = text_of(out)
                    assert ended(out) is FinishReason.STOP, (constraint, text)
                    assert valid(text), (constraint, text)


def is_arithmetic(text: str) -> bool:
    """Whether `text` is a sentence of ARITHMETIC (a recursive-descent recogniser of it)."""
    tokens = re.findall(r"[0-9]+|[-+*/()]|.", text)
    at = 0

    def take(allowed: str) -> bool:
        nonlocal at
        if at < len(tokens) and tokens[at] in allowed:
            at += 1
            return True
        return False

    def repeated(item: Any, operators: str, most: int) -> bool:
        if not item():
            return False
        count = 0
        while take(operators):
            count += 1
            if count > most or not item():
                return False
        return True

    def factor() -> bool:
        nonlocal at
        if at < len(tokens) and re.fullmatch("[0-9]{1,3}", tokens[at]):
            at += 1
            return True
        return take("(") and expr() and take(")")

    def term() -> bool:
        return repeated(factor, "*/", 2)

    def expr() -> bool:
        return repeated(term, "+-", 3)

    return expr() and at == len(tokens)


async def test_constraints_cut_by_max_tokens_end_with_length(model: LoadedModel) -> None:
    """A constrained output that max_tokens cuts short ends `length`: the client can tell."""
    regex = Constraint(kind=ConstraintKind.REGEX, spec="[a-z]{50}")
    with trio.fail_after(60):
        async with serving(model) as engine:
            out = await collect(engine, [1, 2, 3], sampling(regex, 0, max_tokens=4))
    assert ended(out) is FinishReason.LENGTH
    assert re.fullmatch("[a-z]+", text_of(out))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(kind=ConstraintKind.JSON_SCHEMA, spec='{"type": "nope"}'), "nope"),
        (Constraint(kind=ConstraintKind.JSON_SCHEMA, spec="[1, 2"), "json_schema"),
        (Constraint(kind=ConstraintKind.REGEX, spec="a(b"), "unclosed group"),
        (Constraint(kind=ConstraintKind.GRAMMAR, spec="start: x\n"), 'unknown name: "x"'),
        (Constraint(kind=ConstraintKind.REGEX, spec="a" * 70000), "max_constraint_bytes=65536"),
    ],
)
async def test_constraints_invalid_or_too_large_are_refused_naming_why(
    model: LoadedModel, constraint: Constraint, message: str
) -> None:
    with trio.fail_after(60):
        async with serving(model) as engine:
            with pytest.raises(InvalidRequestError, match=re.escape(message)):
                await collect(engine, [1, 2, 3], sampling(constraint, 0))
            assert_idle(engine)


async def test_constraints_a_slow_compile_is_refused_while_others_are_served(
    model: LoadedModel,
) -> None:
    """A schema that takes longer than the compile limit is refused; a free request submitted
    meanwhile is served at once, and the same schema under a generous limit compiles."""
    props = {f"p{i}": {"type": "integer"} for i in range(1500)}
    slow = Constraint(
        kind=ConstraintKind.JSON_SCHEMA,
        spec=json.dumps({"type": "object", "properties": props, "required": sorted(props)}),
    )
    tight = ConstraintConfig(constraint_compile_timeout=0.005, max_constraint_bytes=1 << 20)
    with trio.fail_after(120):
        async with serving(model, constraints=tight) as engine:
            async with trio.open_nursery() as nursery:
                refused: list[str] = []

                async def refuse() -> None:
                    with pytest.raises(InvalidRequestError) as info:
                        await collect(engine, [1, 2, 3], sampling(slow, 0))
                    refused.append(str(info.value))

                nursery.start_soon(refuse)
                free = await collect(engine, [4, 5, 6], SamplingParams(temperature=0, max_tokens=3))
            assert refused == [
                "json_schema did not compile within constraint_compile_timeout=0.005s"
            ]
            assert len(tokens_of(free)) == 3
            # The abandoned compile runs to its end, is not cached, and is remembered: asked
            # again, the schema is refused at once.
            compiler = engine.core.admission.compiler  # type: ignore[union-attr]
            while compiler.running:  # noqa: ASYNC110 (it holds its thread to its end)
                await trio.sleep(0.01)
            assert list(compiler.too_slow) == [("", "", slow)]
            assert not compiler.cache
            with pytest.raises(InvalidRequestError, match="did not compile within"):
                await collect(engine, [1, 2, 3], sampling(slow, 0))


async def test_constraints_a_request_abandoned_while_it_compiles_is_never_admitted(
    model: LoadedModel,
) -> None:
    """The client leaves while its schema compiles: the request is dropped when the compile
    returns (never scheduled, no block taken), and the compile is no longer counted."""
    props = {f"w{i}": {"type": "integer"} for i in range(1500)}
    slow = Constraint(
        kind=ConstraintKind.JSON_SCHEMA,
        spec=json.dumps({"type": "object", "properties": props, "required": sorted(props)}),
    )
    roomy = ConstraintConfig(
        constraint_compile_timeout=60, constraint_mask_timeout=60, max_constraint_bytes=1 << 20
    )
    with trio.fail_after(120):
        async with serving(model, constraints=roomy) as engine:
            compiler = engine.core.admission.compiler  # type: ignore[union-attr]
            async with engine.generate([1, 2, 3], sampling(slow, 0)):
                while not compiler.running:  # noqa: ASYNC110 (the compile has begun)
                    await trio.sleep(0.001)
            # gone while it compiles: the compile runs on, and is kept for the next request
            while compiler.running or not compiler.cache:  # noqa: ASYNC110
                await trio.sleep(0.01)
            stats = engine.stats()
            assert stats.num_running + stats.num_waiting == 0
            assert_idle(engine)
            assert engine.core.scheduler.num_generated_tokens == 0  # type: ignore[union-attr]


def test_constraints_are_refused_with_what_would_end_an_output_elsewhere() -> None:
    """ignore_eos, min_tokens, stop strings and stop token ids would end (or not end) an
    output where its grammar does not: output that ends `stop` and does not parse."""
    regex = Constraint(kind=ConstraintKind.REGEX, spec="a+")
    for field, value in [
        ("ignore_eos", True),
        ("min_tokens", 2),
        ("stop", (",",)),
        ("stop_token_ids", (28,)),
    ]:
        with pytest.raises(InvalidRequestError, match=f"^{field} cannot be combined"):
            SamplingParams(constraint=regex, **{field: value})  # type: ignore[arg-type]


async def test_constraints_whose_first_mask_fails_are_refused_at_admission(
    model: LoadedModel,
) -> None:
    """A regex whose lexer takes over a second to build its first mask (and, steps later,
    fails after hundreds of megabytes), and a schema that can match nothing (a $ref to
    itself): 400s at admission, none cached, none in a step; a free request is served."""
    blowup = Constraint(kind=ConstraintKind.REGEX, spec="(a{1000}){1000}")
    cycle = Constraint(kind=ConstraintKind.JSON_SCHEMA, spec='{"$ref": "#"}')
    with trio.fail_after(120):
        async with serving(model) as engine:
            for constraint, why in [
                (blowup, "first token mask took .*s; the limit is constraint_mask_timeout=0.25s"),
                (cycle, "json_schema is not valid: NoExtensionBias"),
            ]:
                with pytest.raises(InvalidRequestError, match=why):
                    await collect(engine, [1, 2, 3], sampling(constraint, 0))
            free = await collect(engine, [4, 5], SamplingParams(temperature=0, max_tokens=2))
            assert not engine.core.admission.compiler.cache  # type: ignore[union-attr]
    assert len(tokens_of(free)) == 2
