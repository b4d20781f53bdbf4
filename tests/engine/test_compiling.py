"""Constraints compiled for admission (loom/engine/compiling.py), in a real engine with real
compiles: shared by copies, queued and capped by tenant, judged too slow by their own compile
time alone, and kept by tenant and salt.

Rules: a tiny random Llama with SmolLM2's tokenizer; "slow" and "quick" are measured on this
machine first (`timing`), and every time limit below is set from those figures, never from a
constant that a faster or slower machine would cross.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from loom.core.constraint import Constraint
from loom.core.errors import EngineOverloadedError, InvalidRequestError
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy
from loom.engine.engine import Engine
from loom.model.loader import LoadedModel
from tests.conftest import tiny_model
from tests.engine.test_engine import assert_idle, collect, serving
from tests.support.compile_timing import QUICK, SLOW, Timing, limits, measure, schema
from tests.support.server_harness import until

A, B = Tenancy(tenant="a"), Tenancy(tenant="b")


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any) -> LoadedModel:
    return tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="module")
def timing(smollm2_tokenizer: Any) -> Timing:
    return measure(smollm2_tokenizer)


async def served(engine: Engine, constraint: Constraint, tenancy: Tenancy, salt: str = "") -> str:
    params = SamplingParams(temperature=0, max_tokens=1, constraint=constraint)
    try:
        await collect(engine, [1, 2, 3], params, tenancy=tenancy, cache_salt=salt)
    except (InvalidRequestError, EngineOverloadedError) as exc:
        return str(exc)
    return "served"


async def all_at_once(engine: Engine, asks: list[tuple[Constraint, Tenancy]]) -> list[str]:
    """Each (constraint, tenant) asked at once, in order: each one's outcome, in the order
    they ended."""
    ended: list[str] = []

    async def one(constraint: Constraint, tenancy: Tenancy) -> None:
        ended.append(f"{tenancy.tenant}: {await served(engine, constraint, tenancy)}")

    async with trio.open_nursery() as nursery:
        for constraint, tenancy in asks:
            nursery.start_soon(one, constraint, tenancy)
            await trio.sleep(0.02)  # queued in this order
    return ended


def compiler_of(engine: Engine) -> Any:
    assert engine.core is not None
    return engine.core.admission.compiler


async def test_compiling_copies_of_a_constraint_share_one_compile(
    model: LoadedModel, timing: Timing
) -> None:
    """16 requests for one slow schema at once (a request's n choices are so many copies):
    one compile, which every copy waits on, all served (each compiled its own before, two
    threads of eight compiles in a row, and then past their time limit)."""
    slow = schema("s", SLOW)
    limit = 3 * timing.slow + 0.5  # one compile fits; eight in a row would not
    with trio.fail_after(120):
        async with serving(model, constraints=limits(timing, constraint_compile_timeout=limit)
                           ) as engine:  # fmt: skip
            outcomes = await all_at_once(engine, [(slow, A)] * 16)
            assert compiler_of(engine).num_begun == 1
    assert outcomes == ["a: served"] * 16


async def test_compiling_a_tenant_past_its_cap_is_refused_and_no_other_tenant_waits_on_it(
    model: LoadedModel, timing: Timing
) -> None:
    """One thread. Tenant a asks three slow schemas at once, with room for two: the third is
    refused naming a; tenant b's schema, asked after a's second, is compiled before it (a
    tenant's compiles run one at a time while another's waits) and served."""
    roomy = limits(
        timing, constraint_compile_timeout=4 * timing.slow + 1, compile_threads=1,
        max_pending_compiles=2,
    )  # fmt: skip
    asks = [(schema("x", SLOW), A), (schema("y", SLOW), A), (schema("z", SLOW), A)]
    with trio.fail_after(120):
        async with serving(model, constraints=roomy) as engine:
            ended = await all_at_once(engine, [*asks, (schema("b", SLOW), B)])
            assert_idle(engine)
    refusal = (
        "a: tenant 'a' has 2 constraints compiling or waiting to; the limit is "
        "max_pending_compiles=2 (one past its time limit counts until it ends)"
    )
    assert ended == [refusal, "a: served", "b: served", "a: served"]


async def test_compiling_too_slow_is_judged_by_its_own_compile_time_and_for_its_tenant(
    model: LoadedModel, timing: Timing
) -> None:
    """One thread. Tenant a's slow schema runs past the time limit and is refused; a's quick
    schema, queued behind it longer than the limit, is judged by its own compile and served
    (the limit once counted its wait, and the schema was refused for every tenant after).
    Afterwards the slow one is refused at once for a, and compiles anew for b."""
    slow, quick = schema("s", SLOW), schema("q", QUICK)
    tight = limits(timing, compile_threads=1)
    limit = tight.constraint_compile_timeout
    too_slow = f"json_schema did not compile within constraint_compile_timeout={limit}s"
    with trio.fail_after(120):
        async with serving(model, constraints=tight) as engine:
            ended = await all_at_once(engine, [(slow, A), (quick, A)])
            compiler = compiler_of(engine)
            assert list(compiler.too_slow) == [("a", "", slow)]
            await until(lambda: not compiler.running)  # the slow one ran to its end
            assert [k[0] for k in compiler.cache] == ["a"]  # the quick one only
            assert await served(engine, slow, A) == too_slow  # at once: no compile begun
            assert compiler.num_begun == 2
            assert await served(engine, quick, B) == "served"
            assert await served(engine, slow, B) == too_slow  # its own compile, for b
            assert compiler.num_begun == 4
    assert sorted(ended) == [f"a: {too_slow}", "a: served"]


async def test_compiling_a_compile_every_request_left_is_dropped_from_the_queue(
    model: LoadedModel, timing: Timing
) -> None:
    """One thread, busy with a slow compile: the request waiting on a second one leaves, and
    that compile never begins."""
    roomy = limits(timing, constraint_compile_timeout=4 * timing.slow + 1, compile_threads=1)
    first, second = schema("f", SLOW), schema("g", SLOW)
    params = SamplingParams(temperature=0, max_tokens=1, constraint=second)
    with trio.fail_after(120):
        async with serving(model, constraints=roomy) as engine:
            compiler = compiler_of(engine)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(served, engine, first, A)
                await until(lambda: compiler.running)
                async with engine.generate([1, 2, 3], params, tenancy=A):
                    await until(lambda: compiler.queued)
                await until(lambda: not compiler.queued)  # gone with its only request
            assert compiler.num_begun == 1
            assert_idle(engine)


async def test_compiling_keeps_each_compile_for_its_tenant_and_salt(
    model: LoadedModel, timing: Timing
) -> None:
    """One schema: compiled for a, then for b (a's compile tells b nothing: no faster for
    b), then for a under another cache_salt; a asking again takes its own, at once."""
    quick = schema("k", QUICK)
    with trio.fail_after(120):
        async with serving(model, constraints=limits(timing)) as engine:
            compiler = compiler_of(engine)
            for tenancy, salt, begun in [(A, "", 1), (B, "", 2), (A, "x", 3), (A, "", 3)]:
                params = SamplingParams(temperature=0, max_tokens=1, constraint=quick)
                await collect(engine, [1, 2], params, tenancy=tenancy, cache_salt=salt)
                assert compiler.num_begun == begun
    assert list(compiler.cache) == [("b", "", quick), ("a", "x", quick), ("a", "", quick)]
