"""One engine-core workload run by every rank of a tensor-parallel group (or by one process
at tensor_parallel_size 1), for the tensor-parallel tests.

Each rank drives its own Scheduler + EngineCore over its ModelRunner shard. The schedulers
see the same requests and, through rank 0's broadcast, the same sampled tokens, so every
rank plans and executes the same steps in lockstep: the collectives line up.
"""

import multiprocessing
import os
from dataclasses import dataclass, field

from weir.services.cpu_cores import available_cpus, plan_cpus
from weir.services.engine.core import EngineCore, InProcessExecutor, step_now
from weir.services.engine.ngram import NgramProposer
from weir.services.executor.model_runner import ModelRunner
from weir.services.launcher import free_port
from weir.services.scheduler import Request, Scheduler
from weir.shared.config import CacheConfig, SchedulerConfig
from weir.shared.lora import LoraModule
from weir.shared.sampling import SamplingParams

BLOCK_SIZE = 4
RANK_TIMEOUT_S = 300
BUDGET = 16  # max_num_batched_tokens: long prompts are chunked


@dataclass(slots=True)
class Workload:
    model_dir: str
    prompts: list[list[int]]
    max_tokens: int
    num_blocks: int  # small enough that requests preempt each other
    num_speculative_tokens: int = 0  # n-gram drafts, verified in the same forward pass
    loras: list[str] = field(default_factory=list)  # LoRA adapters, name=path
    lora_names: list[str | None] | None = None  # each prompt's adapter (None: all base)
    one_at_a_time: bool = False  # each request added once the one before it has ended
    async_scheduling: bool = False  # step N+1 planned before step N's tokens are known
    images: list[list[bytes]] | None = None  # each prompt's images (its image tokens' features)
    image_starts: list[list[int]] | None = None  # where each image's tokens begin


@dataclass(slots=True)
class RankReport:
    rank: int
    outputs: dict[str, list[int]] = field(default_factory=dict)
    chunked: bool = False
    preempted: bool = False
    draft_tokens: int = 0
    prefix_cache_hits: int = 0  # prompt tokens found in the prefix cache
    forwards: int = 0  # steps that ran the model
    sampling_steps: int = 0  # steps that computed logits
    all_reduces: int = 0
    gathers: int = 0
    broadcasts: int = 0
    num_layers: int = 0
    error: str | None = None


def _counting(collective, report: RankReport, counter: str):
    def call(*args):
        setattr(report, counter, getattr(report, counter) + 1)
        return collective(*args)

    return call


def run(work: Workload, world_size: int = 1, rank: int = 0) -> RankReport:
    runner = ModelRunner(
        work.model_dir,
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        max_model_len=256,
        tensor_parallel_size=world_size,
        rank=rank,
        # The ranks share the machine's cores as served: with every core each, two ranks on
        # two cores spin-waited for each other's (a tiny model's matmul took 2.7 ms, not 10 us).
        num_threads=plan_cpus(available_cpus(), world_size).executor_threads,
        loras=[LoraModule.parse(spec) for spec in work.loras],
    )
    report = RankReport(rank, num_layers=runner.config.num_layers)
    if runner.tp is not None:
        # Count the collectives the model calls, by wrapping the object it calls them on.
        for method, counter in (
            ("all_reduce", "all_reduces"),
            ("gather_logits", "gathers"),
            ("broadcast_tokens", "broadcasts"),
        ):
            setattr(runner.tp, method, _counting(getattr(runner.tp, method), report, counter))
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=BUDGET,
            max_num_seqs=8,
            max_model_len=256,
            num_speculative_tokens=work.num_speculative_tokens,
            max_loras=len(work.loras),
            async_scheduling=work.async_scheduling,
        ),
        CacheConfig(
            block_size=BLOCK_SIZE,
            num_blocks=work.num_blocks,
            long_prompt_threshold=runner.config.rope.long_prompt_threshold,
            enable_prefix_caching=runner.config.caches_prefixes,
        ),
    )
    k = work.num_speculative_tokens
    proposer = NgramProposer(k, 1, 3) if k else None
    core = EngineCore(scheduler, InProcessExecutor(runner), proposer=proposer)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    lora_names = work.lora_names or [None] * len(work.prompts)
    images = work.images or [[]] * len(work.prompts)
    starts = work.image_starts or [[]] * len(work.prompts)
    requests = [
        Request(f"r{i}", prompt, params, lora_name=lora_name, images=pics, image_starts=firsts)
        for i, (prompt, lora_name, pics, firsts) in enumerate(
            zip(work.prompts, lora_names, images, starts, strict=True)
        )
    ]
    for batch in [[r] for r in requests] if work.one_at_a_time else [requests]:
        for request in batch:
            scheduler.add_request(request)
            report.outputs[request.request_id] = []
        _run_to_completion(core, report)
    stats = scheduler.stats()
    report.draft_tokens = stats.spec_decode.num_draft_tokens
    report.prefix_cache_hits = stats.prefix_cache_hits
    return report


def _run_to_completion(core: EngineCore, report: RankReport) -> None:
    while core.has_work():
        step = step_now(core)
        plan = step.plan
        report.chunked |= len(plan.num_scheduled_tokens) > 1 and any(
            n > 1 for n in plan.num_scheduled_tokens.values()
        )
        report.preempted |= bool(plan.preempted_req_ids)
        if plan.total_num_scheduled_tokens:
            report.forwards += 1
        if step.outputs and any(out.new_token_ids for out in step.outputs):
            report.sampling_steps += 1
        for out in step.outputs:
            report.outputs[out.request_id] += out.new_token_ids


def run_rank(work: Workload, world_size: int, rank: int, port: int, results) -> None:
    """A rank process: join the group through env://, run the workload, report."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put(run(work, world_size, rank))
    except Exception as exc:
        results.put(RankReport(rank, error=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks fork from a server process that imported torch and Weir once: a spawned rank imports
# them anew (1.4 s to start a rank on two cores, 0.02 s forked). Forked from the test process
# itself, a rank would inherit its threads and whatever state earlier tests left. The server
# preloads Weir's modules by their installed names: Python 3.11's forkserver does not take the
# tests' sys.path, so this module's own name failed to import there, silently, and every rank
# imported torch and Weir itself (~6 s a group on a pytest-xdist worker's one core).
_RANKS = multiprocessing.get_context("forkserver")
_RANKS.set_forkserver_preload(
    ["weir.services.executor.model_runner", "weir.services.engine.core", "weir.services.launcher"]
)


def run_group(work: Workload, world_size: int) -> list[RankReport]:
    """``work`` run by every rank of a group of ``world_size`` processes (forked from a clean
    server process): their reports, each checked for errors and a clean exit."""
    results = _RANKS.Queue()
    port = free_port()
    procs = [
        _RANKS.Process(target=run_rank, args=(work, world_size, rank, port, results))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        reports = sorted((results.get(timeout=RANK_TIMEOUT_S) for _ in procs), key=lambda r: r.rank)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for report in reports:
        assert report.error is None, f"rank {report.rank}: {report.error}"
    assert [p.exitcode for p in procs] == [0] * world_size
    return reports
