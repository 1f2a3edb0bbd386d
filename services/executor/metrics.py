"""Prometheus metrics of one executor rank, on its own registry and HTTP endpoint."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:  # the model runner imports torch; the metrics do not need it
    from weir.services.executor.model_runner import StepTimings

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

_STEP_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ExecutorMetrics:
    """``weir_executor_*`` series, labelled with the model name and the rank."""

    def __init__(self, model_name: str, rank: int, device: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "rank": str(rank)}
        names = list(labels)

        def labelled(metric: _Metric) -> _Metric:
            return metric.labels(**labels)

        self.step_seconds = labelled(
            Histogram(
                "weir_executor_step_seconds",
                "Wall time of one step (plan received to result ready; a step launched ahead counts "
                "its wait behind the one before)",
                names,
                registry=self.registry,
                buckets=_STEP_SECONDS_BUCKETS,
            )
        )
        self.device_busy_seconds = labelled(
            Counter(
                "weir_executor_device_busy_seconds",
                "Time the device spent on steps (CUDA events from each step's first to its last "
                "device operation; on a CPU, forward and sampling): its rate is the busy fraction",
                names,
                registry=self.registry,
            )
        )
        self.graph_steps = labelled(
            Counter(
                "weir_executor_graph_steps",
                "Steps whose forward pass replayed a CUDA graph (the others ran eagerly)",
                names,
                registry=self.registry,
            )
        )
        self.kernel_compiles = labelled(
            Counter(
                "weir_executor_kernel_compiles",
                "Triton kernel variants compiled while serving (each stalls the running requests; "
                "the startup warm-up compiles every variant a step can launch, so this stays 0)",
                names,
                registry=self.registry,
            )
        )
        self.kernel_compile_seconds = labelled(
            Counter(
                "weir_executor_kernel_compile_seconds",
                "Host time those compilations took",
                names,
                registry=self.registry,
            )
        )
        self.batch_tokens = labelled(
            Histogram(
                "weir_executor_batch_tokens",
                "Tokens computed in one step",
                names,
                registry=self.registry,
                buckets=_TOKEN_BUCKETS,
            )
        )
        self.num_kv_blocks = labelled(
            Gauge(
                "weir_executor_num_kv_blocks",
                "KV cache blocks allocated on this rank",
                names,
                registry=self.registry,
            )
        )
        phase = Histogram(
            "weir_executor_phase_seconds",
            "Time of one step by phase: prepare (plan to input tensors), forward (to the hidden "
            "states), sample (logits, sampling, collecting the result)",
            [*names, "phase"],
            registry=self.registry,
            buckets=_STEP_SECONDS_BUCKETS,
        )
        self.phase_seconds = {
            p: phase.labels(**labels, phase=p) for p in ("prepare", "forward", "sample", "draft")
        }
        self.device_memory_bytes = labelled(
            Gauge(
                "weir_executor_device_memory_bytes",
                "Device memory in use: allocated CUDA memory on GPU, resident set size on CPU",
                names,
                registry=self.registry,
            )
        )
        # Read when scraped (on the metrics server's thread): a /proc read or an allocator
        # query per step cost the step loop ~25 us for a value read only between scrapes.
        self.device_memory_bytes.set_function(lambda: device_memory_in_use(device))

    def observe_step(
        self,
        seconds: float,
        num_tokens: int,
        timings: StepTimings,
        device_busy_seconds: float,
    ) -> None:
        self.step_seconds.observe(seconds)
        self.device_busy_seconds.inc(device_busy_seconds)
        self.phase_seconds["prepare"].observe(timings.prepare)
        self.phase_seconds["forward"].observe(timings.forward)
        self.phase_seconds["sample"].observe(timings.sample)
        if timings.draft:  # a draft model's passes (speculative method draft_model)
            self.phase_seconds["draft"].observe(timings.draft)
        self.batch_tokens.observe(num_tokens)
        if timings.graphed:
            self.graph_steps.inc()


def device_memory_in_use(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
