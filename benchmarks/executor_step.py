"""Offline throughput of the executor alone (ModelRunner.execute), with a breakdown of step time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/executor_step.py [--threads 1] [--repeats 2]
        [--loras N --lora-rank R --lora-share F] [--dtype bfloat16 | --quantization int8]

The workload is `weir bench throughput`'s default: 64 requests with seeded random prompts of
32-256 tokens and outputs of 32-128 tokens, greedy, EOS ignored. Step plans come from the
real token-budget Scheduler run in the same process (max_num_batched_tokens 2048, chunked
prefill), so the executor sees what it sees when served; scheduler time is measured apart and
left out of the executor's tokens/s (it runs in its own process when served).

Step time is split into: input preparation (applying the plan diff, building the flat batch,
the attention backend's per-step plan), KV writes, attention, logits (LM head), sampling
(including turning sampled tokens into the step result) and the rest of the forward pass
("other_forward": matmuls, norms, RoPE, embeddings). The parts are timed by wrapping the
runner's components; "other_forward" is the step time the wrapped parts leave.
`--profile decode` (or `prefill`) prints torch.profiler's table of the top operators over ten
steps of that kind. `--loras N` serves N random LoRA adapters of rank `--lora-rank` on every
projection; a `--lora-share` of the requests (round robin) runs through one of them.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from weir.services.bench.workload import (
    RandomWorkload,
    load_tokenizer,
    normal_vocab_ids,
    random_requests,
)
from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.executor.model_runner import ModelRunner
from weir.services.scheduler import Request, Scheduler
from weir.shared.arith import cdiv
from weir.shared.config import LOAD_FORMATS, QUANTIZATION_METHODS, CacheConfig, SchedulerConfig
from weir.shared.lora import LoraModule
from weir.shared.model_config import read_model_config
from weir.shared.model_store import resolve_model
from weir.shared.protocol.step import StepPlan, StepResult
from weir.shared.sampling import SamplingParams

PARTS = ("prepare", "kv_write", "attention", "logits", "sampling", "other_forward")


class Timers:
    """Wall time per part, summed over calls (the wrapped components never call each other)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return timed


class TimedAttention:
    """Forwards to the runner's attention backend, timing its two calls."""

    def __init__(self, backend: Any, timers: Timers) -> None:
        self.name = backend.name
        self.prepare = timers.wrap("prepare", backend.prepare)
        self.write_kv = timers.wrap("kv_write", backend.write_kv)
        self.attend = timers.wrap("attention", backend.attend)


def instrument(runner: ModelRunner, timers: Timers) -> None:
    batch = runner.batch
    batch.apply_plan = timers.wrap("prepare", batch.apply_plan)
    batch.prepare_inputs = timers.wrap("prepare", batch.prepare_inputs)
    attention = TimedAttention(runner.attention, timers)
    runner.model.attention = attention
    for layer in runner.model.layers:
        layer.attention = attention
    runner.model.compute_logits = timers.wrap("logits", runner.model.compute_logits)
    runner.sampler = timers.wrap("sampling", runner.sampler)
    runner._collect = timers.wrap("sampling", runner._collect)


def random_adapter(model_dir: str, out: str, rank: int, seed: int) -> LoraModule:
    """A PEFT-format LoRA adapter of rank ``rank`` on every projection, random weights."""
    cfg = read_model_config(model_dir)
    modules = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    modules += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in modules:
            rows, columns = cfg.layer_tensor_shape(module)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, columns, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.02
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return LoraModule(f"lora{seed}", out)


def run_workload(
    runner: ModelRunner,
    requests: list,
    max_num_batched_tokens: int,
    timers: Timers,
    before_step: Callable[[str], None] | None = None,
    sampling: dict[str, Any] | None = None,
    lora_names: list[str | None] | None = None,
) -> dict:
    block_size = runner.block_size
    num_blocks = (
        sum(cdiv(len(r.prompt_token_ids) + r.output_len, block_size) for r in requests) + 16
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=256,
            max_model_len=runner.max_model_len,
            max_loras=len(runner.loras.ids),
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=min(num_blocks, runner.num_blocks),
            enable_prefix_caching=False,
        ),
    )
    for i, r in enumerate(requests):
        params = SamplingParams(
            max_tokens=r.output_len, temperature=0.0, ignore_eos=True, **(sampling or {})
        )
        lora_name = lora_names[i % len(lora_names)] if lora_names else None
        scheduler.add_request(
            Request(f"req-{i}", r.prompt_token_ids, params, eos_token_id=2, lora_name=lora_name)
        )
    # Per step kind: "prefill" steps hold at least one prompt chunk, "decode" steps only decodes.
    kinds = {k: dict(seconds=0.0, steps=0, parts=defaultdict(float)) for k in ("prefill", "decode")}
    totals = defaultdict(float)

    def execute(plan: StepPlan) -> StepResult:
        if not plan.num_scheduled_tokens:  # only tells the executor what finished
            return runner.execute(plan)
        kind_name = (
            "prefill"
            if plan.total_num_scheduled_tokens > len(plan.num_scheduled_tokens)
            else "decode"
        )
        if before_step is not None:
            before_step(kind_name)
        timers.seconds.clear()
        start = time.perf_counter()
        result = runner.execute(plan)
        seconds = time.perf_counter() - start
        totals["output_tokens"] += sum(map(len, result.sampled_token_ids.values()))
        kind = kinds[kind_name]
        kind["seconds"] += seconds
        kind["steps"] += 1
        for part in PARTS[:-1]:
            kind["parts"][part] += timers.seconds[part]
        kind["parts"]["other_forward"] += seconds - sum(timers.seconds.values())
        return result

    def observe_phase(phase: str, seconds: float) -> None:
        totals["scheduler_s"] += seconds

    core = EngineCore(scheduler, InProcessExecutor(SimpleNamespace(execute=execute)), observe_phase)
    while core.has_work():
        step_now(core)
    step_now(core)  # the last plan tells the executor that the remaining requests finished
    executor_s = sum(k["seconds"] for k in kinds.values())
    return dict(
        executor_s=executor_s,
        scheduler_s=totals["scheduler_s"],
        output_tokens=int(totals["output_tokens"]),
        kinds=kinds,
    )


