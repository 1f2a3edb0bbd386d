"""Behaviour 3-4: admission (prefix hits, watermark, FCFS) and recompute preemption."""

import pytest

from weir.services.scheduler import Request, RequestStatus
from weir.shared.sampling import SamplingParams

from .fake_executor import make_scheduler, reference_generate, run_step

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 3 * i) % 60 + 1 for i in range(n)]


def _finish_all(scheduler, executor, outputs_by_id=None):
    outputs_by_id = {} if outputs_by_id is None else outputs_by_id
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = run_step(scheduler, executor)
        for out in outputs:
            outputs_by_id.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    return outputs_by_id


def test_prefix_hits_are_whole_blocks_and_never_the_whole_prompt():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=64)
    base = _prompt(8)
    scheduler.add_request(Request("A", base, SamplingParams(max_tokens=1)))
    plan, _ = run_step(scheduler, executor)
    a_blocks = plan.new_requests[0].block_ids
    assert scheduler.kv_cache_manager.num_free_blocks == 64  # finished, blocks cached

    scheduler.add_request(Request("same", base, SamplingParams(max_tokens=1)))
    scheduler.add_request(Request("longer", base + [7, 9], SamplingParams(max_tokens=1)))
    scheduler.add_request(Request("shorter", base[:6], SamplingParams(max_tokens=1)))
    plan, outputs = run_step(scheduler, executor)
    new = {r.request_id: r for r in plan.new_requests}
    # An identical 2-block prompt reuses 1 block: the last token must be computed.
    assert new["same"].num_computed_tokens == 4 and new["same"].block_ids[0] == a_blocks[0]
    assert new["longer"].num_computed_tokens == 8 and new["longer"].block_ids[:2] == a_blocks
    assert new["shorter"].num_computed_tokens == 4  # the partial second block is recomputed
    assert plan.num_scheduled_tokens == {"same": 4, "longer": 2, "shorter": 2}
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {
        "same": 4,
        "longer": 8,
        "shorter": 4,
    }
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 8 + 10 + 6, 16)
    # A request that skips the cache (prompt logprobs: every position computed) is no
    # lookup, as vLLM counts them: it would lower the hit rate of the ones that are.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scheduler.add_request(Request("logprobs", base, params))
    plan, _ = run_step(scheduler, executor)
    assert plan.new_requests[0].num_computed_tokens == 0
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 8 + 10 + 6, 16)


def test_watermark_reserve_applies_only_while_something_runs():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=20, watermark=0.25)
    # Nothing running: a request may take 18 of 20 blocks (the 5-block reserve is waived).
    scheduler.add_request(Request("big", _prompt(72), SamplingParams(max_tokens=1)))
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"big": 72}

    scheduler.add_request(Request("A", _prompt(18, 2), GREEDY))  # 5 blocks
    run_step(scheduler, executor)
    assert scheduler.kv_cache_manager.num_free_blocks == 15
    scheduler.add_request(Request("B", _prompt(44, 3), GREEDY))  # 11 blocks: 4 would stay free
    plan, _ = run_step(scheduler, executor)
    assert (
        plan.num_scheduled_tokens == {"A": 1}
        and scheduler.requests["B"].status is RequestStatus.WAITING
    )
    scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(Request("C", _prompt(40, 4), GREEDY))  # 10 blocks: 5 stay free
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 1, "C": 40}


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=12, watermark=0.0)
    scheduler.add_request(Request("A", _prompt(20), GREEDY))  # 5 blocks
    run_step(scheduler, executor)
    scheduler.add_request(Request("B", _prompt(40, 5), SamplingParams(max_tokens=2)))  # 10
    scheduler.add_request(Request("C", _prompt(4, 6), GREEDY))  # 1 block: fits, must wait
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 1}
    assert [r.request_id for r in scheduler.waiting] == ["B", "C"]


def _three_full_requests():
    """A, B, C with 7-token prompts fill a 6-block cache (block size 4)."""
    scheduler, executor = make_scheduler(block_size=4, num_blocks=6, watermark=0.0)
    for name, start in (("A", 1), ("B", 20), ("C", 40)):
        scheduler.add_request(Request(name, _prompt(7, start), GREEDY))
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 7, "B": 7, "C": 7}
    run_step(scheduler, executor)  # position 7 still fits everyone's second block
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, executor


