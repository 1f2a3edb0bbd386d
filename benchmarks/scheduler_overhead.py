"""CPU cost of the scheduler per step: ``schedule()`` + ``update_from_output()``.

Steps run through ``EngineCore.step()`` (its ``schedule`` and ``update`` phase timings).

Workloads (prefix caching on, block size 16):
  * steady: N requests decoding (prompts of 128 tokens, no stops), N = 64, 256, 1024;
  * churn: 256 running, about 1/8 finish every step and as many new ones arrive
    (their 128-token prompts share a 64-token system prefix), so every step admits
    and prefills new requests next to the decodes.
The model's output is a ready-made StepResult (its cost belongs to the executor).
Also measured: msgpack encode + decode of a plan and of a result for 256 decodes.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 200] [--async-scheduling]
        [--kv-events]

With ``--async-scheduling`` each step is planned before the previous one's result is
applied (the engine's default; the scheduler's own default is lockstep). With
``--kv-events`` the scheduler logs its prefix cache's events (``--kv-events-config``), and
each step's time includes packing them into the batch the publisher sends.

Reports medians over steps (and the best of several repeats for the codec).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import timeit
from types import SimpleNamespace

import msgpack

from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.scheduler import Request, Scheduler
from weir.services.scheduler.kv_events import KVEventLog
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.protocol.step import StepPlan, StepResult
from weir.shared.protocol.step_codec import (
    decode_step_plan,
    decode_step_result,
    encode_step_plan,
    encode_step_result,
)
from weir.shared.sampling import SamplingParams

PROMPT_LEN = 128
BLOCK_SIZE = 16


def _prompt(rng: random.Random, prefix: list[int]) -> list[int]:
    return prefix + [rng.randrange(100, 32000) for _ in range(PROMPT_LEN - len(prefix))]


ASYNC_SCHEDULING = False  # set by --async-scheduling
KV_EVENTS = False  # set by --kv-events


def _make_scheduler(num_seqs: int, steps: int) -> Scheduler:
    blocks_per_request = -(-(PROMPT_LEN + steps + 64) // BLOCK_SIZE)
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(2048, num_seqs),
            max_num_seqs=num_seqs,
            max_model_len=4096,
            async_scheduling=ASYNC_SCHEDULING,
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=2 * num_seqs * blocks_per_request),
        KVEventLog(BLOCK_SIZE) if KV_EVENTS else None,
    )


def _send_kv_events(scheduler: Scheduler) -> float:
    """Seconds to pack the step's events as the publisher does (0 without them)."""
    log = scheduler.kv_events
    if log is None or not log.events:
        return 0.0
    start = time.perf_counter()
    msgpack.packb([time.time(), log.take(), 0])
    return time.perf_counter() - start


def instant_core(scheduler: Scheduler, phases: dict[str, float]) -> EngineCore:
    """A core whose executor answers every plan at once: one token for each request whose
    step reaches the end of its prompt (no request here stops on a token)."""

    def execute(plan: StepPlan) -> StepResult:
        cached = plan.cached_requests
        before = dict(zip(cached.req_ids, cached.num_computed_tokens))
        before.update((r.request_id, r.num_computed_tokens) for r in plan.new_requests)
        requests = scheduler.requests
        return StepResult(
            {
                rid: [7]
                for rid, n in plan.num_scheduled_tokens.items()
                if rid in requests and before[rid] + n >= requests[rid].num_prompt_tokens
            }
        )

    return EngineCore(
        scheduler, InProcessExecutor(SimpleNamespace(execute=execute)), phases.__setitem__
    )


