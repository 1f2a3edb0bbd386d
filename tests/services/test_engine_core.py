"""The engine core with a real ModelRunner in-process: the loop the server runs, without sockets."""

import asyncio
import random

import pytest
from serving_helpers import hf_greedy

from weir.services.engine.core import (
    EngineCore,
    InProcessExecutor,
    StepFailedError,
    step_now,
)
from weir.services.executor.model_runner import ModelRunner
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import StepPlan, StepResult
from weir.shared.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# Bytes per block of the tiny model: K and V x 2 layers x 4 tokens x 2 KV heads x 8 dims x 4 bytes.
KV_BYTES = NUM_BLOCKS * 2 * 2 * BLOCK_SIZE * 2 * 8 * 4


def _core(model_dir, async_scheduling: bool = False) -> EngineCore:
    runner = ModelRunner(
        model_dir,
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=KV_BYTES,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=64,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=16,
            max_num_seqs=8,
            max_model_len=64,
            async_scheduling=async_scheduling,
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=runner.num_blocks),
    )
    return EngineCore(scheduler, InProcessExecutor(runner))


BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["lockstep", "async"])


@BOTH_MODES
def test_greedy_outputs_equal_transformers_through_chunking_and_preemption(
    tiny_model_dir, tiny_hf_model, async_scheduling
):
    core = _core(tiny_model_dir, async_scheduling)
    assert core.scheduler.kv_cache_manager.num_blocks == NUM_BLOCKS
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(Request(f"r{i}", prompt, params))
    produced = {f"r{i}": [] for i in range(len(prompts))}
    chunked = preempted = False
    while core.has_work():
        step = step_now(core)
        assert step.plan.total_num_scheduled_tokens <= 16
        chunked |= len(step.plan.num_scheduled_tokens) > 1 and any(
            n > 1 for n in step.plan.num_scheduled_tokens.values()
        )
        preempted |= bool(step.plan.preempted_req_ids)
        for out in step.outputs:
            produced[out.request_id] += out.new_token_ids
    assert chunked and preempted, "the workload must mix prefill chunks and preempt"
    for i, prompt in enumerate(prompts):
        assert produced[f"r{i}"] == hf_greedy(tiny_hf_model, prompt, 12), f"r{i}"
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


class _Poisoned:
    """A real ModelRunner whose steps raise whenever ``poison`` is in them (a fault no
    validation foresaw), resetting like the executor process does."""

    def __init__(self, runner: ModelRunner, poison: str) -> None:
        self.runner, self.poison = runner, poison
        self.failures = 0

    def execute(self, plan):
        if self.poison in plan.num_scheduled_tokens:
            self.failures += 1
            raise RuntimeError("boom")
        return self.runner.execute(plan)

    def reset(self) -> None:
        self.runner.reset()


def _run_to_completion(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, str]]:
    produced: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    while core.has_work():
        try:
            step = step_now(core)
        except StepFailedError as exc:
            failed.update(dict.fromkeys(exc.request_ids, str(exc)))
            continue
        for out in step.outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    return produced, failed


