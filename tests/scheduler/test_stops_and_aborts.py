"""Behaviour 7-9: stop conditions, aborts, refusals at add_request, no leaks."""

import pytest

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.scheduler import Request, RequestStatus
from weir.shared.protocol.step import StepResult
from weir.shared.sampling import SamplingParams

from .fake_executor import make_scheduler, reference_generate, run_step

EOS = 2


class _Scripted:
    """Samples the given tokens, one per step, for whichever request is scheduled."""

    def __init__(self, tokens):
        self.tokens = iter(tokens)

    def execute(self, plan):
        return StepResult({rid: [next(self.tokens)] for rid in plan.num_scheduled_tokens})


class _AbortInFlight:
    """Runs the step, then aborts ``victim`` before the result reaches the scheduler."""

    def __init__(self, core, victim):
        self.runner, self.scheduler, self.victim = core.executor.runner, core.scheduler, victim

    def execute(self, plan):
        result = self.runner.execute(plan)
        self.scheduler.finish_requests([self.victim], RequestStatus.FINISHED_ABORTED)
        return result


def _feed(scheduler, request, tokens):
    """Run ``request`` alone, feeding it ``tokens`` one per step; returns outputs."""
    scheduler.add_request(request)
    core = EngineCore(scheduler, InProcessExecutor(_Scripted(tokens)))
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs += step_now(core).outputs
    return outputs


def _tokens(outputs):
    return [t for out in outputs for t in out.new_token_ids]


@pytest.mark.parametrize(
    "params, fed, expected_tokens, status",
    [
        (
            SamplingParams(max_tokens=10),
            [5, 6, EOS, 7],
            [5, 6, EOS],
            RequestStatus.FINISHED_STOPPED,
        ),
        (
            SamplingParams(max_tokens=4, ignore_eos=True),
            [5, EOS, 6, 7, 8],
            [5, EOS, 6, 7],
            RequestStatus.FINISHED_LENGTH,
        ),
        (
            SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(9,)),
            [5, EOS, 9, 7],
            [5, EOS, 9],
            RequestStatus.FINISHED_STOPPED,
        ),
        (
            SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(9,)),
            [EOS, 9, EOS, 4],
            [EOS, 9, EOS],
            RequestStatus.FINISHED_STOPPED,
        ),
        (
            SamplingParams(max_tokens=3, min_tokens=3),
            [EOS, EOS, 4, 5],
            [EOS, EOS, 4],
            RequestStatus.FINISHED_LENGTH,
        ),
    ],
)
def test_stop_conditions(params, fed, expected_tokens, status):
    scheduler, _ = make_scheduler(block_size=4, num_blocks=16)
    request = Request("A", [1, 3, 4], params, eos_token_id=EOS)
    outputs = _feed(scheduler, request, fed)
    assert _tokens(outputs) == expected_tokens
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert (
        outputs[-1].finish_reason
        == {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}[status]
    )
    assert request.status is status and request.finish_reason == outputs[-1].finish_reason
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_no_eos_id_means_only_max_tokens_stops():
    scheduler, _ = make_scheduler()
    outputs = _feed(scheduler, Request("A", [1], SamplingParams(max_tokens=3)), [EOS, EOS, EOS])
    assert _tokens(outputs) == [EOS, EOS, EOS] and outputs[-1].finish_reason == "length"


def test_abort_frees_blocks_at_once_and_is_reported_in_the_next_plan():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=16)
    scheduler.add_request(Request("A", list(range(1, 10)), SamplingParams(max_tokens=8)))
    scheduler.add_request(Request("B", list(range(3, 9)), SamplingParams(max_tokens=8)))
    run_step(scheduler, executor)
    scheduler.add_request(Request("W", [4, 5], SamplingParams(max_tokens=8)))
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == 16 - 3 - 2
    outputs = scheduler.finish_requests(["A", "W", "nope", "A"], RequestStatus.FINISHED_ABORTED)
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outputs] == [
        ("A", True, "abort", []),
        ("W", True, "abort", []),
    ]
    assert kv.num_free_blocks == 16 - 2
    plan, _ = run_step(scheduler, executor)
    assert sorted(plan.finished_req_ids) == ["A", "W"]
    assert list(plan.num_scheduled_tokens) == ["B"]
    plan, _ = run_step(scheduler, executor)
    assert plan.finished_req_ids == []


def test_abort_while_the_step_is_in_flight_drops_its_late_tokens():
    scheduler, core = make_scheduler()
    scheduler.add_request(Request("A", [1, 2, 3], SamplingParams(max_tokens=8)))
    scheduler.add_request(Request("B", [4, 5, 6], SamplingParams(max_tokens=8)))
    core.executor = InProcessExecutor(_AbortInFlight(core, "A"))
    step = step_now(core)
    assert list(step.plan.num_scheduled_tokens) == ["A", "B"]
    assert [o.request_id for o in step.outputs] == ["B"]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["lockstep", "async"])
