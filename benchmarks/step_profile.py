"""Where a decode step's device time goes: torch.profiler's kernel table over steady decode
steps of ModelRunner, with CUDA graphs (at each KV cache size given) and eagerly (at the first).

    python benchmarks/step_profile.py --model DIR --load-format dummy --dtype bfloat16 \
        --batch 256 --kv-cache-gib 4 40

Per configuration: the median wall time of a decode step (ModelRunner.execute waits for the
step's tokens, so this is the step's whole time), and the kernels that took the most device
time over the profiled steps (kernels replayed inside a CUDA graph are listed as CUPTI
reports them). A step whose time grows with the KV cache size touches the whole cache.
Then, at the first size, the host's side of a decode step, each finished before the next is
launched and overlapped as served: its phases, and the mean host time of the runner's parts
(HOST_PARTS: plan, inputs, staging, replay, sampling, collecting) that a GPU waits for when
the host is slower than it.
"""

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
from executor_step import Timers
from model_latency import decode_latency, decode_plan, prefill_plan

from weir.services.executor import model_runner
from weir.services.executor.model_runner import GRAPH_COPIES, ModelRunner
from weir.shared.config import LOAD_FORMATS
from weir.shared.model_store import resolve_model
from weir.shared.protocol.step import StepPlan


def profile_decodes(runner: ModelRunner, batch: int, prompt_len: int, rows: int) -> None:
    on_cuda = runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=2, warmup=2, active=8)
    with torch.profiler.profile(activities=activities, schedule=schedule) as profiler:
        times = decode_latency(runner, batch, prompt_len, 12, profiler=profiler)
    print(f"  decode step: median {1e3 * statistics.median(times[4:]):.2f} ms over 8 steps")
    print(
        profiler.key_averages().table(
            sort_by="self_device_time_total" if on_cuda else "self_cpu_time_total",
            row_limit=rows,
            max_name_column_width=70,
        )
    )


# The runner's parts of a step timed on the host (attributes of the runner, its batch, graphs
# and model: each wrapped for one host_phases call).
HOST_PARTS = (
    ("batch", "apply_plan", "apply plan"),
    ("batch", "prepare_inputs", "prepare inputs"),
    ("runner", "_feed", "feed sampled tokens"),
    ("graphs", "stage", "stage inputs"),
    ("graphs", "forward", "replay"),
    ("runner", "_sampling_batch", "sampling parameters"),
    ("model", "compute_logits", "LM head"),
    ("runner", "sampler", "sampler"),
    ("runner", "_collect", "collect"),
)


@contextlib.contextmanager
def timed_parts(runner: ModelRunner) -> Iterator[Timers]:
    """Time HOST_PARTS while inside (host times: nothing waits for the device)."""
    timers = Timers()
    owners = {
        "runner": runner,
        "batch": runner.batch,
        "graphs": runner.graphs,
        "model": runner.model,
    }
    wrapped = []
    for owner_name, attribute, part in HOST_PARTS:
        owner = owners[owner_name]
        if owner is not None:
            own = attribute in vars(owner)  # an instance attribute (the sampler), not a method
            original = getattr(owner, attribute)
            object.__setattr__(owner, attribute, timers.wrap(part, original))
            wrapped.append((owner, attribute, original if own else None))
    try:
        yield timers
    finally:
        for owner, attribute, original in wrapped:
            if original is None:
                object.__delattr__(owner, attribute)
            else:
                object.__setattr__(owner, attribute, original)


def host_phases(runner: ModelRunner, batch: int, prompt_len: int, overlap: bool) -> str:
    """Median host milliseconds of a decode step's phases and the wall time per step, each step
    finished before the next is launched, or (``overlap``, as the executor serves async
    scheduling) launched before the previous one is finished; then the mean host milliseconds
    per step of the runner's parts (HOST_PARTS) over the same steps."""
    steps = 24
    runner.execute(prefill_plan(runner, batch, prompt_len, steps))
    launches: list[float] = []
    timings = []
    pending = None
    with timed_parts(runner) as timers:
        began = time.perf_counter()
        for step in range(1, steps + 1):
            if step == 5:  # the first steps are left out, as of the medians below
                timers.seconds.clear()
            start = time.perf_counter()
            launched = runner.launch(decode_plan(batch, prompt_len, step))
            launches.append(time.perf_counter() - start)
            timings.append(launched.timings)
            if overlap:
                if pending is not None:
                    runner.finish(pending)
                pending = launched
            else:
                runner.finish(launched)
        if pending is not None:
            runner.finish(pending)
        wall = (time.perf_counter() - began) / steps
    runner.execute(StepPlan(finished_req_ids=[f"r{i}" for i in range(batch)]))

    def ms(values: list[float]) -> str:
        return f"{1e3 * statistics.median(values[4:]):.2f}"

    parts = ", ".join(
        f"{part} {1e3 * seconds / (steps - 4):.3f}" for part, seconds in timers.seconds.items()
    )
    return (
        f"wall {1e3 * wall:.2f} ms/step; launch {ms(launches)} (prepare "
        f"{ms([t.prepare for t in timings])}, forward {ms([t.forward for t in timings])}), "
        f"finish+sample {ms([t.sample for t in timings])}\n"
        f"    host parts, mean ms per step: {parts}"
    )


