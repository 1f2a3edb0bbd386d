"""Behaviour 5: chained block hashes, sharing, reference counts, LRU eviction."""

import os
import subprocess
import sys

import pytest

from weir.services.scheduler import Request, RequestStatus
from weir.services.scheduler.block_pool import ROOT_BLOCK_HASH, chain_block_hashes
from weir.shared.sampling import SamplingParams

from .fake_executor import make_scheduler, reference_generate, run_step

ONE = SamplingParams(max_tokens=1)
LONG = SamplingParams(max_tokens=100, ignore_eos=True)


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 5 * i) % 60 + 1 for i in range(n)]


def test_block_hashes_are_chained_and_stable_across_processes():
    tokens = list(range(100, 112))
    hashes = chain_block_hashes(ROOT_BLOCK_HASH, tokens, 4)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    # The same block content under a different prefix hashes differently.
    assert chain_block_hashes(ROOT_BLOCK_HASH, [1, 2, 3, 4] + tokens[4:8], 4)[1] != hashes[1]
    # Extending incrementally gives the same chain; a trailing partial block is skipped.
    assert hashes[:1] + chain_block_hashes(hashes[0], tokens[4:] + [7], 4) == hashes
    code = (
        "from weir.services.scheduler.block_pool import ROOT_BLOCK_HASH, chain_block_hashes;"
        "print(chain_block_hashes(ROOT_BLOCK_HASH, list(range(100, 112)), 4)[-1].hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert other.stdout.strip() == hashes[-1].hex()


def test_identical_prompts_share_blocks_with_reference_counts():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=32)
    prompt = _prompt(13)  # 3 full blocks + 1 token
    scheduler.add_request(Request("A", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    a_blocks = plan.new_requests[0].block_ids
    scheduler.add_request(Request("B", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    b = plan.new_requests[0]
    assert b.block_ids[:3] == a_blocks[:3] and b.block_ids[3] != a_blocks[3]
    assert b.num_computed_tokens == 12 and plan.num_scheduled_tokens["B"] == 1
    pool = scheduler.kv_cache_manager.pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 2, 1]
    assert scheduler.kv_cache_manager.num_free_blocks == 32 - 5

    scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    assert [pool.blocks[i].ref_cnt for i in a_blocks[:3]] == [1, 1, 1]
    scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == 32 and kv.usage == 0.0
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    # Freed blocks stay cached: a third copy hits them.
    scheduler.add_request(Request("C", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    assert plan.new_requests[0].block_ids[:3] == a_blocks[:3]


def test_only_computed_blocks_are_cached_during_a_chunked_prefill():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=32, max_num_batched_tokens=10)
    prompt = _prompt(30)
    scheduler.add_request(Request("A", prompt, SamplingParams(max_tokens=20)))
    run_step(scheduler, executor)  # 10 tokens computed: 2 full blocks
    scheduler.add_request(Request("B", prompt, SamplingParams(max_tokens=20)))
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 10}  # B waits: no budget left
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 10}
    plan, _ = run_step(scheduler, executor)  # A computed 30 → 7 full blocks cached
    assert plan.new_requests[0].request_id == "B"
    assert plan.new_requests[0].num_computed_tokens == 28


def test_eviction_is_least_recently_freed_first_and_tail_before_head():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=8)
    a_prompt = _prompt(9)  # 2 full blocks + 1 token
    scheduler.add_request(Request("A", a_prompt, ONE))
    plan, _ = run_step(scheduler, executor)
    a_blocks = plan.new_requests[0].block_ids
    # 7 blocks for B: the 5 never-used ones, A's uncached partial block, then A's tail
    # full block; A's head block stays cached.
    scheduler.add_request(Request("B", _prompt(28, 30), ONE))
    plan, _ = run_step(scheduler, executor)
    assert a_blocks[1] in plan.new_requests[0].block_ids
    assert a_blocks[0] not in plan.new_requests[0].block_ids
    scheduler.add_request(Request("A2", a_prompt, ONE))
    plan, _ = run_step(scheduler, executor)
    assert plan.new_requests[0].num_computed_tokens == 4
    assert plan.new_requests[0].block_ids[0] == a_blocks[0]


def test_lru_across_requests():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=4)
    x, y = _prompt(5, 1), _prompt(5, 2)
    for rid, prompt in (("X", x), ("Y", y)):  # each caches one full block
        scheduler.add_request(Request(rid, prompt, ONE))
        run_step(scheduler, executor)
    scheduler.add_request(Request("Z", _prompt(9, 3), ONE))  # 3 blocks: evicts X's, not Y's
    run_step(scheduler, executor)
    scheduler.add_request(Request("Y2", y, ONE))  # first, so X2's allocation cannot evict it
    scheduler.add_request(Request("X2", x, ONE))
    plan, _ = run_step(scheduler, executor)
    computed = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    assert computed == {"X2": 0, "Y2": 4}


