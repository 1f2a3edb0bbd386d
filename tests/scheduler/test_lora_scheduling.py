"""LoRA adapters in the scheduler: at most ``max_loras`` adapters run at once (vLLM's rule:
a request of another adapter waits, and those behind it that fit go first), and cached KV
blocks are shared only among requests of the same adapter."""

from weir.services.scheduler import Request
from weir.shared.protocol.step_codec import decode_step_plan, encode_step_plan
from weir.shared.sampling import SamplingParams

from .fake_executor import make_scheduler, run_step

LONG = SamplingParams(max_tokens=50, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


def _prompt(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 60 + 1 for i in range(n)]


def test_a_third_adapter_waits_while_requests_without_one_go_first():
    scheduler, core = make_scheduler(max_loras=2, max_num_batched_tokens=512)
    scheduler.add_request(Request("a", _prompt(8), LONG, lora_name="A"))
    scheduler.add_request(Request("b", _prompt(8, 2), SHORT, lora_name="B"))
    scheduler.add_request(Request("c", _prompt(8, 3), SHORT, lora_name="C"))
    scheduler.add_request(Request("base", _prompt(8, 4), LONG))
    scheduler.add_request(Request("a2", _prompt(8, 5), LONG, lora_name="A"))
    plan, _ = run_step(scheduler, core)
    # a2's adapter runs, but a2 came after c: it does not prolong A's turn ahead of c.
    assert set(plan.num_scheduled_tokens) == {"a", "b", "base"}
    # The plan tells the executor each new request's adapter.
    sent = {
        r.request_id: r.lora_name for r in decode_step_plan(encode_step_plan(plan)).new_requests
    }
    assert sent == {"a": "A", "b": "B", "base": None}
    plan, _ = run_step(scheduler, core)
    assert "c" not in plan.num_scheduled_tokens
    # b's two tokens end it after its prefill step and one decode; then C has a place, and
    # a2 comes in behind c.
    plan, _ = run_step(scheduler, core)
    assert {"c", "a2"} <= set(plan.num_scheduled_tokens)
    assert {r.lora_name for r in scheduler.running} - {None} == {"A", "C"}


def test_a_flow_of_the_running_adapters_requests_does_not_starve_another():
    scheduler, core = make_scheduler(max_loras=1, max_num_batched_tokens=512)
    scheduler.add_request(Request("a0", _prompt(8), SHORT, lora_name="A"))
    run_step(scheduler, core)
    scheduler.add_request(Request("b", _prompt(8, 9), SHORT, lora_name="B"))
    for step in range(1, 6):
        scheduler.add_request(Request(f"a{step}", _prompt(8, step), SHORT, lora_name="A"))
        plan, _ = run_step(scheduler, core)
        if "b" in plan.num_scheduled_tokens:
            break
    assert step == 2  # once a0 ended
    assert {r.lora_name for r in scheduler.running} == {"B"}


def test_the_limit_counts_adapters_not_requests():
    scheduler, core = make_scheduler(max_loras=1, max_num_batched_tokens=512)
    for i in range(4):
        scheduler.add_request(Request(f"a{i}", _prompt(8, i), LONG, lora_name="A"))
    scheduler.add_request(Request("b", _prompt(8, 9), LONG, lora_name="B"))
    plan, _ = run_step(scheduler, core)
    assert set(plan.num_scheduled_tokens) == {"a0", "a1", "a2", "a3"}
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_cached_blocks_are_shared_within_an_adapter_only():
    scheduler, core = make_scheduler(max_loras=2, block_size=4)
    prompt = _prompt(17)
    hits = []
    for rid, lora_name in (("base", None), ("A", "A"), ("A again", "A"), ("B", "B")):
        before = scheduler.stats().prefix_cache_hits
        scheduler.add_request(Request(rid, prompt, SHORT, lora_name=lora_name))
        while scheduler.has_unfinished_requests():
            run_step(scheduler, core)
        hits.append(scheduler.stats().prefix_cache_hits - before)
    # The prompt's 4 whole blocks are cached by each; only the adapter's second request finds them.
    assert hits == [0, 0, 16, 0]
