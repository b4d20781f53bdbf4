"""Prefix caching in the core: block hashes, and the scheduler's hits, budgets and accounting.
Plain Python, driven step by step with made-up sampled tokens."""

from __future__ import annotations

import attrs

from loom.core.prefix_cache import block_hashes
from loom.core.request import Request, RequestStatus
from loom.core.request_output import Logprobs, TokenLogprob
from loom.core.scheduler import Scheduler
from loom.core.tenancy import Tenancy
from tests.core.test_scheduler import make_scheduler, shape, step
from tests.support.factory import make_request


def request(request_id: str, prompt: list[int], salt: str = "", max_tokens: int = 100) -> Request:
    return attrs.evolve(
        make_request(request_id, max_tokens=max_tokens),
        prompt_token_ids=tuple(prompt),
        cache_salt=salt,
    )


def scheduler(num_blocks: int = 64, caching: bool = True, **config: int) -> Scheduler:
    return make_scheduler(num_blocks, 4, caching=caching, **config)


def run_to_end(s: Scheduler) -> None:
    while s.has_unfinished():
        step(s)


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks and 2 more


def test_block_hashes_chain_over_the_prefix_and_the_salt() -> None:
    a = block_hashes(request("a", PROMPT), 4, 18)
    assert len(set(a)) == len(a) == 4
    assert block_hashes(request("b", [*PROMPT[:12], 1, 2, 3, 4]), 4, 16)[:3] == a[:3]
    # The same tokens after a different first block hash differently: the chain.
    moved = block_hashes(request("c", [0, 0, 0, 0, *PROMPT[4:]]), 4, 18)
    assert not set(moved) & set(a)
    salted = block_hashes(request("d", PROMPT, salt="tenant-1"), 4, 18)
    assert not set(salted) & set(a)
    assert block_hashes(request("e", PROMPT, salt="tenant-1"), 4, 18) == salted
    assert block_hashes(request("f", PROMPT), 4, 7) == a[:1]  # full blocks only
    # A tenant's blocks are its own: the same tokens and salt of another tenant share none.
    other = attrs.evolve(request("g", PROMPT, salt="tenant-1"), tenancy=Tenancy(tenant="b"))
    assert not set(block_hashes(other, 4, 18)) & set(salted)


def test_scheduler_a_hit_counts_as_computed_and_prefills_only_the_rest() -> None:
    s = scheduler(max_num_batched_tokens=64)
    s.add_request(request("first", PROMPT, max_tokens=1))
    run_to_end(s)
    assert s.block_manager.num_cached_blocks == 4
    second = request("second", [*PROMPT[:16], 5, 6, 7], max_tokens=1)
    s.add_request(second)
    output = step(s)
    assert shape(output) == {"second": 3}  # 16 cached, 3 computed
    assert output.sequences[0].num_computed_tokens == 16
    assert second.num_cached_tokens == 16
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (18 + 19, 16)


def test_scheduler_computes_the_last_token_of_a_wholly_cached_prompt() -> None:
    s = scheduler()
    prompt = PROMPT[:16]  # ends on a block boundary
    s.add_request(request("first", prompt, max_tokens=1))
    run_to_end(s)
    again = request("again", prompt, max_tokens=1)
    s.add_request(again)
    output = step(s)
    # Whole blocks only, never the last token: the block holding it is computed again.
    assert shape(output) == {"again": 4}
    assert again.num_cached_tokens == 12
    assert output.sequences[0].sampling is not None


def test_scheduler_token_budget_counts_only_uncomputed_tokens() -> None:
    s = scheduler(max_num_batched_tokens=8)
    s.add_request(request("first", PROMPT, max_tokens=1))
    run_to_end(s)
    s.add_request(request("a", [*PROMPT[:16], 1, 2], max_tokens=2))
    s.add_request(request("b", [*PROMPT[:16], 3, 4], max_tokens=2))
    # Each computes 2 tokens: both fit the budget of 8 in one step.
    assert shape(step(s)) == {"a": 2, "b": 2}


def test_scheduler_admission_counts_the_blocks_a_hit_really_needs() -> None:
    s = scheduler(num_blocks=7, max_num_batched_tokens=64)  # 6 usable
    s.add_request(request("a", [*PROMPT[:16], 1], max_tokens=50))
    step(s)  # a: 5 blocks, 4 of them full and cached; 1 free
    # b's 17 tokens need 5 blocks, of which 4 are a's, held: 1 new block is enough.
    s.add_request(request("b", [*PROMPT[:16], 2], max_tokens=50))
    assert shape(step(s)) == {"a": 1, "b": 1}
    assert s.block_manager.num_free_blocks == 0


