"""Behaviour 6: draft tokens ride after the real token; rejected drafts roll back."""

from weir.services.scheduler import Request, RequestStatus
from weir.shared.protocol.step import SampleLogprobs, StepResult
from weir.shared.sampling import SamplingParams

from .fake_executor import EOS, make_scheduler, reference_generate, run_step, toy_next_token

LONG = SamplingParams(max_tokens=50, ignore_eos=True)


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 60 + 1 for i in range(n)]


def _decoding(scheduler, executor, *requests):
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler, executor)
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in requests)


def _true_next(request, extra=()):
    return toy_next_token(list(request.all_token_ids) + list(extra))


def test_drafts_are_scheduled_after_the_real_token_and_rejections_roll_back():
    scheduler, executor = make_scheduler(block_size=4, num_speculative_tokens=3)
    a = Request("A", _prompt(8), LONG)
    _decoding(scheduler, executor, a)
    t0 = _true_next(a)
    t1 = toy_next_token(list(a.all_token_ids) + [t0])
    drafts = [t0, (t1 + 1) % 64, 5]  # first right, second wrong
    scheduler.update_draft_token_ids({"A": drafts})
    assert a.spec_token_ids == drafts and a.num_tokens_with_spec == a.num_tokens + 3
    computed, num_tokens = a.num_computed_tokens, a.num_tokens
    plan, outputs = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 4}
    assert plan.scheduled_spec_decode_tokens == {"A": drafts}
    # One accepted draft plus the model's correction.
    assert outputs[0].new_token_ids == [t0, t1]
    assert a.num_computed_tokens == computed + 2 and a.num_tokens == num_tokens + 2
    assert a.num_computed_tokens == a.num_tokens - 1 and a.spec_token_ids == []


def test_all_drafts_accepted_plus_bonus_matches_plain_decoding():
    scheduler, executor = make_scheduler(block_size=4, num_speculative_tokens=2)
    a = Request("A", _prompt(6), SamplingParams(max_tokens=12, ignore_eos=True))
    _decoding(scheduler, executor, a)
    produced = list(a.output_token_ids)
    while scheduler.has_unfinished_requests():
        d0 = _true_next(a)
        scheduler.update_draft_token_ids({"A": [d0, _true_next(a, [d0])]})
        plan, outputs = run_step(scheduler, executor)
        for out in outputs:
            produced += out.new_token_ids
    assert produced == reference_generate(_prompt(6), 12, eos=None)[0]


def test_drafts_are_truncated_by_budget_cap_max_tokens_and_max_model_len():
    scheduler, executor = make_scheduler(max_num_batched_tokens=5, num_speculative_tokens=2)
    a, b = Request("A", _prompt(2), LONG), Request("B", _prompt(2, 3), LONG)
    _decoding(scheduler, executor, a, b)
    scheduler.update_draft_token_ids({"A": [1, 2, 3, 4], "B": [5, 6, 7]})
    assert a.spec_token_ids == [1, 2] and b.spec_token_ids == [5, 6]  # num_speculative_tokens
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"A": 3, "B": 2}  # budget 5 cuts B's second draft
    assert plan.scheduled_spec_decode_tokens == {"A": [1, 2], "B": [5]}

    scheduler, executor = make_scheduler(num_speculative_tokens=4)
    c = Request("C", _prompt(3), SamplingParams(max_tokens=3, ignore_eos=True))
    _decoding(scheduler, executor, c)
    scheduler.update_draft_token_ids({"C": [1, 2, 3, 4]})
    assert c.spec_token_ids == [1]  # 1 output so far; 2 more at most, the last one a bonus

    scheduler, executor = make_scheduler(max_model_len=13, num_speculative_tokens=3)
    d = Request("D", _prompt(10), LONG)
    _decoding(scheduler, executor, d)
    scheduler.update_draft_token_ids({"D": [1, 2, 3]})
    # 11 tokens: one draft at position 11, whose acceptance brings a bonus at 12, the
    # last of 13 (two drafts sent the executor's bonus token past max_model_len).
    assert d.spec_token_ids == [1]
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"D": 2}
    assert plan.scheduled_spec_decode_tokens == {"D": [1]}


def test_no_drafts_during_a_prefill_and_stale_drafts_are_dropped():
    scheduler, executor = make_scheduler(max_num_batched_tokens=8, num_speculative_tokens=2)
    a = Request("A", _prompt(20), LONG)
    scheduler.add_request(a)
    run_step(scheduler, executor)
    scheduler.update_draft_token_ids({"A": [1, 2]})
    assert a.spec_token_ids == []
    plan = scheduler.schedule()
    assert plan.scheduled_spec_decode_tokens == {} and plan.num_scheduled_tokens == {"A": 8}


def test_unscheduled_drafts_go_stale_after_the_step():
    scheduler, executor = make_scheduler(max_num_batched_tokens=4, num_speculative_tokens=2)
    a, b = Request("A", _prompt(1), LONG), Request("B", _prompt(1, 3), LONG)
    _decoding(scheduler, executor, a, b)
    scheduler.update_draft_token_ids({"A": [1, 2], "B": [3, 4]})
    plan, _ = run_step(scheduler, executor)  # the budget leaves no room for B's drafts
    assert plan.num_scheduled_tokens == {"A": 3, "B": 1}
    assert plan.scheduled_spec_decode_tokens == {"A": [1, 2]}
    assert a.spec_token_ids == [] and b.spec_token_ids == []


def test_tokens_sampled_past_a_stop_are_dropped_with_their_logprobs():
    scheduler, executor = make_scheduler(num_speculative_tokens=3)
    a = Request("A", _prompt(4), SamplingParams(max_tokens=20), eos_token_id=EOS)
    scheduler.add_request(a)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, StepResult({"A": [9]}))
    scheduler.update_draft_token_ids({"A": [11, EOS, 12]})
    plan = scheduler.schedule()
    logprobs = SampleLogprobs(
        [[11, 3], [EOS, 1], [12, 4], [13, 5]],
        [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -1.0], [-0.4, -1.5]],
    )
    outputs = scheduler.update_from_output(
        plan, StepResult({"A": [11, EOS, 12, 13]}, {"A": logprobs})
    )
    assert outputs[0].new_token_ids == [11, EOS]
    assert outputs[0].finished and outputs[0].finish_reason == "stop"
    assert outputs[0].logprobs == SampleLogprobs([[11, 3], [EOS, 1]], [[-0.1, -2.0], [-0.2, -3.0]])
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [9, 11, EOS]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_a_speculative_step_that_returns_no_token_verifies_nothing():
    """An executor fault (no token for the request) is recomputed, not counted as a
    verification with every draft rejected (that lowered the reported acceptance)."""
    scheduler, executor = make_scheduler(block_size=4, num_speculative_tokens=3)
    a = Request("A", _prompt(8), LONG)
    _decoding(scheduler, executor, a)
    scheduler.update_draft_token_ids({"A": [1, 2, 3]})
    plan = scheduler.schedule()
    assert plan.scheduled_spec_decode_tokens == {"A": [1, 2, 3]}
    assert scheduler.update_from_output(plan, StepResult({}, step_id=plan.step_id)) == []
    spec = scheduler.stats().spec_decode
    assert (spec.num_drafts, spec.num_draft_tokens) == (0, 0)
    assert a.num_computed_tokens == a.num_tokens - 1 and a.spec_token_ids == []
