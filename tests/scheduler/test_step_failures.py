"""A step that raises on the executor: the request that makes it raise is found by
bisection and fails alone; every other request finishes as if nothing happened."""

import asyncio
import random

import pytest

from weir.services.engine.core import (
    ExecutorLostError,
    InProcessExecutor,
    StepFailedError,
    step_now,
)
from weir.services.scheduler import Request
from weir.shared.config import CacheConfig
from weir.shared.sampling import SamplingParams

from .fake_executor import FakeExecutor, make_scheduler, reference_generate


class PoisonedExecutor(FakeExecutor):
    """Raises whenever a step holds one of ``poison``, from its ``from_step``-th step on."""

    def __init__(self, num_blocks, block_size, poison, from_step=1):
        super().__init__(num_blocks, block_size)
        self.poison, self.from_step = set(poison), from_step
        self.steps = self.failures = 0

    def execute(self, plan):
        self.steps += 1
        if self.steps >= self.from_step and self.poison & set(plan.num_scheduled_tokens):
            self.failures += 1
            raise RuntimeError("poisoned step")
        return super().execute(plan)


def _run(num_requests, poison, from_step=1, seed=0, **kwargs):
    scheduler, core = make_scheduler(block_size=4, num_blocks=200, **kwargs)
    executor = PoisonedExecutor(200, 4, poison, from_step)
    core.executor = InProcessExecutor(executor)
    rng = random.Random(seed)
    prompts = {}
    for i in range(num_requests):
        prompts[f"r{i}"] = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 20))]
        params = SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompts[f"r{i}"], params))
    produced, failed = {}, []
    while core.has_work():
        try:
            step = step_now(core)
        except StepFailedError as exc:
            failed += exc.request_ids
            continue
        for out in step.outputs:
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, prompt in prompts.items():
        if rid not in poison:
            max_tokens = len(produced[rid])
            assert produced[rid] == reference_generate(prompt, max_tokens, eos=None)[0], rid
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not scheduler.requests
    return failed, executor


BOTH_MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["lockstep", "async"])


@BOTH_MODES
@pytest.mark.parametrize("from_step", [1, 3, 6])
def test_one_poisoned_request_among_32_fails_alone_after_a_few_failed_steps(
    from_step, async_scheduling
):
    failed, executor = _run(32, {"r7"}, from_step, async_scheduling=async_scheduling)
    assert failed == ["r7"]
    # log2(32) + 2, not one failure per request (async: the step planned after each
    # failed one runs too, and is discarded).
    assert executor.failures <= 7 * (1 + async_scheduling)


@BOTH_MODES
def test_two_poisoned_requests_both_fail_and_nothing_else(async_scheduling):
    failed, _ = _run(24, {"r3", "r17"}, seed=4, async_scheduling=async_scheduling)
    assert sorted(failed) == ["r17", "r3"]


def test_a_lone_request_whose_step_raises_fails_at_once():
    failed, executor = _run(1, {"r0"})
    assert failed == ["r0"] and executor.failures == 1


def test_bisection_holds_under_the_priority_policy_and_chunked_prefills():
    failed, _ = _run(16, {"r11"}, from_step=2, policy="priority", max_num_batched_tokens=24)
    assert failed == ["r11"]


class _RemoteExecutor:
    """Runs submitted plans in order on later loop turns, as a remote executor answers;
    once ``lost``, every step still to answer fails with ExecutorLostError."""

    def __init__(self, fake: FakeExecutor) -> None:
        self.fake, self.lost = fake, False

    def submit(self, plan):
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(self._answer, plan, future)
        return future

    def _answer(self, plan, future) -> None:
        if self.lost:
            future.set_exception(ExecutorLostError("executor gone"))
        else:
            future.set_result(self.fake.execute(plan))


def test_an_executor_lost_while_a_step_is_planned_ahead_loses_no_token():
    """Async scheduling: the step planned ahead fails while nobody awaits it. The core
    forgets it and the requests resume on a new executor with every token once."""
    scheduler, core = make_scheduler(block_size=4, num_blocks=200, async_scheduling=True)
    rng = random.Random(3)
    prompts = {
        f"r{i}": [rng.randrange(1, 64) for _ in range(rng.randrange(3, 20))] for i in range(6)
    }
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    produced: dict[str, list[int]] = {rid: [] for rid in prompts}

    async def run() -> None:
        core.executor = first = _RemoteExecutor(FakeExecutor(200, 4))
        for _ in range(5):
            for out in (await core.step()).outputs:
                produced[out.request_id] += out.new_token_ids
        first.lost = True
        await asyncio.sleep(0)  # the step planned ahead fails, outside any step()
        core.abandon_next()
        scheduler.reset_executor_state(scheduler.cache_config)
        core.executor = _RemoteExecutor(FakeExecutor(200, 4))
        while core.has_work():
            step = await core.step()
            for out in step.outputs if step else ():
                produced[out.request_id] += out.new_token_ids

    asyncio.run(run())
    for rid, prompt in prompts.items():
        assert produced[rid] == reference_generate(prompt, 12, eos=None)[0], rid


def test_a_request_a_smaller_new_cache_cannot_finish_fails_and_holds_no_one_up():
    """The group that replaced a lost one has fewer blocks (a rank sized its cache from
    less free memory): a request whose longest footprint no longer fits ends with the
    reason, instead of waiting at the head of the queue for ever with everyone behind it."""
    scheduler, core = make_scheduler(block_size=4, num_blocks=12)
    big, small = list(range(1, 19)), [7, 8, 9]
    scheduler.add_request(Request("big", big, SamplingParams(max_tokens=28, ignore_eos=True)))
    scheduler.add_request(Request("small", small, SamplingParams(max_tokens=6, ignore_eos=True)))
    produced: dict[str, list[int]] = {"big": [], "small": []}
    for _ in range(3):
        for out in step_now(core).outputs:
            produced[out.request_id] += out.new_token_ids
    smaller = CacheConfig(block_size=4, num_blocks=10, enable_prefix_caching=True)
    ended = scheduler.reset_executor_state(smaller)
    assert list(ended) == ["big"] and "need 12 blocks but the cache has only 10" in ended["big"]
    core.executor = InProcessExecutor(FakeExecutor(10, 4))
    while core.has_work():
        for out in step_now(core).outputs:
            produced[out.request_id] += out.new_token_ids
    assert produced["small"] == reference_generate(small, 6, eos=None)[0]
    assert "big" not in scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 10