def test_prefix_caching_off_never_hits():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=16, enable_prefix_caching=False)
    for rid in ("A", "B"):
        scheduler.add_request(Request(rid, _prompt(9), ONE))
        plan, _ = run_step(scheduler, executor)
        assert plan.new_requests[0].num_computed_tokens == 0
    assert scheduler.kv_cache_manager.pool.cached_blocks == {}
    assert scheduler.stats().prefix_cache_hits == 0


def test_a_reset_prefix_cache_leaves_no_block_to_hit_and_running_requests_their_blocks():
    """vLLM's reset_prefix_cache: a prompt cached before is computed whole after it, while
    the request holding cached blocks keeps them (freed uncached when it ends)."""
    scheduler, executor = make_scheduler(block_size=4, num_blocks=32)
    prompt = _prompt(13)
    scheduler.add_request(Request("A", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    a_blocks = plan.new_requests[0].block_ids
    assert scheduler.reset_prefix_cache() == 3
    pool = scheduler.kv_cache_manager.pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks] == [1, 1, 1, 1]
    scheduler.add_request(Request("B", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    assert plan.new_requests[0].num_computed_tokens == 0
    assert set(plan.new_requests[0].block_ids).isdisjoint(a_blocks)
    scheduler.finish_requests(["A", "B"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 32
    # B's blocks were cached as it ran: a third request reads them, none of A's.
    scheduler.add_request(Request("C", prompt, LONG))
    plan, _ = run_step(scheduler, executor)
    assert plan.new_requests[0].num_computed_tokens == 12


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["lockstep", "async"])
def test_a_prefix_that_a_planned_step_computes_is_hit_a_step_later_not_computed_again(
    async_scheduling,
):
    """Prompts sharing a prefix sent together: the first computes it, the others wait for
    its step (two when steps overlap) and hit its blocks; none computes it beside it.
    The outputs are the model's."""
    scheduler, core = make_scheduler(
        block_size=16, num_blocks=64, max_num_batched_tokens=1000, async_scheduling=async_scheduling
    )
    shared = _prompt(96)
    prompts = {rid: shared + _prompt(4, 10 + i) for i, rid in enumerate("ABC")}
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    steps, tokens = [], {rid: [] for rid in prompts}
    while scheduler.has_unfinished_requests():
        plan, outputs = run_step(scheduler, core)
        steps.append(plan.num_scheduled_tokens)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    assert steps[0] == {"A": 100}
    admitted = next(step for step in steps if "B" in step)
    assert admitted["B"] == admitted["C"] == 4  # 96 hit
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_generate(prompt, 3, eos=None)[0]


def test_a_request_waiting_on_a_pending_prefix_computes_it_once_its_holder_is_aborted():
    """Behind a chunked prefill it follows the chunks, hitting each once computed."""
    scheduler, core = make_scheduler(
        block_size=4, num_blocks=64, max_num_batched_tokens=16, long_prefill_token_threshold=8
    )
    prompt = _prompt(30)
    scheduler.add_request(Request("A", prompt, LONG))
    run_step(scheduler, core)  # A's first 8 tokens: 2 blocks cached after the step
    scheduler.add_request(Request("B", prompt, LONG))
    plan, _ = run_step(scheduler, core)
    assert plan.num_scheduled_tokens == {"A": 8}  # B would compute blocks 2-3 beside A
    scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    plan, _ = run_step(scheduler, core)
    assert plan.new_requests[0].request_id == "B"
    assert plan.new_requests[0].num_computed_tokens == 16  # A's 4 computed blocks


def test_a_request_held_for_a_pending_prefix_holds_up_no_one_behind_it():
    """Held back while its prefix's holder prefills in chunks, it lets the request behind
    it, which shares nothing, be admitted at once."""
    scheduler, core = make_scheduler(
        block_size=4, num_blocks=64, max_num_batched_tokens=16, long_prefill_token_threshold=8
    )
    prompt = _prompt(30)
    scheduler.add_request(Request("A", prompt, LONG))
    run_step(scheduler, core)
    scheduler.add_request(Request("B", prompt, LONG))
    scheduler.add_request(Request("C", _prompt(6, 40), LONG))
    plan, _ = run_step(scheduler, core)
    assert plan.num_scheduled_tokens == {"A": 8, "C": 6}
    assert [r.request_id for r in scheduler.waiting] == ["B"]
