"""Prometheus metrics of the scheduler process, on its own registry and HTTP endpoint.

Names follow vLLM's (``weir:`` instead of ``vllm:``) so its dashboards translate;
every series carries ``model_name``.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from weir.services.scheduler.scheduler import Scheduler, SpecDecodeStats

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
_PHASE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
STEP_PHASES = ("schedule", "plan_encode", "executor", "update", "propose", "outputs")
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A request's tokens: up to the longest contexts served (1M).
_REQUEST_TOKEN_BUCKETS = tuple(2**i for i in range(21))
# How prometheus_client writes a bucket bound ("0.001", "1.0", "+Inf"); untyped upstream.
_bound_text = cast(Callable[[float], str], floatToGoString)


class LoraRequestGauges:
    """``weir_lora_requests_running`` and ``weir_lora_requests_waiting`` per adapter, and
    ``weir_lora_requests_info`` in vLLM's form (labels ``max_lora``,
    ``running_lora_adapters``, ``waiting_lora_adapters``: the adapters of the running and
    waiting requests, comma-separated; the value the time it was read), which the Gateway
    API Inference Extension's endpoint picker reads for its LoRA affinity. Counted when
    scraped: a step pays nothing for them. The scrape runs on the /metrics thread, and
    copies the scheduler's lists in one call each, which the GIL keeps whole."""

    def __init__(
        self,
        model_name: str,
        max_loras: int,
        adapters: Callable[[], dict[str, str]],
        scheduler: Callable[[], Scheduler | None],
        registry: CollectorRegistry,
    ) -> None:
        self._model_name = model_name
        self._max_loras = max_loras
        self._adapters = adapters  # name -> the adapter id its requests carry
        self._scheduler = scheduler
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        """The families without their values (the registry asks before the server runs)."""
        for state in ("running", "waiting"):
            yield self._family(state)
        yield self._info_family()

    @staticmethod
    def _family(state: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            f"weir_lora_requests_{state}",
            f"Requests of each LoRA adapter {state}",
            labels=["model_name", "lora_name"],
        )

    @staticmethod
    def _info_family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "weir_lora_requests_info",
            "The LoRA adapters of running and waiting requests (vLLM's lora_requests_info); "
            "the value is when it was read (Unix seconds)",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        running = [] if scheduler is None else list(scheduler.running)
        waiting = [] if scheduler is None else scheduler.waiting.requests()
        adapters = dict(self._adapters())
        in_use = []
        for state, requests in (("running", running), ("waiting", waiting)):
            family = self._family(state)
            counts = dict.fromkeys(adapters.values(), 0)
            for request in requests:
                if request.lora_name in counts:
                    counts[request.lora_name] += 1
            for name, adapter_id in adapters.items():
                family.add_metric([self._model_name, name], counts[adapter_id])
            in_use.append(",".join(name for name, i in adapters.items() if counts[i]))
            yield family
        info = self._info_family()
        info.add_metric([self._model_name, str(self._max_loras), *in_use], time.time())
        yield info


class CacheConfigInfo:
    """``weir_cache_config_info``: the KV cache's geometry as labels (vLLM's
    ``cache_config_info``; the endpoint picker's prefix-cache scorer reads ``block_size``
    and ``num_gpu_blocks``), value 1; none until the executors have sized the cache, and
    read again when a new executor group resizes it."""

    def __init__(
        self,
        model_name: str,
        scheduler: Callable[[], Scheduler | None],
        registry: CollectorRegistry,
    ) -> None:
        self._model_name = model_name
        self._scheduler = scheduler
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "weir_cache_config_info",
            "The KV cache's configuration (vLLM's cache_config_info), value 1",
            labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        scheduler = self._scheduler()
        if scheduler is not None:
            config = scheduler.cache_config
            labels = (config.block_size, config.num_blocks, config.enable_prefix_caching)
            family.add_metric([self._model_name, *map(str, labels)], 1)
        yield family


