"""Where a step's time goes, measured on the real processes through their metrics endpoints.

Starts the engine (scheduler + executor processes, as `LLM` does), runs a workload, and
reads the per-phase histograms before and after it:

  scheduler  weir_scheduler_step_phase_seconds{phase=schedule|plan_encode|executor|update|outputs}
  executor   weir_executor_step_seconds (plan decoded to result encoded)
             weir_executor_phase_seconds{phase=prepare|forward|sample} when the executor has them
             weir_executor_graph_steps_total (steps that replayed a CUDA graph)

IPC = the scheduler's wait for the executor minus the executor's own step time (ZeroMQ,
the kernel, and the wake-ups on both sides). With async scheduling (the default) the
scheduler's work overlaps the executor's and that wait includes the step before; what
counts then is the last lines: the device's busy share of the wall time
(weir_executor_device_busy_seconds), and on a CPU or in lockstep the executor's idle time
between steps (wall time minus the executor's step time), i.e. scheduling + IPC not
hidden behind the executor. On a GPU with async scheduling the executor launches a step
before it finishes the one before, so its step times overlap and only the busy share counts.

    .venv/bin/python benchmarks/step_breakdown.py                 # issue-6 workload, 64 requests
    .venv/bin/python benchmarks/step_breakdown.py --steady        # 64 running decodes
    .venv/bin/python benchmarks/step_breakdown.py --no-async-scheduling   # lockstep loop
    .venv/bin/python benchmarks/step_breakdown.py --device cuda --load-format dummy \
        --model DIR --no-sync-phases    # GPU: no per-phase synchronization, true idle time

On CUDA the executor's phases (prepare, forward, sample) include the device's work only
because the executor synchronizes at each phase boundary, which it does only when asked
(WEIR_SYNC_STEP_TIMING=1, set here unless --no-sync-phases); without it, it waits only for
the sampled tokens, and the phase rows are host times.

--in-process runs the same workload through the same scheduler and model runner (built
from the same engine options, `load_runner`) in this one process instead: no sockets, no
executor process, the runner's steps launched and finished in the executor process's order
(with async scheduling on CUDA one step launched ahead). Its runner phases per step (mean,
median, 90th percentile, largest) against the served run's tell whether a served slowdown
comes from the processes around the runner or from what the workload asks of it.
"""

import argparse
import os
import statistics
import time
import urllib.request
from collections.abc import Awaitable
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from weir.services.bench.workload import (
    RandomWorkload,
    load_tokenizer,
    normal_vocab_ids,
    random_requests,
)
from weir.services.engine.core import EngineCore, step_now
from weir.services.executor.model_runner import (
    SYNC_STEP_TIMING_ENV,
    LaunchedStep,
    ModelRunner,
    StepTimings,
)
from weir.services.executor.worker import load_runner
from weir.services.launcher import with_device_step_limits
from weir.services.llm import LLM
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import LOAD_FORMATS, EngineArgs
from weir.shared.model_config import read_model_config
from weir.shared.model_store import resolve_model
from weir.shared.protocol.step import StepPlan, StepResult
from weir.shared.sampling import SamplingParams