@pytest.mark.parametrize(
    "ended", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED], ids=["abort", "stop"]
)
def test_a_request_id_used_again_gets_only_its_own_tokens(async_scheduling, ended):
    """A request ended from outside (abort, stop string) while steps that hold it are in
    flight, and a new request of the same id added at once: the old steps' tokens are not
    the new request's, whose output is its own prompt's, from its first token."""
    scheduler, core = make_scheduler(async_scheduling=async_scheduling)
    scheduler.add_request(Request("x", [5, 6, 7], SamplingParams(max_tokens=50)))
    for _ in range(3):
        run_step(scheduler, core)
    scheduler.finish_requests(["x"], ended)
    scheduler.add_request(Request("x", [9, 8, 7, 6], SamplingParams(max_tokens=6)))
    outputs = []
    while core.has_work():
        outputs += run_step(scheduler, core)[1]
    assert [t for o in outputs for t in o.new_token_ids] == reference_generate(
        [9, 8, 7, 6], 6, eos=None
    )[0]
    assert outputs[-1].finish_reason == "length"
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_finish_requests_from_outside_with_stop_reason():
    scheduler, executor = make_scheduler()
    request = Request("A", [1, 2, 3], SamplingParams(max_tokens=8, stop=("END",)))
    scheduler.add_request(request)
    run_step(scheduler, executor)
    outputs = scheduler.finish_requests(["A"], RequestStatus.FINISHED_STOPPED)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("A", "stop")]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.schedule().finished_req_ids == ["A"]
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests(["A"], RequestStatus.RUNNING)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_finishing_many_queued_requests_at_once_keeps_the_rest_in_order(policy):
    """A client leaving ends all its requests in one call (removed in one pass)."""
    scheduler, executor = make_scheduler(max_num_seqs=1, policy=policy)
    for i in range(40):
        priority = 0 if policy == "fcfs" else -(i % 3)
        scheduler.add_request(
            Request(f"{'ab'[i % 2]}{i}", [1, 2, 3], SamplingParams(max_tokens=4), priority=priority)
        )
    run_step(scheduler, executor)
    running = scheduler.running[0].request_id
    kept = [r.request_id for r in scheduler.waiting if r.request_id.startswith("b")]
    leaving = [f"a{i}" for i in range(0, 40, 2)]
    outputs = scheduler.finish_requests(leaving, RequestStatus.FINISHED_ABORTED)
    assert sorted(o.request_id for o in outputs) == sorted(leaving)
    assert [r.request_id for r in scheduler.waiting] == [r for r in kept if r != running]
    assert len(scheduler.waiting) == len(kept) - (running in kept)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, executor)
    assert not scheduler.requests


def test_a_request_without_max_tokens_ends_where_a_cache_smaller_than_the_context_is_full():
    """No max_tokens asks for as many tokens as fit: in a cache of 32 token slots under a
    context of 64, a 20-token prompt gets 13 (its KV then fills the cache), "length"."""
    scheduler, core = make_scheduler(block_size=4, num_blocks=8, max_model_len=64)
    prompt = [5, 6, 7, 8] * 5
    scheduler.add_request(Request("r", prompt, SamplingParams(max_tokens=None, ignore_eos=True)))
    produced, reasons = [], []
    while scheduler.requests:
        for out in run_step(scheduler, core)[1]:
            produced += out.new_token_ids
            reasons.append(out.finish_reason)
    assert produced == reference_generate(prompt, 13, eos=None)[0]
    assert reasons[-1] == "length"
    with pytest.raises(ValueError, match="cache has only 8"):  # the prompt alone cannot fit
        scheduler.add_request(Request("huge", [1] * 40, SamplingParams(max_tokens=None)))


def test_add_request_refuses_what_could_never_run():
    scheduler, _ = make_scheduler(block_size=4, num_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(Request("long", [1] * 65))
    with pytest.raises(ValueError, match="cache has only 8"):
        scheduler.add_request(Request("huge", [1] * 40))
    with pytest.raises(ValueError, match="cache has only 8"):
        # The prompt fits, but prompt + max_tokens - 1 tokens never could.
        scheduler.add_request(Request("grows", [1] * 20, SamplingParams(max_tokens=20)))
    request = Request("fits", [1] * 20, SamplingParams(max_tokens=13))
    scheduler.add_request(request)
    with pytest.raises(ValueError, match="already exists"):
        scheduler.add_request(Request("fits", [1]))
    assert [r.request_id for r in scheduler.waiting] == ["fits"]
    # At most max_model_len tokens: a prompt of exactly max_model_len yields one token.
    scheduler, executor = make_scheduler(block_size=4, num_blocks=16, max_model_len=64)
    scheduler.add_request(Request("edge", [1] * 64, SamplingParams(max_tokens=5)))
    _, outputs = run_step(scheduler, executor)
    assert outputs[0].finished and outputs[0].finish_reason == "length"


def test_request_validation():
    with pytest.raises(ValueError, match="empty"):
        Request("a", [])
    with pytest.raises(ValueError, match="non-negative ints"):
        Request("a", [1, -2])
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1])
    with pytest.raises(ValueError, match="sampling_params"):
        Request("a", [1], {"max_tokens": 3})
    request = Request("a", (5, 6), eos_token_id=2)
    assert (
        request.num_tokens,
        request.num_tokens_with_spec,
        request.num_computed_tokens,
        request.output_token_ids,
        request.spec_token_ids,
        request.num_preemptions,
        request.status,
    ) == (2, 2, 0, [], [], 0, RequestStatus.WAITING)


def test_stats_report_queue_and_cache_state():
    scheduler, executor = make_scheduler(block_size=4, num_blocks=10, max_num_seqs=1)
    scheduler.add_request(Request("A", [1] * 9, SamplingParams(max_tokens=4)))
    scheduler.add_request(Request("B", [1] * 9, SamplingParams(max_tokens=4)))
    run_step(scheduler, executor)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_scheduled_tokens) == (1, 1, 9)
    assert (stats.num_free_blocks, stats.num_blocks) == (7, 10)
    assert stats.kv_cache_usage == pytest.approx(0.3)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (9, 0, 0)