def staging_calls(runner: ModelRunner, batch: int, prompt_len: int) -> float:
    """Torch operators called per overlapped decode step to feed the tokens sampled the step
    before and stage the graph's inputs: each a dispatch on the host, on CUDA most of them a
    driver call too (torch.profiler's operators called directly inside the two)."""
    graphs = runner.graphs
    assert graphs is not None
    steps = 6

    def tagged(function):
        def run(*args, **kwargs):
            with torch.profiler.record_function("staging"):
                return function(*args, **kwargs)

        return run

    scatter = model_runner._scatter
    graphs.stage, model_runner._scatter = tagged(graphs.stage), tagged(scatter)
    runner._feed = tagged(runner._feed)  # type: ignore[method-assign]
    try:
        runner.execute(prefill_plan(runner, batch, prompt_len, steps + 1))
        pending = runner.launch(decode_plan(batch, prompt_len, 1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for step in range(2, steps + 2):
                launched = runner.launch(decode_plan(batch, prompt_len, step))
                runner.finish(pending)
                pending = launched
        runner.finish(pending)
        runner.execute(StepPlan(finished_req_ids=[f"r{i}" for i in range(batch)]))
    finally:
        del graphs.stage, runner._feed  # the methods again
        model_runner._scatter = scatter
    calls = sum(
        event.name.startswith("aten::")
        and event.cpu_parent is not None
        and event.cpu_parent.name == "staging"
        for event in profiler.events()
    )
    return calls / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, nargs="+", default=[4.0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (as --threads)")
    parser.add_argument("--rows", type=int, default=14, help="kernels listed per configuration")
    args = parser.parse_args()

    model_dir = resolve_model(args.model, load_format=args.load_format)
    for i, gib in enumerate(args.kv_cache_gib):
        # Eagerly at the first size only: a cache size changes what both modes run alike.
        for enforce_eager in (False, True) if i == 0 else (False,):
            runner = ModelRunner(
                model_dir,
                device=args.device,
                dtype=args.dtype,
                kv_cache_memory_bytes=int(gib * 2**30) or None,  # 0: as served (profiled)
                max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                max_num_seqs=args.batch,
                load_format=args.load_format,
                enforce_eager=enforce_eager,
                num_threads=args.threads,
            )
            if runner.graphs is None and not enforce_eager:
                # A CPU's dry run: the graphs' padded buffers, run eagerly, for their host parts.
                runner.capture_graphs(capture=False)
            mode = "eager" if enforce_eager else "CUDA graphs"
            print(f"== {mode}, KV cache {gib} GiB ({runner.num_blocks} blocks), {runner.precision}")
            profile_decodes(runner, args.batch, args.prompt_len, args.rows)
            if i == 0 and runner.graphs is not None:
                calls = staging_calls(runner, args.batch, args.prompt_len)
                print(f"  torch calls per overlapped decode step, feeding and staging: {calls:.0f}")
            if i == 0:
                # With graphs: the default copies (GRAPH_COPIES), then each graph captured once.
                for copies in (GRAPH_COPIES, 1) if runner.graphs is not None else (GRAPH_COPIES,):
                    if copies != GRAPH_COPIES:
                        runner.capture_graphs(copies, capture=args.device == "cuda")
                    for overlap in (False, True):
                        phases = host_phases(runner, args.batch, args.prompt_len, overlap)
                        label = f"{copies} graph copies, " if runner.graphs is not None else ""
                        mode = "overlapped" if overlap else "lockstep"
                        print(f"  {label}{mode}: {phases}")
            del runner
            if args.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