def metric_sums(url: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(metric, phase label or '') -> (sum, count) of every histogram at ``url``, and
    (value, 0) of every counter; (metric, 'PHASE le=BOUND') -> (cumulative count, 0) of each
    histogram bucket."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    sums: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bucket = f"{sample.labels.get('phase', '')} le={sample.labels['le']}"
                entry = sums.setdefault((family.name, bucket), [0.0, 0.0])
                entry[0] += sample.value
            elif sample.name.endswith(("_sum", "_count")) or (
                family.type == "counter" and sample.name.endswith("_total")
            ):
                key = (family.name, sample.labels.get("phase", ""))
                entry = sums.setdefault(key, [0.0, 0.0])
                entry[1 if sample.name.endswith("_count") else 0] += sample.value
    return {k: (v[0], v[1]) for k, v in sums.items()}


def snapshot(urls: list[str]) -> dict[tuple[str, str], tuple[float, float]]:
    merged: dict[tuple[str, str], tuple[float, float]] = {}
    for url in urls:
        merged.update(metric_sums(url))
    return merged


class RecordingExecutor:
    """The executor process's order in this process: a plan is launched when submitted and
    finished when its result is awaited, so with async scheduling (the engine core submits
    step N + 1 before it awaits step N) one step runs ahead, as served on CUDA; otherwise each
    is launched when awaited. Keeps each step's timings."""

    def __init__(self, runner: ModelRunner, launch_ahead: bool) -> None:
        self.runner = runner
        self.launch_ahead = launch_ahead
        self.timings: list[StepTimings] = []

    def submit(self, plan: StepPlan) -> Awaitable[StepResult]:
        if self.launch_ahead:
            return self._finish(self.runner.launch(plan))
        return self._launch_and_finish(plan)

    async def _launch_and_finish(self, plan: StepPlan) -> StepResult:
        return await self._finish(self.runner.launch(plan))

    async def _finish(self, step: LaunchedStep) -> StepResult:
        result = self.runner.finish(step)
        if step.plan.num_scheduled_tokens:
            self.timings.append(step.timings)
        return result


def run_in_process(
    engine_args: EngineArgs,
    runs: list[tuple[list[list[int]], list[SamplingParams]]],
    description: str,
) -> None:
    """``runs`` through one scheduler and one runner in this process; the first warms up, the
    last is measured."""
    runner = load_runner(engine_args)
    rope = read_model_config(runner.model_dir, engine_args.hf_overrides).rope
    scheduler = Scheduler(
        engine_args.scheduler_config(runner.max_model_len),
        engine_args.cache_config(runner.num_blocks, rope.long_prompt_threshold),
    )
    launch_ahead = engine_args.async_scheduling and runner.device.type == "cuda"
    executor = RecordingExecutor(runner, launch_ahead)
    core = EngineCore(scheduler, executor)
    walls = []
    for run, (prompts, params) in enumerate(runs):
        for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            scheduler.add_request(Request(f"run{run}-{i}", prompt, sampling))
        executor.timings.clear()
        runner.device_busy_seconds()
        start = time.perf_counter()
        while core.has_work():
            step_now(core)
        walls.append(time.perf_counter() - start)
    busy = runner.device_busy_seconds()
    timings, walls = executor.timings, walls[1:]
    wall = walls[-1]
    order = "one step launched ahead" if launch_ahead else "each step finished before the next"
    print(
        f"{description}; in one process ({order}); {len(timings)} steps, wall {wall:.2f} s = "
        f"{wall / len(timings) * 1e3:.3f} ms per step, executor threads {runner.num_threads}"
    )
    if len(walls) > 1:
        print(
            f"walls of the {len(walls)} runs (the last measured): {[round(w, 3) for w in walls]} s"
        )
    print("\n| runner phase | mean ms | median | 90th pct | largest | total s |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase in ("prepare", "forward", "sample"):
        ms = sorted(getattr(t, phase) * 1e3 for t in timings)
        print(
            f"| {phase} | {statistics.fmean(ms):.3f} | {statistics.median(ms):.3f} | "
            f"{ms[int(0.9 * (len(ms) - 1))]:.3f} | {ms[-1]:.3f} | {sum(ms) / 1e3:.3f} |"
        )
    print(
        f"\nsteps replayed from CUDA graphs: {sum(t.graphed for t in timings)} of {len(timings)}; "
        f"device busy {busy / wall:.2%} of the wall time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--steady",
        action="store_true",
        help="every request: 32-token prompt, 128 outputs (steady decode at --num-prompts)",
    )
    parser.add_argument("--threads", type=int, default=1, help="executor torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights"
    )
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the workload this many times on one server, measure the last (the walls of "
        "the earlier runs, printed too, tell first-run costs from every run's)",
    )
    parser.add_argument(
        "--profiler-dir",
        default=None,
        help="after the measured run, run the workload again under the executor's "
        "torch.profiler (start_profile/stop_profile) and print its table; the trace stays here",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="the same workload, scheduler and runner in this one process (no executor process)",
    )
    parser.add_argument(
        "--sync-phases",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="executor phase times include the device's work (synchronizes 3x per step on CUDA)",
    )
    args = parser.parse_args()
    # The executor processes inherit it.
    os.environ[SYNC_STEP_TIMING_ENV] = "1" if args.sync_phases else "0"

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = resolve_model(args.model, load_format=args.load_format)
    vocab = normal_vocab_ids(load_tokenizer(model_dir))

    def requests_of_run(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
        """The prompts and sampling parameters of one run (its own prompts: a repeated run
        would otherwise find them in the prefix cache)."""
        spec = RandomWorkload(
            args.num_prompts, 32, 32 if args.steady else 256, 128 if args.steady else 32, 128, seed
        )
        requests = random_requests(spec, vocab)
        return [r.prompt_token_ids for r in requests], [
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            for r in requests
        ]

    options = dict(
        threads=args.threads,
        load_format=args.load_format,
        async_scheduling=args.async_scheduling,
        device=device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
    )
    workload = (
        f"{args.num_prompts} requests, 32-token prompts, 128 outputs"
        if args.steady
        else f"{args.num_prompts} requests, prompts 32-256, outputs 32-128"
    )
    if args.in_process:
        # As the served run: a two-token request first, then the runs.
        warm_up = (
            [[1000, 1001, 1002]],
            [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)],
        )
        run_in_process(
            with_device_step_limits(EngineArgs(model=str(model_dir), **options), offline=True),
            [warm_up] + [requests_of_run(args.seed + run) for run in range(args.repeat)],
            workload,
        )
        return
    with LLM(model=str(model_dir), profiler_dir=args.profiler_dir, **options) as llm:
        urls = [llm.server_info["metrics_address"]] + [
            e["metrics_address"] for e in llm.server_info["executors"]
        ]
        llm.generate(
            [[1000, 1001, 1002]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        )
        walls = []
        for run in range(args.repeat):
            prompts, params = requests_of_run(args.seed + run)
            before = snapshot(urls)
            start = time.perf_counter()
            llm.generate(prompts, params)
            walls.append(time.perf_counter() - start)
            after = snapshot(urls)
        wall = walls[-1]
        if args.profiler_dir is not None:
            llm.start_profile()
            llm.generate(*requests_of_run(args.seed + args.repeat))
            llm.stop_profile()

    def delta(metric: str, phase: str = "") -> tuple[float, float]:
        s1, c1 = after.get((metric, phase), (0.0, 0.0))
        s0, c0 = before.get((metric, phase), (0.0, 0.0))
        return s1 - s0, c1 - c0

    steps = delta("weir_scheduler_step_phase_seconds", "executor")[1]
    ms = {
        phase: delta("weir_scheduler_step_phase_seconds", phase)[0] / steps * 1e3
        for phase in ("schedule", "plan_encode", "executor", "update", "outputs")
    }
    executor_ms = delta("weir_executor_step_seconds")[0] / steps * 1e3
    runner = {
        phase: delta("weir_executor_phase_seconds", phase)[0] / steps * 1e3
        for phase in ("prepare", "forward", "sample")
    }
    total = sum(ms.values())
    rows = [
        ("scheduling: schedule()", ms["schedule"]),
        ("scheduling: update_from_output()", ms["update"]),
        ("scheduling: detokenize + push outputs", ms["outputs"]),
        ("IPC: plan encode", ms["plan_encode"]),
        ("IPC: transport + result decode", ms["executor"] - executor_ms),
    ]
    if any(runner.values()):
        rows += [(f"executor: {phase}", runner[phase]) for phase in runner]
        rows.append(("executor: plan decode, result encode", executor_ms - sum(runner.values())))
    else:
        rows.append(("executor: step (decode plan .. encode result)", executor_ms))
    mode = "async scheduling" if args.async_scheduling else "lockstep"
    mode += ", eager" if args.enforce_eager else ""
    mode += "" if args.sync_phases else ", phases unsynchronized"
    print(
        f"{workload}; {mode}; {steps:.0f} steps, {total:.2f} ms per step (scheduler's view), "
        f"executor threads {args.threads}"
    )
    if args.repeat > 1:
        print(
            f"walls of the {args.repeat} runs (the last measured): {[round(w, 3) for w in walls]} s"
        )
    print()
    print("| part | ms per step | share |\n|---|---:|---:|")
    for name, value in rows:
        print(f"| {name} | {value:.3f} | {value / total:.1%} |")
    overhead = (
        ms["schedule"]
        + ms["update"]
        + ms["outputs"]
        + ms["plan_encode"]
        + ms["executor"]
        - executor_ms
    )
    print(f"\nscheduling + IPC: {overhead:.3f} ms per step = {overhead / total:.2%} of the step")
    wall_ms = wall / steps * 1e3
    busy_ms = delta("weir_executor_device_busy_seconds")[0] / steps * 1e3
    print(
        f"wall {wall:.2f} s = {wall_ms:.3f} ms per step; device busy {busy_ms:.3f} ms per step "
        f"= {busy_ms / wall_ms:.2%} of the wall time (weir_executor_device_busy_seconds)"
    )
    graphed, executor_steps = (
        delta("weir_executor_graph_steps")[0],
        delta("weir_executor_step_seconds")[1],
    )
    print(f"steps replayed from CUDA graphs: {graphed:.0f} of {executor_steps:.0f}")
    # A few slow steps (a compilation, a large prefill) raise the means above: how many
    # steps fell in each bucket tells them from a slowdown of every step.
    for metric, phase in (
        ("weir_executor_step_seconds", ""),
        ("weir_executor_phase_seconds", "forward"),
    ):
        bounds = sorted(
            (float(bucket.split("le=")[1]), bucket)
            for name, bucket in after
            if name == metric and bucket.startswith(f"{phase} le=")
        )
        counts, below = [], 0.0
        for bound, bucket in bounds:
            cumulative = delta(metric, bucket)[0]
            if cumulative > below:
                counts.append(f"<= {bound * 1e3:g} ms: {cumulative - below:.0f}")
            below = cumulative
        label = "executor step" if not phase else f"executor {phase}"
        print(f"{label}, steps per bucket: {', '.join(counts)}")
    compiles, compile_seconds = (
        delta("weir_executor_kernel_compiles")[0],
        delta("weir_executor_kernel_compile_seconds")[0],
    )
    print(
        f"Triton kernels compiled while measured: {compiles:.0f}, {compile_seconds:.2f} s "
        "(weir_executor_kernel_compiles: included in the step times above)"
    )
    if not (args.async_scheduling and device == "cuda"):
        # Steps do not overlap on the executor here, so its idle time is what its step time
        # leaves of the wall time.
        idle = wall_ms - executor_ms
        print(
            f"executor idle between steps (not hidden): {idle:.3f} ms per step = "
            f"{idle / wall_ms:.2%} of the wall time"
        )
    if args.profiler_dir is not None:
        (table,) = sorted(Path(args.profiler_dir).glob("executor0-*.txt"))[-1:]
        print(f"\nThe workload again under torch.profiler ({table}):\n{table.read_text()}")


if __name__ == "__main__":
    main()