class StepProfiler:
    """torch.profiler over the first `num_steps` steps of one kind (prefill or decode)."""

    def __init__(self, kind: str, num_steps: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.kind, self.steps_left = kind, num_steps
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.running = False

    def __call__(self, kind: str) -> None:
        """Called before each step with that step's kind."""
        if self.running and (kind != self.kind or not self.steps_left):
            self.profiler.stop()
            self.running = False
            self.steps_left = 0
        elif not self.running and kind == self.kind and self.steps_left:
            self.profiler.start()
            self.running = True
        if self.running:
            self.steps_left -= 1

    def finish(self) -> None:
        if self.running:
            self.profiler.stop()
            self.running = False


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores available, as an executor takes)",
    )
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of the whole workload")
    parser.add_argument(
        "--profile",
        choices=("prefill", "decode"),
        default=None,
        help="print torch.profiler's operator table over 10 steps of this kind and exit",
    )
    parser.add_argument(
        "--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights"
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="every request with presence, frequency and repetition penalties and 100 logit biases",
    )
    parser.add_argument("--loras", type=int, default=0, help="random LoRA adapters served")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--lora-share", type=float, default=1.0, help="fraction of requests with an adapter"
    )
    args = parser.parse_args()
    sampling = (
        {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.1,
            "logit_bias": {token: -1.0 for token in range(1000, 1100)},
        }
        if args.penalties
        else None
    )

    model_dir = resolve_model(args.model, load_format=args.load_format)
    adapters = [
        random_adapter(str(model_dir), tempfile.mkdtemp(), args.lora_rank, seed)
        for seed in range(args.loras)
    ]
    # Round robin over 20 requests: the share of them with an adapter, the adapters in turn.
    with_adapter = round(20 * args.lora_share) if adapters else 0
    lora_names = [adapters[i % len(adapters)].name for i in range(with_adapter)] + [None] * (
        20 - with_adapter
    )
    runner = ModelRunner(
        model_dir,
        device="cpu",
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=256,
        attention_backend=args.attention_backend,
        num_threads=args.threads,
        load_format=args.load_format,
        loras=adapters,
        max_lora_rank=max(args.lora_rank, 16),
    )
    spec = RandomWorkload(args.num_prompts, 32, 256, 32, 128, args.seed)
    requests = random_requests(spec, normal_vocab_ids(load_tokenizer(model_dir)))
    if args.profile:
        profiler = StepProfiler(args.profile, 10)
        run_workload(
            runner,
            requests,
            args.max_num_batched_tokens,
            Timers(),
            profiler,
            sampling,
            lora_names,
        )
        profiler.finish()
        print(profiler.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    timers = Timers()
    instrument(runner, timers)
    # Warmup: lazy initialisation and allocator growth stay out of the timed runs.
    run_workload(
        runner,
        [type(r)(r.prompt_token_ids, 4) for r in requests[:8]],
        args.max_num_batched_tokens,
        timers,
    )

    print(
        f"model {model_dir.name}, {runner.precision}, attention {runner.attention.name}, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
        + (
            f", {len(adapters)} LoRA adapters of rank {args.lora_rank} on "
            f"{with_adapter}/20 of the requests"
            if adapters
            else ""
        )
    )
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    print(
        f"{len(requests)} requests, {prompt_tokens} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens"
    )
    runs = []
    for i in range(args.repeats):
        run = run_workload(
            runner,
            requests,
            args.max_num_batched_tokens,
            timers,
            sampling=sampling,
            lora_names=lora_names,
        )
        runs.append(run)
        print(
            f"run {i}: {run['output_tokens'] / run['executor_s']:.1f} output tok/s "
            f"({run['executor_s']:.2f} s executor, {run['scheduler_s']:.2f} s scheduler, "
            f"load {os.getloadavg()[0]:.2f})"
        )
        for name, kind in run["kinds"].items():
            steps = max(kind["steps"], 1)
            print(
                f"  {kind['steps']:3d} {name} steps, {kind['seconds']:6.2f} s, per step ms: "
                + ", ".join(f"{p} {1e3 * kind['parts'][p] / steps:.1f}" for p in PARTS)
            )
    rates = [r["output_tokens"] / r["executor_s"] for r in runs]
    with_scheduler = [r["output_tokens"] / (r["executor_s"] + r["scheduler_s"]) for r in runs]
    print(
        f"median {statistics.median(rates):.1f} output tok/s over {len(runs)} runs (executor only; "
        f"with the scheduler in the same process {statistics.median(with_scheduler):.1f})"
    )


if __name__ == "__main__":
    main()