class StepHistogram:
    """A histogram of one label set, exposed exactly as a ``Histogram`` with the same
    buckets, that takes a value or one step's values under one lock. prometheus_client's
    ``observe`` takes two locks per value and looks up its child (~1.3-1.7 us); one value
    per stream per step would cost a third of a millisecond of every step at 256 streams,
    on the loop that plans the next one, and a finished request's eight histograms 12 us."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = labels
        self._bounds = (*buckets, math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # the /metrics server collects on its own thread
        registry.register(self)

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect_left(self._bounds, value)] += 1
            self._sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        bounds, counts = self._bounds, self._counts
        with self._lock:
            total = self._sum
            for value in values:
                counts[bisect_left(bounds, value)] += 1  # buckets count value <= bound
                total += value
            self._sum = total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        family.add_metric(
            list(self._labels.values()),
            [(_bound_text(b), n) for b, n in zip(self._bounds, accumulate(counts))],
            total,
        )
        yield family


class SchedulerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        reg, names = self.registry, ["model_name"]

        def one(metric: _Metric) -> _Metric:
            return metric.labels(model_name=model_name)

        self.num_requests_running = one(
            Gauge("weir_num_requests_running", "Requests in the running batch", names, registry=reg)
        )
        self.num_requests_waiting = one(
            Gauge(
                "weir_num_requests_waiting", "Requests waiting to be scheduled", names, registry=reg
            )
        )
        self.kv_cache_usage_perc = one(
            Gauge(
                "weir_kv_cache_usage_ratio",
                "Fraction of KV cache blocks in use (0..1)",
                names,
                registry=reg,
            )
        )
        self.num_preemptions = one(
            Counter("weir_preemptions_total", "Preemptions (recompute)", names, registry=reg)
        )
        self.engine_paused = one(
            Gauge(
                "weir_engine_paused",
                "1 while the engine's steps are paused (/pause, a weight update), else 0",
                names,
                registry=reg,
            )
        )
        self.weight_updates = one(
            Counter(
                "weir_weight_updates_total",
                "New weights loaded by every executor (update_weights_from_disk)",
                names,
                registry=reg,
            )
        )
        self.prompt_tokens = one(
            Counter(
                "weir_prompt_tokens_total",
                "Prompt tokens of admitted requests",
                names,
                registry=reg,
            )
        )
        self.generation_tokens = one(
            Counter("weir_generation_tokens_total", "Generated tokens", names, registry=reg)
        )
        self.prefix_cache_queries = one(
            Counter(
                "weir_prefix_cache_query_tokens_total",
                "Prompt tokens looked up in the prefix cache",
                names,
                registry=reg,
            )
        )
        self.prefix_cache_hits = one(
            Counter(
                "weir_prefix_cache_hit_tokens_total",
                "Prompt tokens found in the prefix cache",
                names,
                registry=reg,
            )
        )
        self._request_success = Counter(
            "weir_requests_finished_total",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.time_to_first_token = one(
            Histogram(
                "weir_time_to_first_token_seconds",
                "Arrival to first output token",
                names,
                registry=reg,
                buckets=_LATENCY_BUCKETS,
            )
        )
        self.inter_token_latency = StepHistogram(
            "weir_inter_token_latency_seconds",
            "Time between consecutive outputs of a request, one per output sent (as vLLM: the "
            "tokens of a speculative step, or of steps sent together, arrive together)",
            {"model_name": model_name},
            _LATENCY_BUCKETS,
            reg,
        )
        self.e2e_request_latency = StepHistogram(
            "weir_e2e_request_latency_seconds",
            "Arrival to finish",
            {"model_name": model_name},
            _REQUEST_BUCKETS,
            reg,
        )
        # Per finished request, as vLLM's (its Grafana dashboard plots them).
        self.request_prompt_tokens = StepHistogram(
            "weir_request_prompt_tokens",
            "Prompt tokens of each finished request",
            {"model_name": model_name},
            _REQUEST_TOKEN_BUCKETS,
            reg,
        )
        self.request_generation_tokens = StepHistogram(
            "weir_request_generation_tokens",
            "Output tokens of each finished request",
            {"model_name": model_name},
            _REQUEST_TOKEN_BUCKETS,
            reg,
        )
        self.request_params_max_tokens = StepHistogram(
            "weir_request_params_max_tokens",
            "max_tokens of each finished request that set it",
            {"model_name": model_name},
            _REQUEST_TOKEN_BUCKETS,
            reg,
        )
        self.request_prefill_time = StepHistogram(
            "weir_request_prefill_time_seconds",
            "First scheduled to first output token",
            {"model_name": model_name},
            _REQUEST_BUCKETS,
            reg,
        )
        self.request_decode_time = StepHistogram(
            "weir_request_decode_time_seconds",
            "First output token to finish",
            {"model_name": model_name},
            _REQUEST_BUCKETS,
            reg,
        )
        self.request_inference_time = StepHistogram(
            "weir_request_inference_time_seconds",
            "First scheduled to finish",
            {"model_name": model_name},
            _REQUEST_BUCKETS,
            reg,
        )
        self.request_time_per_output_token = StepHistogram(
            "weir_request_time_per_output_token_seconds",
            "A request's decode time over its output tokens after the first",
            {"model_name": model_name},
            _LATENCY_BUCKETS,
            reg,
        )
        self.request_queue_time = one(
            Histogram(
                "weir_request_queue_time_seconds",
                "Arrival to first scheduled",
                names,
                registry=reg,
                buckets=_REQUEST_BUCKETS,
            )
        )
        self.iteration_tokens = one(
            Histogram(
                "weir_iteration_tokens",
                "Tokens scheduled in one step",
                names,
                registry=reg,
                buckets=_TOKEN_BUCKETS,
            )
        )

        self.spec_decode_num_drafts = one(
            Counter("weir_spec_decode_drafts_total", "Draft runs verified", names, registry=reg)
        )
        self.spec_decode_num_draft_tokens = one(
            Counter(
                "weir_spec_decode_draft_tokens_total", "Draft tokens verified", names, registry=reg
            )
        )
        self.spec_decode_num_accepted_tokens = one(
            Counter(
                "weir_spec_decode_accepted_tokens_total",
                "Draft tokens accepted",
                names,
                registry=reg,
            )
        )
        self._accepted_per_pos = Counter(
            "weir_spec_decode_accepted_tokens_by_position_total",
            "Draft tokens accepted, by position in the draft",
            ["model_name", "position"],
            registry=reg,
        )
        self._step_phase = Histogram(
            "weir_scheduler_step_phase_seconds",
            "Scheduler time per step by phase: schedule, plan_encode, executor (send to result, "
            "IPC included), update, propose (n-gram drafts, with speculative decoding), outputs "
            "(detokenize, stop strings, push to clients: once per send, which carries the steps "
            "applied while the executor was ahead)",
            ["model_name", "phase"],
            registry=reg,
            buckets=_PHASE_BUCKETS,
        )
        self.step_phase = {
            phase: self._step_phase.labels(model_name=model_name, phase=phase)
            for phase in STEP_PHASES
        }

    def observe_spec_decode(self, spec: SpecDecodeStats, previous: SpecDecodeStats) -> None:
        """Advance the speculative-decoding counters by what changed since ``previous``."""
        self.spec_decode_num_drafts.inc(spec.num_drafts - previous.num_drafts)
        self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens - previous.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(
            spec.num_accepted_tokens - previous.num_accepted_tokens
        )
        before = previous.accepted_per_pos
        for position, count in enumerate(spec.accepted_per_pos):
            done = before[position] if position < len(before) else 0
            if count > done:
                self._accepted_per_pos.labels(
                    model_name=self._model_name, position=str(position)
                ).inc(count - done)

    def request_finished(
        self,
        finished_reason: str,
        times: RequestTimes,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int | None,
    ) -> None:
        """One request ended, ``times.finished`` ago or now: its counts and its phases'
        times (those it reached: one ended while queued was never scheduled)."""
        self._request_success.labels(
            model_name=self._model_name, finished_reason=finished_reason
        ).inc()
        end = times.finished
        self.e2e_request_latency.observe(end - times.arrival)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)
        if times.scheduled is not None:
            self.request_inference_time.observe(end - times.scheduled)
            if times.first_token is not None:
                self.request_prefill_time.observe(times.first_token - times.scheduled)
        if times.first_token is not None:
            decode = end - times.first_token
            self.request_decode_time.observe(decode)
            if generation_tokens > 1:
                self.request_time_per_output_token.observe(decode / (generation_tokens - 1))


@dataclass(slots=True)
class RequestTimes:
    """When a request arrived, was first scheduled, sent its first output token and
    finished (``time.monotonic()``)."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finished: float
