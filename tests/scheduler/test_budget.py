"""Behaviour 1-2: one token budget over running then waiting requests; chunked prefill."""

from weir.services.scheduler import Request, RequestStatus
from weir.shared.sampling import SamplingParams

from .fake_executor import make_scheduler, run_step

LONG = SamplingParams(max_tokens=1000, ignore_eos=True)


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 60 + 1 for i in range(n)]


def test_seed_example_chunked_prefill_mixed_batch():
    # budget 512: A has 400 prompt tokens left, B and C decode, D waits with 300.
    scheduler, executor = make_scheduler(max_num_batched_tokens=512)
    scheduler.add_request(Request("B", _prompt(10, 1), LONG))
    scheduler.add_request(Request("C", _prompt(10, 2), LONG))
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"B": 10, "C": 10}
    scheduler.add_request(Request("A", _prompt(910, 3), LONG))
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"B": 1, "C": 1, "A": 510}
    scheduler.add_request(Request("D", _prompt(300, 4), LONG))

    plan, outputs = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"B": 1, "C": 1, "A": 400, "D": 110}
    assert plan.total_num_scheduled_tokens == 512
    assert [r.request_id for r in plan.new_requests] == ["D"]
    assert plan.cached_requests.req_ids == ["B", "C", "A"]
    # A finished its prompt and sampled; D is mid-prefill and produced nothing.
    assert sorted(o.request_id for o in outputs) == ["A", "B", "C"]
    d = scheduler.requests["D"]
    assert (d.num_computed_tokens, d.num_output_tokens) == (110, 0)

    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"B": 1, "C": 1, "A": 1, "D": 190}


def test_running_requests_are_served_first_in_order():
    scheduler, executor = make_scheduler(max_num_batched_tokens=3)
    for name in "PQRS":
        scheduler.add_request(Request(name, _prompt(1, ord(name)), LONG))
    plan, _ = run_step(scheduler, executor)
    assert list(plan.num_scheduled_tokens) == ["P", "Q", "R"]
    assert [r.request_id for r in scheduler.waiting] == ["S"]
    plan, _ = run_step(scheduler, executor)  # the budget is spent on running decodes
    assert list(plan.num_scheduled_tokens) == ["P", "Q", "R"]


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, executor = make_scheduler(
        max_num_batched_tokens=100, long_prefill_token_threshold=64
    )
    scheduler.add_request(Request("A", _prompt(200), LONG))
    scheduler.add_request(Request("B", _prompt(30, 5), LONG))
    chunks = []
    for _ in range(4):
        plan, _ = run_step(scheduler, executor)
        chunks.append(dict(plan.num_scheduled_tokens))
    assert chunks == [{"A": 64, "B": 30}, {"A": 64, "B": 1}, {"A": 64, "B": 1}, {"A": 8, "B": 1}]


def test_max_num_seqs_caps_the_batch():
    scheduler, executor = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(
            Request(f"r{i}", _prompt(5, i), SamplingParams(max_tokens=2, ignore_eos=True))
        )
    plan, _ = run_step(scheduler, executor)
    assert list(plan.num_scheduled_tokens) == ["r0", "r1"]
    assert len(scheduler.running) == 2
    run_step(scheduler, executor)  # r0, r1 finish (2 tokens each)
    plan, _ = run_step(scheduler, executor)
    assert list(plan.num_scheduled_tokens) == ["r2", "r3"]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_and_blocks_the_queue():
    scheduler, executor = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    scheduler.add_request(Request("A", _prompt(8), SamplingParams(max_tokens=3, ignore_eos=True)))
    run_step(scheduler, executor)
    scheduler.add_request(Request("B", _prompt(64, 3), SamplingParams(max_tokens=1)))
    scheduler.add_request(Request("C", _prompt(4, 9), LONG))  # would fit, must not jump B
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"A": 1}
    assert [r.request_id for r in scheduler.waiting] == ["B", "C"]
    plan, outputs = run_step(scheduler, executor)  # A's last token
    assert plan.num_scheduled_tokens == {"A": 1} and outputs[0].finished
    plan, _ = run_step(scheduler, executor)  # the whole prompt in one step
    assert plan.num_scheduled_tokens == {"B": 64}
    assert scheduler.requests.get("B") is None  # max_tokens=1: done after its prefill
    plan, _ = run_step(scheduler, executor)
    assert plan.num_scheduled_tokens == {"C": 4}


def test_room_under_max_model_len_caps_the_chunk_and_finishes_with_length():
    scheduler, executor = make_scheduler(max_model_len=20, max_num_batched_tokens=64)
    request = Request("A", _prompt(18), LONG)
    scheduler.add_request(request)
    tokens = []
    while scheduler.has_unfinished_requests():
        plan, outputs = run_step(scheduler, executor)
        for out in outputs:
            tokens += out.new_token_ids
    assert len(tokens) == 2 and request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 20
