"""Load time and greedy decode latency of ModelRunner on the default (or a given) model.

    .venv/bin/python benchmarks/model_latency.py [--model DIR] [--batch 1 4] \
        [--quantization int8] [--dtype bfloat16]

"cold" is the first ModelRunner built in a fresh process (weights possibly still in the OS
page cache from an earlier run); "warm" is a second one built in the same process. Decode
latency is the wall time of `ModelRunner.execute` for one decode step, per generated token
of one request, over `--tokens` steps after the prefill.
"""

import argparse
import statistics
import time

import torch

from weir.services.executor.model_runner import ModelRunner
from weir.shared.config import LOAD_FORMATS, QUANTIZATION_METHODS
from weir.shared.model_store import resolve_model
from weir.shared.protocol.step import CachedRequest, NewRequest, StepPlan
from weir.shared.sampling import SamplingParams


def prefill_plan(runner: ModelRunner, batch: int, prompt_len: int, num_tokens: int) -> StepPlan:
    """The first step: `batch` greedy requests r0, r1, ... of `prompt_len` prompt tokens, with
    blocks for `num_tokens` decode steps after it."""
    blocks_per_req = -(-(prompt_len + num_tokens + 1) // runner.block_size)
    params = SamplingParams(max_tokens=num_tokens + 1, temperature=0.0, ignore_eos=True)
    new = [
        NewRequest(
            f"r{i}",
            [(7 * i + j) % 1000 + 10 for j in range(prompt_len)],
            params,
            list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
            0,
        )
        for i in range(batch)
    ]
    return StepPlan({r.request_id: prompt_len for r in new}, batch * prompt_len, new_requests=new)


def decode_plan(batch: int, prompt_len: int, step: int) -> StepPlan:
    """Decode step `step` (1, 2, ...) of every request of `prefill_plan`."""
    ids = [f"r{i}" for i in range(batch)]
    computed = prompt_len + step - 1
    return StepPlan(
        {rid: 1 for rid in ids},
        batch,
        cached_requests=[CachedRequest(rid, [], computed) for rid in ids],
        step_id=step,
    )


def decode_latency(
    runner: ModelRunner,
    batch: int,
    prompt_len: int,
    num_tokens: int,
    profiler: torch.profiler.profile | None = None,
) -> list[float]:
    """Seconds per decode step with `batch` requests of `prompt_len` prompt tokens, greedy.
    A profiler is stepped after each decode step (its schedule leaves out the prefill)."""
    runner.execute(prefill_plan(runner, batch, prompt_len, num_tokens))
    times = []
    for step in range(1, num_tokens + 1):
        start = time.perf_counter()
        runner.execute(decode_plan(batch, prompt_len, step))
        times.append(time.perf_counter() - start)
        if profiler is not None:
            profiler.step()
    runner.execute(StepPlan(finished_req_ids=[f"r{i}" for i in range(batch)]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores available, as an executor takes)",
    )
    parser.add_argument(
        "--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights"
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_METHODS, default=None, help="weights kept quantized"
    )
    parser.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    args = parser.parse_args()

    model_dir = resolve_model(args.model, load_format=args.load_format)
    kwargs = dict(
        device="cpu",
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=4096,
        max_num_seqs=max(args.batch),
        num_threads=args.threads,
        load_format=args.load_format,
        quantization=args.quantization,
        dtype=args.dtype,
    )
    start = time.perf_counter()
    ModelRunner(model_dir, **kwargs)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    runner = ModelRunner(model_dir, **kwargs)
    warm = time.perf_counter() - start
    print(
        f"model {model_dir.name}, torch threads {torch.get_num_threads()}, {runner.precision}, "
        f"quantization {args.quantization or 'none'}"
    )
    print(f"load: cold {cold:.2f} s, warm {warm:.2f} s ({runner.num_blocks} KV blocks)")
    for batch in args.batch:
        times = decode_latency(runner, batch, args.prompt_len, args.tokens)
        print(
            f"batch {batch}: decode step mean {1e3 * statistics.mean(times):.1f} ms, "
            f"median {1e3 * statistics.median(times):.1f} ms "
            f"({1e3 * statistics.median(times) / batch:.1f} ms per token), over {len(times)} steps"
        )


if __name__ == "__main__":
    main()
