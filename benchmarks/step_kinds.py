"""Which steps `weir bench throughput`'s workload makes, by the path each takes on a GPU.

    .venv/bin/python benchmarks/step_kinds.py [--num-prompts 512] [--max-num-seqs 256]
        [--max-num-batched-tokens 2048] [--no-async-scheduling]

The real scheduler plans the benchmark's random workload (the same seeded prompt and output
lengths as `weir bench throughput`, all requests at once, every output to its length)
against an executor that answers at once, with enough KV cache that nothing is preempted.
Each step is counted by the CUDA graph shape it replays (`cuda_graphs.StepGraphs`): a decode
shape (every request one new token, padded to a captured request count), a mixed shape
(prefill chunks beside decodes, padded to a captured token count) or none (eager: more
tokens than the largest mixed shape), with the tokens it schedules, the tokens its shape
computes (padding included), its request slots (the requests its shape holds, padding
included: the attention launches a program per slot and KV head, one that returns at once
for a padding slot) and the output tokens it produces. No model runs: what a GPU does with
each kind is for `step_breakdown.py` and `layer_ops.py` to measure.
"""

import argparse
from collections import Counter

from scheduler_overhead import instant_core

from weir.services.bench.workload import RandomWorkload, random_requests
from weir.services.engine.core import step_now
from weir.services.executor.cuda_graphs import graph_shapes
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-async-scheduling", action="store_true")
    args = parser.parse_args()
    workload = RandomWorkload(args.num_prompts, 32, 256, 32, 128, seed=0)
    requests = random_requests(workload, list(range(100, 30000)))
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=4096,
            async_scheduling=not args.no_async_scheduling,
        ),
        CacheConfig(
            block_size=16, num_blocks=sum(len(r.prompt_token_ids) // 16 + 10 for r in requests)
        ),
    )
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", r.prompt_token_ids, params, eos_token_id=2))

    core = instant_core(scheduler, {})
    shapes = graph_shapes(args.max_num_seqs, args.max_num_batched_tokens, (1,))
    decode = [s for s in shapes if not s.mixed]
    mixed = [s for s in shapes if s.mixed]
    steps, tokens, computed, slots, outputs = (Counter[str]() for _ in range(5))
    while (step := step_now(core)) is not None:
        scheduled = step.plan.total_num_scheduled_tokens
        if not scheduled:  # only frees finished requests: the executor launches nothing
            continue
        num_reqs = len(step.plan.num_scheduled_tokens)
        if set(step.plan.num_scheduled_tokens.values()) == {1} and num_reqs <= decode[-1].num_reqs:
            kind, shape = "decode graph", next(s for s in decode if s.num_reqs >= num_reqs)
        elif scheduled <= mixed[-1].num_tokens:
            kind, shape = "mixed graph", next(s for s in mixed if s.num_tokens >= scheduled)
        else:
            kind, shape = "eager", None
        steps[kind] += 1
        tokens[kind] += scheduled
        computed[kind] += scheduled if shape is None else shape.num_tokens
        slots[kind] += num_reqs if shape is None else shape.num_reqs
        outputs[kind] += sum(len(o.new_token_ids) for o in step.outputs)
    print(f"{args.num_prompts} prompts, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"{'lockstep' if args.no_async_scheduling else 'async'} scheduling")  # fmt: skip
    print(
        "| step kind | steps | scheduled tokens | tokens per step | computed (padded) "
        "| request slots | output tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in ("decode graph", "mixed graph", "eager"):
        per_step = tokens[kind] / max(steps[kind], 1)
        print(
            f"| {kind} | {steps[kind]} | {tokens[kind]} | {per_step:.0f} | {computed[kind]} "
            f"| {slots[kind]} | {outputs[kind]} |"
        )


if __name__ == "__main__":
    main()