def test_scheduler_shared_blocks_survive_the_abort_or_preemption_of_one_sharer() -> None:
    s = scheduler(num_blocks=9, max_num_batched_tokens=64)  # 8 usable
    s.add_request(request("a", [*PROMPT[:12], 1], max_tokens=50))
    step(s)
    s.add_request(request("b", [*PROMPT[:12], 2], max_tokens=50))
    step(s)
    bm = s.block_manager
    shared = bm.block_table("a")[:3]
    assert bm.block_table("b")[:3] == shared
    assert [bm.ref_count(b) for b in shared] == [2, 2, 2]
    s.finish(s.requests["a"], RequestStatus.FINISHED_ABORTED)
    assert [bm.ref_count(b) for b in shared] == [1, 1, 1]
    assert bm.block_table("b")[:3] == shared
    s.add_request(request("c", [*PROMPT[:12], 3], max_tokens=50))
    step(s)
    assert bm.block_table("c")[:3] == shared
    s.preempt(s.requests["b"])  # b gives its references back; c keeps the blocks
    assert [bm.ref_count(b) for b in shared] == [1, 1, 1]
    step(s)  # b comes back, hitting the same blocks
    assert bm.block_table("b")[:3] == shared
    for r in list(s.requests.values()):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_scheduler_different_salts_share_no_block() -> None:
    s = scheduler(max_num_batched_tokens=64)
    s.add_request(request("a", PROMPT, salt="tenant-a", max_tokens=5))
    step(s)
    s.add_request(request("b", PROMPT, salt="tenant-b", max_tokens=5))
    s.add_request(request("c", PROMPT, max_tokens=5))
    step(s)
    tables = [set(s.block_manager.block_table(r)) for r in "abc"]
    assert sum(map(len, tables)) == len(set.union(*tables))  # pairwise disjoint
    assert s.prefix_cache_hits == 0
    s.add_request(request("a2", PROMPT, salt="tenant-a", max_tokens=5))
    step(s)
    assert s.block_manager.block_table("a2")[:4] == s.block_manager.block_table("a")[:4]


def test_scheduler_without_caching_finds_nothing() -> None:
    s = scheduler(caching=False)
    for name in ("a", "b"):
        s.add_request(request(name, PROMPT, max_tokens=1))
        run_to_end(s)
    assert (s.prefix_cache_hits, s.block_manager.num_cached_blocks) == (0, 0)


def test_scheduler_caches_generated_blocks_for_the_next_turn() -> None:
    s = scheduler()
    first = request("turn1", PROMPT[:6], max_tokens=7)  # 6 + 7 tokens: blocks 0-2 are full
    s.add_request(first)
    run_to_end(s)
    history = list(first.prompt_token_ids) + first.output_token_ids
    turn2 = request("turn2", [*history, 42, 43], max_tokens=1)
    s.add_request(turn2)
    step(s)
    # The last output token was sampled, never computed: blocks 0-1 (8 tokens) and block 2
    # (tokens 8-11) were written; token 12 was not.
    assert turn2.num_cached_tokens == 12


def test_scheduler_preempts_no_paused_request_whose_blocks_others_hold() -> None:
    s = scheduler(num_blocks=8, max_num_batched_tokens=64)  # 7 usable
    s.add_request(request("running", [*PROMPT[:12], 1], max_tokens=50))
    step(s)  # 4 blocks, the first 3 cached
    s.add_request(request("paused", [*PROMPT[:12], 2], max_tokens=50))
    step(s)  # shares the 3, 1 of its own
    paused = s.requests["paused"]
    s.pause(paused, now=0.0)
    assert s.block_manager.num_free_blocks == 2
    # 4 blocks wanted; preempting the paused request would free its 1 own block only.
    s.add_request(request("waiting", list(range(300, 316)), max_tokens=50))
    assert shape(step(s)) == {"running": 1}
    assert paused.status is RequestStatus.RUNNING
    assert s.num_preemptions == 0


def test_scheduler_a_request_scoring_its_prompt_computes_and_scores_every_position_once() -> None:
    s = scheduler(max_num_batched_tokens=8)
    s.add_request(request("first", PROMPT, max_tokens=1))
    run_to_end(s)
    scored = request("scored", PROMPT, max_tokens=1)
    scored.sampling = attrs.evolve(scored.sampling, prompt_logprobs=2)
    s.add_request(scored)
    output = s.schedule(now=0.0)
    assert output is not None
    (seq,) = output.sequences
    assert (seq.num_computed_tokens, len(seq.token_ids)) == (0, 8)  # the cache not taken
    assert seq.scoring is not None
    assert (seq.scoring.first_row, seq.scoring.next_token_ids) == (0, tuple(PROMPT[1:9]))
    # Preempted after scoring 3 positions, it computes the prompt again and scores from 3 on.
    scored.prompt_logprobs = [scored_logprob(t) for t in PROMPT[1:4]]
    again = scored.prompt_scoring(0, 8)
    assert again is not None
    assert (again.first_row, again.next_token_ids) == (3, tuple(PROMPT[4:9]))
    last = scored.prompt_scoring(16, 18)  # the last prompt token predicts no prompt token
    assert last is not None
    assert last.next_token_ids == (PROMPT[17],)
    assert scored.prompt_scoring(17, 18) is None


def scored_logprob(token_id: int) -> Logprobs:
    return Logprobs(chosen=TokenLogprob(token_id=token_id, logprob=-1.0), top=())
