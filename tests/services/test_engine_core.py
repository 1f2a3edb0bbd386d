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
from weir.services.scheduler import Request, RequestStatus, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import StepResult
from weir.shared.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# Bytes per block of the tiny model: K and V x 2 layers x 4 tokens x 2 KV heads x 8 dims x 4 bytes.
KV_BYTES = NUM_BLOCKS * 2 * 2 * BLOCK_SIZE * 2 * 8 * 4


def _core(model_dir) -> EngineCore:
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
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=runner.num_blocks),
    )
    return EngineCore(scheduler, InProcessExecutor(runner))


def test_greedy_outputs_equal_transformers_through_chunking_and_preemption(
    tiny_model_dir, tiny_hf_model
):
    core = _core(tiny_model_dir)
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


class _FailingOnce:
    """Raises StepFailedError on its second step, as the executor group does on step_error."""

    def __init__(self) -> None:
        self.calls = 0

    async def execute(self, plan):
        self.calls += 1
        if self.calls == 2:
            raise StepFailedError("rank 0 failed step 2: boom")
        return StepResult({rid: [7] for rid in plan.num_scheduled_tokens})


def test_a_failed_step_ends_what_the_executor_held_and_names_it():
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2),
        CacheConfig(block_size=4, num_blocks=16),
    )
    core = EngineCore(scheduler, _FailingOnce())
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for rid in ("A", "B", "C"):  # max_num_seqs=2: C waits, never scheduled
        scheduler.add_request(Request(rid, [1, 2, 3], params))
    step_now(core)
    with pytest.raises(StepFailedError, match="boom") as failure:
        step_now(core)
    assert sorted(failure.value.request_ids) == ["A", "B"]
    assert sorted(scheduler.requests) == ["C"]
    assert scheduler.kv_cache_manager.num_free_blocks == 16
    step = step_now(core)  # the survivors carry on; the executor learns what ended
    assert sorted(step.plan.finished_req_ids) == ["A", "B"]
    assert list(step.plan.num_scheduled_tokens) == ["C"]
    assert scheduler.requests["C"].status is RequestStatus.RUNNING


def test_step_now_refuses_an_executor_that_suspends():
    class Remote:
        async def execute(self, plan):
            await asyncio.sleep(0)
            return StepResult()

    scheduler = Scheduler(SchedulerConfig(), CacheConfig(num_blocks=8))
    scheduler.add_request(Request("A", [1, 2]))
    with pytest.raises(RuntimeError, match="event loop"):
        step_now(EngineCore(scheduler, Remote()))