def test_preemption_takes_the_most_recently_admitted_and_recomputes_it():
    scheduler, executor = _three_full_requests()
    c = scheduler.requests["C"]
    produced = {"C": list(c.output_token_ids)}
    scheduler.add_request(Request("D", _prompt(3, 50), GREEDY))
    plan, _ = run_step(scheduler, executor)  # A and B need a third block
    assert plan.preempted_req_ids == ["C"]
    assert plan.num_scheduled_tokens == {"A": 1, "B": 1}
    assert not plan.new_requests, "nothing is admitted in a step that preempted"
    assert (c.status, c.num_computed_tokens, c.num_preemptions, c.block_ids) == (
        RequestStatus.PREEMPTED,
        0,
        1,
        [],
    )
    assert [r.request_id for r in scheduler.waiting] == ["C", "D"]
    assert scheduler.stats().num_preemptions == 1

    outputs = _finish_all(scheduler, executor, produced)
    assert outputs["C"] == reference_generate(_prompt(7, 40), 6, eos=None)[0]
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_resumed_request_carries_its_whole_table_and_outputs_and_reuses_cache_hits():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=6, watermark=0.0)
    scheduler.add_request(Request("A", _prompt(9), SamplingParams(max_tokens=8, ignore_eos=True)))
    scheduler.add_request(
        Request("B", _prompt(9, 30), SamplingParams(max_tokens=12, ignore_eos=True))
    )
    run_step(scheduler, executor)  # 3 blocks each: the cache is full
    b = scheduler.requests["B"]
    steps = 0
    while b.status is RequestStatus.RUNNING:
        plan, _ = run_step(scheduler, executor)
        steps += 1
        assert steps < 10
    assert plan.preempted_req_ids == ["B"]
    outputs_before = list(b.output_token_ids)
    produced = {"B": list(outputs_before)}
    plan = None
    while plan is None or "B" not in plan.num_scheduled_tokens:
        plan, outputs = run_step(scheduler, executor)
        for out in outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    record = next(c for c in plan.cached_requests if c.request_id == "B")
    assert record.resumed and record.output_token_ids == outputs_before
    assert record.new_block_ids == b.block_ids
    # Its three full blocks stayed cached when it was preempted; A then took the tail
    # one (evicted first), so the first two are hits and only the rest is recomputed.
    assert len(outputs_before) == 4
    assert record.num_computed_tokens == 8
    assert plan.num_scheduled_tokens["B"] == 9 + len(outputs_before) - record.num_computed_tokens
    _finish_all(scheduler, executor, produced)
    assert produced["B"] == reference_generate(_prompt(9, 30), 12, eos=None)[0]
    # The prompts' lookups only: B's resumption found its own blocks, which is no reuse.
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 0)


def test_a_request_may_preempt_itself():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=4, watermark=0.0)
    scheduler.add_request(Request("A", _prompt(5), SamplingParams(max_tokens=3, ignore_eos=True)))
    scheduler.add_request(
        Request("B", _prompt(8, 9), SamplingParams(max_tokens=3, ignore_eos=True))
    )
    _, outputs = run_step(scheduler, executor)
    produced = {o.request_id: list(o.new_token_ids) for o in outputs}
    plan, outputs = run_step(scheduler, executor)  # B's position 8 needs a third block
    assert plan.preempted_req_ids == ["B"] and plan.num_scheduled_tokens == {"A": 1}
    produced["A"] += outputs[0].new_token_ids
    _finish_all(scheduler, executor, produced)
    assert scheduler.requests == {}
    assert scheduler.kv_cache_manager.num_free_blocks == 4
    assert produced["B"] == reference_generate(_prompt(8, 9), 3, eos=None)[0]
    assert produced["A"] == reference_generate(_prompt(5), 3, eos=None)[0]


def test_priority_policy_orders_waiting_and_preempts_the_least_urgent():
    scheduler, executor = make_scheduler(
        block_size=4, num_blocks=6, watermark=0.0, policy="priority"
    )
    scheduler.add_request(Request("low", _prompt(5), GREEDY, priority=2, arrival_time=0.0))
    run_step(scheduler, executor)
    scheduler.add_request(Request("late", _prompt(8, 10), GREEDY, priority=1, arrival_time=9.0))
    scheduler.add_request(Request("urgent", _prompt(8, 20), GREEDY, priority=0, arrival_time=5.0))
    scheduler.add_request(Request("early", _prompt(4, 30), GREEDY, priority=1, arrival_time=1.0))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "early", "late"]
    plan, _ = run_step(scheduler, executor)
    # 2 blocks for "low", then 2 + 2 leaves nothing for "late".
    assert plan.num_scheduled_tokens == {"low": 1, "urgent": 8, "early": 4}
    assert [r.request_id for r in scheduler.running] == ["low", "urgent", "early"]
    scheduler.finish_requests(["late"], RequestStatus.FINISHED_ABORTED)
    plan, _ = run_step(scheduler, executor)
    # "urgent" needs a block: the victim is "low" (largest priority value), although it
    # was admitted first and already scheduled in this step; its budget is returned.
    assert plan.preempted_req_ids == ["low"]
    assert plan.num_scheduled_tokens == {"urgent": 1, "early": 1}
    assert plan.total_num_scheduled_tokens == 2
    assert scheduler.requests["low"].status is RequestStatus.PREEMPTED
    _finish_all(scheduler, executor)
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_a_request_fills_a_cache_one_token_short_of_its_context_with_or_without_max_tokens():
    """A generation's KV holds max_model_len - 1 tokens at most (its last token is never fed
    back): in a cache of 12 token slots and a context of 13, a request that omits max_tokens
    is admitted as one that asks for the room left is, and both fill the context; a prompt
    and max_tokens past the cache are refused with the blocks they would need."""
    prompt = [5, 6, 7, 8]
    for max_tokens in (9, None):
        scheduler, core = make_scheduler(block_size=4, num_blocks=3, max_model_len=13)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_request(Request("r", prompt, params))
        produced = []
        while scheduler.requests:
            produced += [t for out in run_step(scheduler, core)[1] for t in out.new_token_ids]
        assert produced == reference_generate(prompt, 9, eos=None)[0], max_tokens
    scheduler, _ = make_scheduler(block_size=4, num_blocks=2, max_model_len=13)
    with pytest.raises(ValueError, match="need 3 blocks but the cache has only 2: send a "):
        scheduler.add_request(Request("big", prompt, SamplingParams(ignore_eos=True)))