def _prefill_all(core: EngineCore) -> None:
    scheduler = core.scheduler
    while len(scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        step_now(core)


def bench_steady(num_seqs: int, steps: int) -> tuple[float, float]:
    rng = random.Random(0)
    scheduler = _make_scheduler(num_seqs, steps)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add_request(Request(f"req-{i}", _prompt(rng, []), params, eos_token_id=2))
    phases: dict[str, float] = {}
    core = instant_core(scheduler, phases)
    _prefill_all(core)
    result = StepResult({r.request_id: [7] for r in scheduler.running})
    core.executor = InProcessExecutor(SimpleNamespace(execute=lambda plan: result))
    # With async scheduling the step planned ahead during the last prefill chunk holds only
    # that chunk's requests: not a steady step.
    step_now(core)
    totals, schedules = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            step = step_now(core)
            assert step is not None and len(step.plan.num_scheduled_tokens) == num_seqs
            totals.append(phases["schedule"] + phases["update"] + _send_kv_events(scheduler))
            schedules.append(phases["schedule"])
    finally:
        gc.enable()
    return statistics.median(totals) * 1e6, statistics.median(schedules) * 1e6


def bench_churn(num_seqs: int, steps: int) -> tuple[float, float, float]:
    rng = random.Random(1)
    scheduler = _make_scheduler(num_seqs, steps)
    system_prefix = [rng.randrange(100, 32000) for _ in range(64)]
    next_id = 0

    def add(count: int) -> None:
        nonlocal next_id
        for _ in range(count):
            params = SamplingParams(max_tokens=rng.randint(4, 12), ignore_eos=True)
            scheduler.add_request(
                Request(f"req-{next_id}", _prompt(rng, system_prefix), params, eos_token_id=2)
            )
            next_id += 1

    add(num_seqs)
    phases: dict[str, float] = {}
    core = instant_core(scheduler, phases)
    totals, running, finished = [], [], 0
    gc.collect()
    gc.disable()
    try:
        for index in range(steps + 20):
            step = step_now(core)
            assert step is not None
            done = sum(o.finished for o in step.outputs)
            add(done)  # replaced next step
            sent = _send_kv_events(scheduler)
            if index >= 20:  # past the initial all-prefill steps
                totals.append(phases["schedule"] + phases["update"] + sent)
                running.append(len(step.plan.num_scheduled_tokens))
                finished += done
    finally:
        gc.enable()
    return (statistics.median(totals) * 1e6, statistics.median(running), finished / steps)


def bench_codec(num_seqs: int) -> dict[str, float]:
    scheduler = _make_scheduler(num_seqs, 64)
    rng = random.Random(2)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add_request(Request(f"cmpl-{i:08x}", _prompt(rng, []), params))
    _prefill_all(instant_core(scheduler, {}))
    plan = scheduler.schedule()
    result = StepResult({rid: [rng.randrange(32000)] for rid in plan.num_scheduled_tokens})
    plan_bytes, result_bytes = encode_step_plan(plan), encode_step_result(result)
    assert decode_step_plan(plan_bytes) == plan and decode_step_result(result_bytes) == result

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=500, repeat=7)) / 500 * 1e6

    timings = {
        "encode_plan": best(lambda: encode_step_plan(plan)),
        "decode_plan": best(lambda: decode_step_plan(plan_bytes)),
        "encode_result": best(lambda: encode_step_result(result)),
        "decode_result": best(lambda: decode_step_result(result_bytes)),
    }
    timings["plan_bytes"] = len(plan_bytes)
    timings["result_bytes"] = len(result_bytes)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--kv-events", action="store_true")
    args = parser.parse_args()
    global ASYNC_SCHEDULING, KV_EVENTS
    ASYNC_SCHEDULING, KV_EVENTS = args.async_scheduling, args.kv_events

    mode = "async scheduling" if ASYNC_SCHEDULING else "lockstep"
    events = ", KV events packed" if KV_EVENTS else ""
    print(
        f"schedule() + update_from_output(), prefix caching on, {mode}{events} (median over steps)"
    )
    print(
        f"{'workload':>16} {'running':>8} {'us/step':>10} {'us/request':>11} {'schedule us/req':>16}"
    )
    for n in (64, 256, 1024):
        total, schedule_only = bench_steady(n, args.steps)
        print(
            f"{'steady decode':>16} {n:>8} {total:>10.1f} {total / n:>11.2f} "
            f"{schedule_only / n:>16.2f}"
        )
    total, running, finished_per_step = bench_churn(256, args.steps)
    print(
        f"{'churn':>16} {running:>8.0f} {total:>10.1f} {total / running:>11.2f} "
        f"{'':>16}  ({finished_per_step:.1f} finish and are replaced per step)"
    )

    codec = bench_codec(256)
    wire = (
        codec["encode_plan"]
        + codec["decode_plan"]
        + codec["encode_result"]
        + codec["decode_result"]
    )
    print("\nwire codec, 256 running decodes (best of 7 x 500)")
    print(
        f"  plan:   encode {codec['encode_plan']:.1f} us, decode {codec['decode_plan']:.1f} us, "
        f"{codec['plan_bytes']:.0f} bytes"
    )
    print(
        f"  result: encode {codec['encode_result']:.1f} us, decode {codec['decode_result']:.1f} us, "
        f"{codec['result_bytes']:.0f} bytes"
    )
    print(f"  plan + result, encode + decode: {wire:.1f} us")


if __name__ == "__main__":
    main()