def test_requests_held_through_a_control_plan_that_failed_lose_nothing(
    tiny_model_dir, tiny_hf_model, tmp_path
):
    """A control plan (new weights, sleep, profiling) that raises on the executor leaves it
    holding no request: the request paused mid-decode (alone: a failed step of one request
    would end it as the culprit) is sent again and finishes as transformers decodes it."""
    core = _core(tiny_model_dir)
    prompts = [[5, 17, 230, 4000, 12]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(Request(f"r{i}", prompt, params))
    produced: dict[str, list[int]] = {}
    for _ in range(4):
        for out in step_now(core).outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    core.paused = True
    with pytest.raises(StepFailedError, match="config.json|No such"):
        asyncio.run(core.control(load_weights=str(tmp_path / "missing")))
    core.scheduler.weights_path = None  # as the front end does: the served weights stay
    core.paused = False
    rest, failed = _run_to_completion(core)
    assert not failed
    for i, prompt in enumerate(prompts):
        tokens = produced.get(f"r{i}", []) + rest.get(f"r{i}", [])
        assert tokens == hf_greedy(tiny_hf_model, prompt, 10), f"r{i}"


@BOTH_MODES
def test_a_step_that_raises_fails_only_the_request_that_made_it_raise(
    tiny_model_dir, tiny_hf_model, async_scheduling
):
    core = _core(tiny_model_dir, async_scheduling)
    poisoned = _Poisoned(core.executor.runner, "r5")
    core.executor = InProcessExecutor(poisoned)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 12))] for _ in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(Request(f"r{i}", prompt, params))
    produced, failed = _run_to_completion(core)
    assert list(failed) == ["r5"] and "boom" in failed["r5"]
    # Bisection, not one retry per request (async: the step planned after each failed one
    # runs too, and is discarded).
    assert poisoned.failures <= 4 * (1 + async_scheduling)
    for i, prompt in enumerate(prompts):
        if i != 5:
            assert produced[f"r{i}"] == hf_greedy(tiny_hf_model, prompt, 10), f"r{i}"
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@BOTH_MODES
def test_a_new_executor_takes_over_every_request_without_a_token_lost_or_repeated(
    tiny_model_dir, tiny_hf_model, async_scheduling
):
    core = _core(tiny_model_dir, async_scheduling)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 20))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.scheduler.add_request(Request(f"r{i}", prompt, params))
    produced: dict[str, list[int]] = {}
    for _ in range(12):  # mid-run: some requests decoding, some prefilling, some waiting
        for out in step_now(core).outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert any(produced.values()) and core.has_work()
    fresh = _core(tiny_model_dir).executor  # a new process: empty batch, empty KV cache
    core.executor = fresh
    core.scheduler.reset_executor_state(
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=fresh.runner.num_blocks)
    )
    rest, failed = _run_to_completion(core)
    assert not failed
    for i, prompt in enumerate(prompts):
        tokens = produced.get(f"r{i}", []) + rest.get(f"r{i}", [])
        assert tokens == hf_greedy(tiny_hf_model, prompt, 12), f"r{i}"


def test_step_now_refuses_an_executor_that_suspends():
    class Remote:
        async def _run(self, plan):
            await asyncio.sleep(0)
            return StepResult()

        def submit(self, plan):
            return self._run(plan)

    scheduler = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=8))
    scheduler.add_request(Request("A", [1, 2]))
    with pytest.raises(RuntimeError, match="event loop"):
        step_now(EngineCore(scheduler, Remote()))


def test_the_next_result_is_in_once_the_executor_answered(tiny_model_dir):
    """What the server's loop asks before publishing: a remote executor's next result has
    come (or comes within the wait); an in-process one runs only when awaited."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        sent: list[tuple[StepPlan, asyncio.Future]] = []

        class Remote:
            def submit(self, plan):
                sent.append((plan, loop.create_future()))
                return sent[-1][1]

        def answer(i: int) -> None:
            plan, future = sent[i]
            future.set_result(
                StepResult({rid: [7] for rid in plan.num_scheduled_tokens}, step_id=plan.step_id)
            )

        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=16, async_scheduling=True),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        )
        core = EngineCore(scheduler, Remote())
        assert not await core.next_result_in(0.001)  # nothing in flight
        scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
        stepping = asyncio.create_task(core.step())
        await asyncio.sleep(0)
        assert len(sent) == 2  # the step and the one planned ahead
        answer(0)
        assert (await stepping).outputs[0].new_token_ids == [7]
        assert len(sent) == 3 and not await core.next_result_in(0.001)
        loop.call_later(0.001, answer, 1)
        assert await core.next_result_in(1.0)  # came within the wait
        assert await core.next_result_in(0.0)

    asyncio.run(run())
    local = _core(tiny_model_dir, async_scheduling=True)
    local.scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    assert step_now(local) is not None and not asyncio.run(local.next_result_in(0.001))
    local.abandon_next()
