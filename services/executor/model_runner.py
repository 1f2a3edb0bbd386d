"""Turns step plans into forward passes: weights, paged KV cache, persistent batch, sampler.

`ModelRunner.execute(plan)` applies the plan's diff to the persistent batch, runs one forward
pass over the flat mixed batch, samples where a request's prefill is complete, verifies
speculative drafts, and returns the new tokens per request. It is ``launch`` (queue the step
on the device) then ``finish`` (wait for its tokens). The executor process launches step N+1
before it finishes step N when N+1's plan is already there, so the device runs N+1 right
after N while the host collects and sends N's tokens; N+1 reads the tokens N samples on the
device (``InputBatch.reserve_tokens``).

With ``tensor_parallel_size`` N > 1, N runners (one per process, ``rank`` 0..N-1) each hold
a shard of the model and execute the same plans in the same order; rank 0 samples and
broadcasts the tokens, so every rank's persistent batch stays the same.

On CUDA a step costs the host one wait: the copy of the sampled tokens (with their logprobs,
when asked for) back to the host. Inputs go to the device through pinned memory without
waiting, and phase timings synchronize only when asked for (``sync_timings``, or
``WEIR_SYNC_STEP_TIMING=1`` in the environment). Decode steps, and mixed steps of up to
``max_mixed_graph_tokens``, replay CUDA graphs (``cuda_graphs.StepGraphs``) unless
``enforce_eager``.
"""

import ctypes
import gc
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weir.kernels import cpu_native
from weir.services.cpu_cores import executor_threads
from weir.services.executor.attention import AttentionMetadata, get_attention_backend
from weir.services.executor.cpu_heap import keep_step_buffers, step_buffer_bytes
from weir.services.executor.cuda_graphs import StepGraphs, graph_shapes
from weir.services.executor.drafter import Drafter
from weir.services.executor.eagle import EagleHead, load_eagle_head
from weir.services.executor.image_inputs import ImageInputs
from weir.services.executor.input_batch import (
    ANY_TOKEN,
    CLS,
    LAST,
    MEAN,
    InputBatch,
    Reservation,
    StepInputs,
)
from weir.services.executor.kernel_warmup import warm_up_attention
from weir.services.executor.linear_states import LinearStates
from weir.services.executor.lora import LoraAdapters
from weir.services.executor.model import CausalLM
from weir.services.executor.packed_weights import cpu_dtypes
from weir.services.executor.parallel import init_tensor_parallel, local_cuda_device
from weir.services.executor.quantization import check_quantization
from weir.services.executor.sampler import (
    BadWords,
    Penalties,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    compute_logprobs,
    token_ranks,
)
from weir.services.executor.transfer import to_device
from weir.services.executor.weights import default_dtype, load_model
from weir.shared.arith import cdiv
from weir.shared.checkpoint_quantization import weight_quantization
from weir.shared.config import (
    EAGLE_METHODS,
    ENGINE_DEFAULTS,
    MAX_NUM_KV_BLOCKS,
    resolve_max_model_len,
)
from weir.shared.image_processors import image_processor
from weir.shared.lora import LoraModule
from weir.shared.model_config import (
    check_drafts,
    check_new_weights,
    eos_token_ids,
    read_model_config,
)
from weir.shared.pooling import resolve_runner
from weir.shared.protocol.step import WAKE_TAGS, SampleLogprobs, StepPlan, StepResult
from weir.shared.shard_layout import ShardLayout

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
SYNC_STEP_TIMING_ENV = "WEIR_SYNC_STEP_TIMING"
# Each graph is captured twice and the copies replayed in turn: with async scheduling a
# step's graph is launched while the step before (often the same size) still runs, and on the
# H200 (2026-12-04, benchmarks/step_profile.py, 1B shape, 256 decodes) two copies took the
# overlapped step from 2.59-3.17 ms to 2.02-2.26 ms; lockstep steps are unchanged.
GRAPH_COPIES = 2
# Prompt logprobs take logits over the vocabulary at every prompt position: this many rows
# at a time bound the memory (a 2048-token chunk at once: 400 MB for a 49k vocabulary).
PROMPT_LOGITS_ROWS = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype's fp8 names (weir.shared.config.KV_CACHE_DTYPES) and their dtypes.
FP8_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def parse_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def parse_kv_cache_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """``--kv-cache-dtype``'s dtype (None: the model's)."""
    if name == "auto":
        return None
    if name not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}; choose one of {['auto', *FP8_KV_CACHE_DTYPES]}"
        )
    if (
        FP8_KV_CACHE_DTYPES[name] == torch.float8_e4m3fn
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError(
            f"--kv-cache-dtype {name}: this GPU (compute capability below 8.9) has no e4m3 "
            "conversions for the Triton kernels; use fp8_e5m2"
        )
    return FP8_KV_CACHE_DTYPES[name]


def set_cpu_threads(num_threads: int | None) -> int:
    """Give torch ``num_threads`` intra-op threads (None: the cores available to this process,
    see ``weir.services.cpu_cores``; never ``OMP_NUM_THREADS``) and one inter-op thread."""
    num_threads = executor_threads(num_threads)
    torch.set_num_threads(num_threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # settable once per process: an earlier runner or torch op set it
            pass
    return num_threads


@dataclass(slots=True)
class StepTimings:
    """Seconds one step (its ``LaunchedStep``, through ``launch`` and ``finish``) spent per
    phase: building inputs from the plan, the forward pass (to the hidden states), and
    sampling (its parameters, the logits, sampling, and collecting the result). On CUDA without
    ``sync_timings`` these are host times: work still queued on the device counts in the
    phase that waits for it (sampling, which copies the tokens back). ``graphed``: the
    forward pass replayed a CUDA graph; ``draft``: the time a draft model took to
    propose the next step's drafts (0 without one)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    draft: float = 0.0  # a draft model's passes and proposals, after the step's tokens
    graphed: bool = False


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``): its sampled tokens are on their
    way to the host (``ids``, ``logprobs``; complete once ``ready`` has happened, at once on
    a CPU). Without drafts, the batch counts one ``reserved`` token per request it samples
    for, filled in by ``ModelRunner.finish``. ``ids`` is None when it samples nothing."""

    plan: StepPlan
    timings: StepTimings
    inputs: StepInputs | None = None
    token_ids: torch.Tensor | None = None  # [N] on the device: what the next step may read
    ids: torch.Tensor | None = None  # [N, 1 + n]: each row's token, then its top n
    logprobs: torch.Tensor | None = None  # [N, 1 + n]
    num_logprobs: np.ndarray | None = None  # [R] per request, as asked when launched
    # Prompt logprobs ([M, 1 + n] each: the prompt token, then the top n), when asked for.
    prompt_ids: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    # Of pooling requests whose prompt it completes: their ids and pooled states, [n, hidden]
    # float32, on their way to the host.
    pooled: tuple[list[str], torch.Tensor] | None = None
    # With an EAGLE head: what it reads of the step's rows (``ModelRunner._eagle_rows``).
    hidden: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    reserved: Reservation | None = None

    def is_ready(self) -> bool:
        """Whether ``finish`` would return without waiting for the device."""
        return self.ready is None or self.ready.query()


class ModelRunner:
    """One executor's model, KV cache and persistent batch."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = ENGINE_DEFAULTS.gpu_memory_utilization,
        kv_cache_dtype: str = ENGINE_DEFAULTS.kv_cache_dtype,
        block_size: int = ENGINE_DEFAULTS.block_size,
        attention_backend: str | None = None,
        max_num_batched_tokens: int = ENGINE_DEFAULTS.step_limits[0],
        max_num_seqs: int = ENGINE_DEFAULTS.step_limits[1],
        max_model_len: int | None = None,
        num_threads: int | None = None,
        seed: int | None = None,
        load_format: str = ENGINE_DEFAULTS.load_format,
        tensor_parallel_size: int = 1,
        rank: int = 0,
        enforce_eager: bool = ENGINE_DEFAULTS.enforce_eager,
        max_mixed_graph_tokens: int = ENGINE_DEFAULTS.max_mixed_graph_tokens,
        num_speculative_tokens: int = 0,
        sync_timings: bool | None = None,
        quantization: str | None = None,
        loras: list[LoraModule] | None = None,
        max_lora_rank: int = ENGINE_DEFAULTS.max_lora_rank,
        runner: str = ENGINE_DEFAULTS.runner,
        hf_overrides: str | None = None,
        speculative_model: str | os.PathLike[str] | None = None,
        speculative_model_quantization: str | None = None,
        speculative_method: str = "draft_model",
        tokenizer: str | os.PathLike[str] | None = None,
    ) -> None:
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        # Before joining the group: a model that cannot be split fails every rank at once.
        model_config = read_model_config(self.model_dir, hf_overrides)
        ShardLayout.of(model_config, rank, tensor_parallel_size)
        # vLLM's name of the checkpoint's method asks nothing of the weights: read as they are.
        quantization = weight_quantization(quantization, model_config.checkpoint_quantization)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            why = "no GPU is visible" if torch.version.cuda else "this torch has no CUDA"
            raise ValueError(f"--device {device}: {why} (torch {torch.__version__})")
        if self.device.type == "cuda" and self.device.index is None and tensor_parallel_size > 1:
            self.device = local_cuda_device(rank)
        if self.device.type == "cuda" and self.device.index is not None:
            # Events, graph captures and NCCL's communicators use the current device, not
            # the tensors': on cuda:1 they would otherwise land on GPU 0.
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            set_cpu_threads(num_threads)
            sampled_rows = max_num_seqs * (1 + num_speculative_tokens)
            keep_step_buffers(step_buffer_bytes(model_config, max_num_batched_tokens, sampled_rows))
        self.num_threads = torch.get_num_threads()
        self.tp = init_tensor_parallel(tensor_parallel_size, rank, self.device)
        # The model's dtype and its packed projections' (bfloat16 ones over a float32 model on
        # a CPU); weight_dtype is what --dtype asked for.
        self.weight_dtype = parse_dtype(dtype, self.device)
        self.dtype, self.weight_dtype = cpu_dtypes(
            self.device, self.weight_dtype, quantization, attention_backend
        )
        check_quantization(quantization, self.device, self.dtype)
        self.quantization = quantization
        # "auto": the cache of --dtype's dtype (bfloat16 weights over a float32 model keep a
        # bfloat16 cache, as a bfloat16 model does: half a float32 cache's bytes).
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.device) or (
            None if self.weight_dtype == self.dtype else self.weight_dtype
        )
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.attention = get_attention_backend(attention_backend, self.device, self.dtype)
        self.sync_timings = (
            os.environ.get(SYNC_STEP_TIMING_ENV) == "1" if sync_timings is None else sync_timings
        )
        # A pooling runner only prefills, pools what it prefilled (steps graphs never replay)
        # and needs no LM head.
        self.pooling_runner = (
            resolve_runner(runner, self.model_dir, model_config.num_labels) == "pooling"
        )
        # Graphs replay fixed launches: the attention backend must plan nothing on the host,
        # and collectives stay out of them (tensor parallelism runs eagerly). The experts'
        # grouped matmul has not yet been captured on a GPU: a MoE model runs eagerly.
        self.use_cuda_graphs = (
            not enforce_eager
            and not self.pooling_runner
            and self.device.type == "cuda"
            and self.tp is None
            and self.attention.name == "triton"
            and not model_config.num_experts
            # A linear-attention layer loops over a step's prefills on the host.
            and not model_config.linear_layers
        )
        if num_speculative_tokens or speculative_model:
            check_drafts(model_config)
        self.graph_query_lens = (1, 1 + num_speculative_tokens)
        self.max_mixed_graph_tokens = max_mixed_graph_tokens
        self.hf_overrides = hf_overrides
        # The weights served (read again by a wake from sleep level 2) and how to read them.
        self.weights_dir, self.load_format = self.model_dir, load_format
        self.tokenizer_dir = tokenizer  # --tokenizer's, which numbers classifier_from_token
        self.model = self._load_model()
        self.config = self.model.config
        # A model that takes images: its requests' images, and how its processor reads them.
        self.images = (
            None
            if self.config.image_token_id is None or self.config.vision is None
            else ImageInputs(
                image_processor(self.model_dir, self.config.vision), self.config.image_token_id
            )
        )
        # The draft model's directory, drafts a step, quantization, load format (its
        # own: new weights of the served model change the served model's only) and the
        # method: draft_model, or an EAGLE head's (eagle, eagle3).
        self.draft_options = (
            None
            if speculative_model is None
            else (
                Path(speculative_model),
                num_speculative_tokens,
                speculative_model_quantization,
                load_format,
                speculative_method,
            )
        )
        self.drafter = None if self.draft_options is None else self._load_drafter()
        # Before the KV cache is sized: adapters take their share of the memory first.
        self.loras = LoraAdapters.load(self.model, loras or [], max_lora_rank)
        self.max_lora_rank = max_lora_rank
        self.max_model_len = resolve_max_model_len(max_model_len, self.config.context_len)
        # The served tokenizer's end token (--tokenizer's, if given), as the scheduler's.
        self.eos_token_ids = eos_token_ids(self.model_dir, tokenizer)
        self.sampler = Sampler(self.device, seed)
        # Qwen 3.5's linear-attention states, a slot per running request: allocated before
        # the KV cache is sized, so a GPU's budget leaves their memory to them.
        self.linear_states = self._linear_states()
        self.num_blocks = min(
            self._num_kv_blocks(kv_cache_memory_bytes, gpu_memory_utilization), MAX_NUM_KV_BLOCKS
        )
        if self.num_blocks < 1:
            raise ValueError(
                "no memory left for the KV cache: raise --kv-cache-memory "
                "(or --gpu-memory-utilization on a GPU)"
            )
        self.reset()
        self.graphs: StepGraphs | None = None
        try:
            self._allocate_caches()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if "allocate" not in str(exc):
                raise
            size = self.num_blocks * self.model.kv_cache_bytes_per_block(self.block_size)
            raise ValueError(
                f"the KV cache ({self.num_blocks} blocks, {size / 2**30:.1f} GiB) does not fit "
                f"in {self.device}'s memory: lower --kv-cache-memory (or "
                f"--gpu-memory-utilization on a GPU) ({str(exc).splitlines()[0]})"
            ) from None
        # vLLM's sleep mode: 0 awake, else the level ``sleep`` freed the KV cache at; the
        # weights may wake first (``wake(("weights",))``), to load new ones into.
        self.sleep_level = 0
        self.weights_asleep = False
        self._busy_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._busy_seconds = 0.0
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "loaded %s on %s (%s, %s attention, %d torch threads) in %.2fs; %d KV blocks of "
            "%d tokens (%s)",
            self.model_dir.name,
            self.device,
            self.precision,
            self.attention.name,
            self.num_threads,
            self.load_seconds,
            self.num_blocks,
            block_size,
            self.model.kv_cache_dtype,
        )

    @property
    def precision(self) -> str:
        """The model's dtype, and its weights' where they are held otherwise (bfloat16 panels
        with what multiplies them here)."""
        model, weights = (str(d).removeprefix("torch.") for d in (self.dtype, self.weight_dtype))
        if self.quantization:
            weights = self.quantization
        if weights == model:
            return model
        kernels = cpu_native.load() if self.weight_dtype != self.dtype else None
        unit = "" if kernels is None else f" ({kernels.bf16_matmul_unit})"
        return f"{model}, {weights} weights{unit}"

    # ------------------------------------------------------------------ setup

    def _load_model(self, path: Path | None = None, **options: Any) -> CausalLM:
        """The model of directory ``path`` (default: the served one, from ``weights_dir``),
        on this rank's device and shard; ``options`` replace the served model's."""
        # Any: the options differ in type, and load_model's signature checks each by name.
        served: dict[str, Any] = {
            "device": self.device,
            "dtype": self.dtype,
            "attention": self.attention,
            "load_format": self.load_format,
            "tp": self.tp,
            "quantization": self.quantization,
            "lm_head_optional": self.pooling_runner,
            "hf_overrides": self.hf_overrides,
            "kv_cache_dtype": self.kv_cache_dtype,
            "weight_dtype": self.weight_dtype,
            "tokenizer_dir": self.tokenizer_dir,
        }
        return load_model(self.weights_dir if path is None else path, **{**served, **options})

    def _allocate_caches(self) -> None:
        """The KV caches (the draft's too), the attention kernels compiled over them, and
        the CUDA graphs that read them."""
        self.kv_caches = self.model.allocate_kv_caches(self.num_blocks, self.block_size)
        if self.linear_states is None:  # freed by a sleep
            self.linear_states = self._linear_states()
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, self.block_size)
        if self.attention.name == "triton":
            warm_up_attention(self.model, self.kv_caches, self.block_size, self.max_model_len)
            if self.drafter is not None:
                warm_up_attention(
                    self.drafter.model,
                    self.drafter.kv_caches,
                    self.block_size,
                    self.max_model_len,
                    self.drafter.warm_up_pass,
                )
        if self.use_cuda_graphs:
            self.capture_graphs()

    def _linear_states(self) -> LinearStates | None:
        if not self.config.linear_layers:
            return None
        return LinearStates(
            self.config, self.model.layout, self.max_num_seqs, self.dtype, self.device
        )

    def capture_graphs(self, copies: int = GRAPH_COPIES, capture: bool = True) -> None:
        """Capture the step graphs over the KV caches (again, for a benchmark's copies);
        ``capture=False`` (tests, also on a CPU): the graphs' padded buffers only, through
        which steps then run eagerly."""
        self.graphs = StepGraphs(
            self.model,
            self.kv_caches,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_blocks_per_req=self.batch.max_blocks_per_req,
            query_lens=self.graph_query_lens,
            max_mixed_tokens=self.max_mixed_graph_tokens,
            capture=capture,
            copies=copies,
        )
        self.graphs.capture_all()

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode: free the KV caches and the CUDA graphs; level 1 moves the
        weights to host memory (on a CPU they stay), level 2 frees them (``wake`` reads
        them again). The batch forgets its requests: the scheduler sends them again. The
        weights of an executor whose KV cache sleeps (woken alone) go back to sleep."""
        if self.weights_asleep:
            return
        self.graphs = None
        self.kv_caches = []
        self.linear_states = None
        if self.drafter is not None:
            self.drafter.kv_caches = []
        if level == 2:  # the models go (a CPU's packed and quantized copies with them)
            del self.model
            self.drafter = None
        elif self.device.type == "cuda":
            self.model.to("cpu")
            if self.drafter is not None:
                self.drafter.model.to("cpu")
        self.reset()
        self.sleep_level, self.weights_asleep = level, True
        _give_back_freed_memory(self.device)

    def wake(self, tags: Iterable[str] = WAKE_TAGS) -> None:
        """Take back what ``sleep`` freed of ``tags``: the weights (read again from
        ``weights_dir`` after level 2), the KV caches and CUDA graphs (after the weights:
        capturing the graphs runs them)."""
        tags = set(tags)
        if "weights" in tags and self.weights_asleep:
            if self.sleep_level == 2:
                self.model = self._load_model()
                self.drafter = None if self.draft_options is None else self._load_drafter()
            elif self.device.type == "cuda":
                self.model.to(self.device)
                if self.drafter is not None:
                    self.drafter.model.to(self.device)
            self.weights_asleep = False
        if "kv_cache" in tags and self.sleep_level:
            if self.weights_asleep:
                raise ValueError("the KV cache wakes after the weights (its CUDA graphs run them)")
            self._allocate_caches()
            self.sleep_level = 0

    def _load_drafter(self) -> Drafter:
        """The draft model of ``draft_model`` speculative decoding, on this rank's device
        (and shard: it splits as the served model does), or the EAGLE head of ``eagle`` or
        ``eagle3`` over the served model (one rank only)."""
        assert self.draft_options is not None
        model_dir, num_speculative_tokens, quantization, load_format, method = self.draft_options
        if self.pooling_runner:
            raise ValueError("a draft model proposes generated tokens; a pooling runner has none")
        if num_speculative_tokens < 1:
            raise ValueError("a draft model needs num_speculative_tokens >= 1")
        check_quantization(quantization, self.device, self.dtype)
        if method in EAGLE_METHODS:
            if self.tp is not None:
                raise ValueError(
                    "EAGLE speculative decoding under tensor parallelism is not supported yet: "
                    "serve on one rank, or use draft_model"
                )
            if quantization is not None:
                raise ValueError("an EAGLE head is not quantized: drop its quantization")
            head = load_eagle_head(model_dir, self.model, load_format, method)
            return Drafter(head, num_speculative_tokens, self.config.vocab_size, self.device, None)
        draft_config = read_model_config(model_dir)
        rank, size = (0, 1) if self.tp is None else (self.tp.rank, self.tp.world_size)
        try:
            ShardLayout.of(draft_config, rank, size)
        except ValueError as exc:
            raise ValueError(f"draft model {model_dir.name}: {exc}") from None
        if draft_config.num_labels:
            raise ValueError(
                f"draft model {model_dir.name} is a sequence classifier: a draft must generate"
            )
        model = self._load_model(
            model_dir,
            load_format=load_format,
            quantization=quantization,
            lm_head_optional=False,
            hf_overrides=None,
        )
        return Drafter(model, num_speculative_tokens, self.config.vocab_size, self.device, self.tp)

    def _num_kv_blocks(
        self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float
    ) -> int:
        per_block = self.model.kv_cache_bytes_per_block(self.block_size)
        if self.drafter is not None:  # the draft's cache shares the served model's blocks
            per_block += self.drafter.model.kv_cache_bytes_per_block(self.block_size)
        if kv_cache_memory_bytes is not None:
            return kv_cache_memory_bytes // per_block
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES // per_block
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(self.max_num_batched_tokens, self.max_num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)  # weights + activation peak
        graphs = self._graph_memory() if self.use_cuda_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (
            total - free - torch.cuda.memory_reserved(self.device)
        )  # CUDA context, other processes
        budget = int(total * gpu_memory_utilization) - peak - graphs - max(non_torch, 0)
        logger.info(
            "KV cache budget %.2f GiB (total %.2f GiB x %.2f, torch peak %.2f GiB, CUDA graphs "
            "%.2f GiB, other %.2f GiB)",
            budget / 2**30,
            total / 2**30,
            gpu_memory_utilization,
            peak / 2**30,
            graphs / 2**30,
            non_torch / 2**30,
        )
        return max(budget, 0) // per_block

    def _graph_memory(self) -> int:
        """Activation memory of the largest graph's step, once per copy (a bound: the copies
        share one pool, but each keeps its output rows): the pool holds that much for as long
        as the graphs live, beside what eager steps use."""
        shapes = graph_shapes(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.graph_query_lens,
            self.max_mixed_graph_tokens,
        )
        num_tokens, num_reqs = max((s.num_tokens, s.num_reqs) for s in shapes)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(num_tokens, num_reqs)
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - before) * GRAPH_COPIES

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int, num_reqs: int) -> None:
        """A forward pass and sampling at one step shape, to measure its peak activation memory."""
        num_reqs = min(num_reqs, num_tokens)
        lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        lens[: num_tokens % num_reqs] += 1
        blocks_per_req = cdiv(int(lens.max()), self.block_size)
        kv_caches = self.model.allocate_kv_caches(num_reqs * blocks_per_req, self.block_size)
        query_start_loc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], lens)
        req = np.repeat(np.arange(num_reqs), lens)
        block_table = np.arange(num_reqs * blocks_per_req, dtype=np.int32).reshape(
            num_reqs, blocks_per_req
        )
        meta = AttentionMetadata(
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(lens.astype(np.int32)),
            block_table=self._to_device(block_table),
            slot_mapping=self._to_device(req * blocks_per_req * self.block_size + positions),
            max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()),
            linear=None
            if self.linear_states is None
            else self.linear_states.unserved(query_start_loc),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden, aux = self.model.forward_with_aux(
            input_ids, self._to_device(positions), meta, kv_caches
        )
        logits = self.model.compute_logits(
            hidden[self._to_device(query_start_loc[1:].astype(np.int64) - 1)]
        )
        ones = np.ones(num_reqs, dtype=np.float32)
        batch = SamplingBatch.build(
            ones, np.full(num_reqs, 50), ones * 0.9, ones * 0.1, device=self.device, num_logprobs=20
        )
        if logits is not None:  # under tensor parallelism, only rank 0 samples
            self.sampler(logits, batch)
        del kv_caches, logits
        if self.drafter is not None:  # its first pass after such a step is about as large
            kv_caches = self.drafter.model.allocate_kv_caches(
                num_reqs * blocks_per_req, self.block_size
            )
            rows = self._eagle_rows(hidden, aux)
            self.drafter.first_pass(input_ids, rows, self._to_device(positions), meta, kv_caches)
            del kv_caches

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # ------------------------------------------------------------------ step

    def reset(self) -> None:
        """Forget every request (after a step raised, its state is not to be trusted)."""
        self.batch = InputBatch(
            self.max_model_len,
            self.block_size,
            self.max_num_seqs,
            self.eos_token_ids,
            self.loras.ids,  # the same dict: adapters loaded later are known at once
            self.config.rope.long_prompt_threshold,
            self.config.vocab_size,
        )
        self._unfinished: LaunchedStep | None = None  # launched, and its tokens may be read
        if self.drafter is not None:
            self.drafter.forget()  # its records name the old batch's slots
        if self.linear_states is not None:
            self.linear_states.forget()
        if self.images is not None:
            self.images.clear()
        # Of MEAN and CLS pooling requests whose prompt is partly computed: the sum of its
        # hidden states so far, or its first token's.
        self._pooling: dict[str, torch.Tensor] = {}

    def load_weights(self, path: str) -> None:
        """Serve the weights of model directory ``path`` (its config.json the served
        model's) from now on; this rank's share, all or nothing: they are read and checked
        whole before any served weight changes. On a CPU the model is replaced; elsewhere
        they are staged in host memory and copied into the served parameters, which CUDA
        graphs go on reading."""
        check_new_weights(path, self.config, self.hf_overrides)
        served_before = self.weights_dir, self.load_format
        self.weights_dir, self.load_format = Path(path), "auto"
        served = dict(self.model.named_parameters())
        try:
            cpu = self.device.type == "cpu"
            staged = (
                self._load_model()
                if cpu
                else self._load_model(
                    device="cpu",
                    attention=get_attention_backend("torch", "cpu", self.dtype),
                    quantization=None,
                    pack=False,
                )
            )
            new = dict(staged.named_parameters())
            if new.keys() != served.keys():
                # A checkpoint with an fp8 cache's scales where the served one had none (or
                # the reverse) is another model to the layers that apply them.
                differ = sorted(new.keys() ^ served.keys())
                raise ValueError(
                    f"{path}: its weights are not the served model's parameters ({len(differ)} "
                    f"differ, e.g. {differ[0]}: an fp8 KV cache's scales?)"
                )
        except BaseException:
            self.weights_dir, self.load_format = served_before
            raise
        if cpu:
            self.model = staged
            if self.drafter is not None and isinstance(self.drafter.model, EagleHead):
                self.drafter.model.read_from(staged)
            return
        for name, weight in new.items():
            served[name].copy_(weight)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue a step's forward pass and sampling on the device; ``finish`` waits for its
        tokens. One step may be launched before the previous one is finished (not two):
        the tokens it reads that the previous step samples are taken on the device."""
        start = self._clock()
        began = self._device_event()
        previous, self._unfinished = self._unfinished, None
        if previous is not None and previous.reserved is None:
            raise RuntimeError("a step with drafts must finish before the next one launches")
        if plan.sleep_level == 0:
            # Before weights: a level-2 sleeper has none to load them into.
            self.wake(WAKE_TAGS if plan.wake_tags is None else plan.wake_tags)
        if plan.load_weights is not None:
            if previous is not None:
                raise RuntimeError("weights are loaded between steps, never under one")
            self.load_weights(plan.load_weights)
        if plan.sleep_level:
            if previous is not None or plan.num_scheduled_tokens:
                raise RuntimeError("an executor sleeps between steps, never under one")
            self.sleep(plan.sleep_level)
        if plan.lora_adapters is not None:
            self.loras.sync(self.model, plan.lora_adapters, self.max_lora_rank)
        for req_id in plan.finished_req_ids if self._pooling else ():
            self._pooling.pop(req_id, None)
        self.batch.apply_plan(plan)
        if self.linear_states is not None:
            self.linear_states.apply_plan(plan)
        if self.images is not None:
            self.images.apply_plan(plan)
        if not plan.num_scheduled_tokens:
            return LaunchedStep(plan, StepTimings(prepare=self._clock() - start))
        if plan.total_num_scheduled_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"step of {plan.total_num_scheduled_tokens} tokens exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        inputs = self.batch.prepare_inputs(plan)
        feed = None if previous is None else self._feed(previous, inputs)
        lora = (
            None
            if not self.loras.ids
            else self.loras.batch(
                self.batch.lora_id[inputs.slots], inputs.query_start_loc, self.device
            )
        )
        embeds = (
            None
            if self.images is None or self.model.vision is None
            else self.images.embeds(
                self.model.vision, inputs.req_ids, inputs.query_start_loc, inputs.positions
            )
        )
        # Graphs replay the base model's forward pass: a step with adapters, pooling or
        # images runs eagerly.
        shape = (
            None
            if self.graphs is None
            or lora is not None
            or inputs.pooling is not None
            or embeds is not None
            else self.graphs.shape_for(inputs)
        )
        eagle = self.drafter is not None and self.drafter.eagle
        if shape is not None and shape.mixed and eagle:
            shape = None  # a mixed graph keeps only the rows it samples; an EAGLE head reads all
        if shape is not None:
            assert self.graphs is not None
            input_ids, fed = self.graphs.stage(inputs, shape, feed)
            if fed is not None:
                _scatter(input_ids, fed, previous)
            prepared = self._clock()
            padded, aux = self.graphs.forward(shape)
            if len(inputs.logits_indices):
                # Padding rows come last and never reach the LM head.
                rows = padded[: len(inputs.logits_indices)]
                step = self._sample(plan, inputs, rows, input_ids, start, prepared, began)
            else:  # a prefill chunk alone: nothing to sample
                step = self._unsampled(plan, inputs, start, prepared, began)
            step.timings.graphed = self.graphs.replays(shape)
            step.hidden = self._eagle_rows(padded, aux)  # a decode graph's rows: every token's
            return step
        meta = AttentionMetadata(
            query_start_loc=self._to_device(inputs.query_start_loc),
            seq_lens=self._to_device(inputs.seq_lens),
            block_table=self._to_device(inputs.block_table),
            slot_mapping=self._to_device(inputs.slot_mapping),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            linear=None
            if self.linear_states is None
            else self.linear_states.step(
                inputs.req_ids,
                inputs.query_start_loc,
                inputs.positions[inputs.query_start_loc[:-1]],
            ),
        )
        input_ids = self._to_device(inputs.input_ids)
        positions = self._to_device(inputs.rope_positions)
        if feed is not None:
            _scatter(input_ids, self._to_device(feed), previous)
        prepared = self._clock()
        hidden, aux = self.model.forward_with_aux(
            input_ids, positions, meta, self.kv_caches, lora, embeds
        )
        prompt = self._prompt_logprobs(hidden, inputs)
        pooled = None if inputs.pooling is None else self._pool(hidden, inputs)
        if not len(inputs.logits_indices):
            step = self._unsampled(plan, inputs, start, prepared, began)
            step.prompt_ids, step.prompt_logprobs = prompt
            step.pooled = pooled
            step.hidden = self._eagle_rows(hidden, aux)
            return step
        rows = hidden[self._to_device(inputs.logits_indices)]
        step = self._sample(plan, inputs, rows, input_ids, start, prepared, began)
        step.prompt_ids, step.prompt_logprobs = prompt
        step.pooled = pooled
        step.hidden = self._eagle_rows(hidden, aux)
        return step

    def _eagle_rows(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor | None:
        """What an EAGLE head reads of a forward pass's rows: the served model's final
        hidden states (EAGLE-1's), or the auxiliary ones it keeps for an EAGLE-3 head; None
        without a head."""
        if self.drafter is None or not self.drafter.eagle:
            return None
        return hidden if aux is None else aux

    def _unsampled(
        self,
        plan: StepPlan,
        inputs: StepInputs,
        start: float,
        prepared: float,
        began: torch.cuda.Event | None,
    ) -> LaunchedStep:
        """A launched step that samples nothing (its work ends with the forward pass)."""
        step = LaunchedStep(plan, StepTimings(prepared - start), inputs=inputs)
        step.ready = self._device_event()
        self._count_busy(began, step.ready, prepared)
        step.timings.forward = self._clock() - prepared
        return step

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens, record them in the batch and return them."""
        start = time.perf_counter()
        if self._unfinished is step:
            self._unfinished = None
        if step.ids is None and step.prompt_ids is None and step.pooled is None:
            return self._draft(step, StepResult(step_id=step.plan.step_id))
        if step.ready is not None:
            step.ready.synchronize()  # the step's one wait for the device
        result = (
            self._collect(step) if step.ids is not None else StepResult(step_id=step.plan.step_id)
        )
        if step.prompt_ids is not None:
            result.prompt_logprobs = self._collect_prompt(step)
        if step.pooled is not None:
            req_ids, vectors = step.pooled
            result.pooled = {
                rid: v.astype("<f4").tobytes() for rid, v in zip(req_ids, vectors.numpy())
            }
        step.timings.sample += time.perf_counter() - start
        return self._draft(step, result)

    def _draft(self, step: LaunchedStep, result: StepResult) -> StepResult:
        """With a draft model: its cache brought up to the step's verified tokens, and its
        proposals for the requests the step sampled for, in ``result``."""
        if self.drafter is None or step.inputs is None:
            return result
        start = time.perf_counter()
        result.draft_token_ids = self.drafter.propose(
            self.batch, step.inputs, set(result.sampled_token_ids), step.hidden
        )
        step.timings.draft = time.perf_counter() - start
        return result

    def device_busy_seconds(self) -> float:
        """Device time of the steps done since the last call. On CUDA, from each step's first
        to its last device operation (events; gaps inside a step count, so eager steps slowed
        by their launches count in full; a graph replay has none); on a CPU, the time each
        step computed (forward and sampling)."""
        self._fold_finished_spans()
        total, self._busy_seconds = self._busy_seconds, 0.0
        return total

    def _fold_finished_spans(self) -> None:
        """Add the device time of the steps whose events have happened (without waiting)."""
        while self._busy_spans and self._busy_spans[0][1].query():
            began, ended = self._busy_spans.popleft()
            self._busy_seconds += began.elapsed_time(ended) / 1e3

    def _device_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _count_busy(
        self, began: torch.cuda.Event | None, ended: torch.cuda.Event | None, prepared: float
    ) -> None:
        """Count a step's device time: read from its events once they happened, or now on a
        CPU (the time since its inputs were ready: the forward pass and sampling ran here)."""
        if began is not None and ended is not None:
            self._busy_spans.append((began, ended))
            self._fold_finished_spans()  # so a caller that never asks holds a few events only
        else:
            self._busy_seconds += time.perf_counter() - prepared

    def _feed(self, previous: LaunchedStep, inputs: StepInputs) -> np.ndarray | None:
        """The tokens of this step that ``previous`` samples: [rows of this step's input ids,
        rows of previous's sampled tokens] (int64, 2 x n), None for none."""
        reserved = previous.reserved
        assert reserved is not None and previous.token_ids is not None
        capacity = self.batch.capacity
        position = np.full(capacity, -1, dtype=np.int64)
        live = self.batch.reserved_now(reserved)
        position[reserved.slots[live]] = reserved.positions[live]
        token_slots = np.repeat(inputs.slots, np.diff(inputs.query_start_loc))
        rows = np.flatnonzero(position[token_slots] == inputs.positions)
        if not len(rows):
            return None
        sampled_row = np.zeros(capacity, dtype=np.int64)
        sampled_row[reserved.slots] = np.arange(len(reserved.slots))
        return np.stack((rows, sampled_row[token_slots[rows]]))

    def _sample(
        self,
        plan: StepPlan,
        inputs: StepInputs,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        start: float,
        prepared: float,
        began: torch.cuda.Event | None,
    ) -> LaunchedStep:
        """Queue the logits of the hidden ``rows`` the step samples from, and their sampling
        (``input_ids`` as _sampling_batch takes them). The sampling parameters, built while
        the device runs the forward pass, decide the logits' dtype: the LM head's own where
        sampling takes only their argmax (see CausalLM.compute_logits)."""
        forwarded = self._clock()
        # Under tensor parallelism rank 0 alone samples.
        samples = self.tp is None or self.tp.rank == 0
        sampling = self._sampling_batch(plan, inputs, input_ids) if samples else None
        widen = sampling is None or not sampling.argmax_only
        logits = self.model.compute_logits(rows, widen=widen)
        if self.tp is None:
            assert logits is not None and sampling is not None
            sampled = self.sampler(logits, sampling)
        else:
            sampled = self._sample_on_rank_0(logits, sampling, inputs)
        lp = sampled.logprobs
        # Rows [sampled token, top n alternatives...] and, with logprobs, their logprobs.
        ids = sampled.token_ids.unsqueeze(1)
        logprobs = None
        if lp is not None:
            ids = torch.cat((ids, lp.top_ids), dim=1)
            logprobs = _to_host(torch.cat((lp.token_logprobs.unsqueeze(1), lp.top_logprobs), dim=1))
        step = LaunchedStep(
            plan,
            StepTimings(prepared - start, forwarded - prepared),
            inputs=inputs,
            token_ids=sampled.token_ids,
            ids=_to_host(ids),
            logprobs=logprobs,
            num_logprobs=self.batch.num_logprobs[inputs.slots],
        )
        step.ready = self._device_event()
        self._count_busy(began, step.ready, prepared)
        if not inputs.num_spec.any():
            # Drafts make the count unknown until verified: such a step finishes first.
            step.reserved = self.batch.reserve_tokens(inputs.slots[inputs.num_logits > 0])
        self._unfinished = step
        step.timings.sample = self._clock() - forwarded
        return step

    def _prompt_logprobs(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logprob of each prompt token the step's rows predict for requests that ask,
        with the top n, on their way to the host (None on ranks that do not sample); each
        row's token ids end with the prompt token's rank."""
        num_rows = len(inputs.prompt_logits_indices)
        if not num_rows:
            return None, None
        n = int(self.batch.num_prompt_logprobs[inputs.slots].max())
        rows = self._to_device(inputs.prompt_logits_indices)
        targets = self._to_device(inputs.prompt_targets)
        ids, logprobs = [], []
        for start in range(0, num_rows, PROMPT_LOGITS_ROWS):
            end = start + PROMPT_LOGITS_ROWS
            # Under tensor parallelism every rank joins the gather; rank 0 gets the logits.
            logits = self.model.compute_logits(hidden[rows[start:end]])
            if logits is None:
                continue
            lp = compute_logprobs(logits, targets[start:end], n)
            ranks = token_ranks(logits, targets[start:end]).unsqueeze(1)
            ids.append(torch.cat((targets[start:end].unsqueeze(1), lp.top_ids, ranks), dim=1))
            logprobs.append(torch.cat((lp.token_logprobs.unsqueeze(1), lp.top_logprobs), dim=1))
        if not ids:
            return None, None
        return _to_host(torch.cat(ids)), _to_host(torch.cat(logprobs))

    def _pool(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[list[str], torch.Tensor] | None:
        """The pooled state of each pooling request whose prompt the step completes (on its
        way to the host; None if there is none); the running sums (MEAN) and first tokens
        (CLS) of the others are kept for later steps.
        A chunk at position 0 starts a request afresh (it was preempted, or is new)."""
        done: dict[str, torch.Tensor] = {}
        qsl, positions = inputs.query_start_loc, inputs.positions
        assert inputs.pooling is not None and inputs.pooling_done is not None
        for i in np.flatnonzero(inputs.pooling).tolist():
            rid, kind = inputs.req_ids[i], int(inputs.pooling[i])
            start, end = int(qsl[i]), int(qsl[i + 1])
            fresh = positions[start] == 0
            if kind == LAST:
                state = hidden[end - 1].float()
            elif kind == CLS:
                state = (
                    hidden[start].to(torch.float32, copy=True)
                    if fresh
                    else (self._pooled_so_far(rid))
                )
            else:
                state = hidden[start:end].float().sum(0)
                if not fresh:
                    state += self._pooled_so_far(rid)
            if inputs.pooling_done[i]:
                self._pooling.pop(rid, None)
                done[rid] = state / int(inputs.seq_lens[i]) if kind == MEAN else state
            elif kind != LAST:
                self._pooling[rid] = state
        if not done:
            return None
        states = torch.stack(list(done.values()))
        return list(done), _to_host(
            states if self.model.score is None else self.model.classify(states)
        )

    def _pooled_so_far(self, req_id: str) -> torch.Tensor:
        state = self._pooling.get(req_id)
        if state is None:
            raise ValueError(
                f"request {req_id!r}: its prompt's first positions were never computed here, "
                "so it cannot be pooled (a MEAN or CLS pooling request must start at 0)"
            )
        return state

    def _collect_prompt(self, step: LaunchedStep) -> dict[str, SampleLogprobs]:
        """Each request's prompt logprob rows of the step, ``n`` wide as it asked."""
        assert step.inputs is not None and step.prompt_ids is not None
        assert step.prompt_logprobs is not None
        inputs = step.inputs
        ids, lps = step.prompt_ids.tolist(), step.prompt_logprobs.tolist()
        wanted = self.batch.num_prompt_logprobs[inputs.slots].tolist()
        result, row = {}, 0
        for req_id, count, n in zip(inputs.req_ids, inputs.num_prompt_logits.tolist(), wanted):
            if count:
                rows = range(row, row + count)
                result[req_id] = SampleLogprobs(
                    [ids[i][: n + 1] for i in rows],
                    [lps[i][: n + 1] for i in rows],
                    [ids[i][-1] for i in rows],
                )
                row += count
        return result

    def _sample_on_rank_0(
        self, logits: torch.Tensor | None, sampling: SamplingBatch | None, inputs: StepInputs
    ) -> SamplerOutput:
        """Rank 0 samples (it alone holds the gathered logits) and broadcasts the tokens; the
        other ranks get the tokens only: their results are never sent."""
        assert self.tp is not None
        if logits is None:
            tokens = self.tp.broadcast_tokens(None, len(inputs.logits_indices), self.device)
            return SamplerOutput(tokens, None)
        assert sampling is not None
        sampled = self.sampler(logits, sampling)
        self.tp.broadcast_tokens(
            sampled.token_ids.contiguous(), len(sampled.token_ids), self.device
        )
        return sampled

    def _clock(self) -> float:
        # Synchronizing makes phase times include the device's work, at the cost of the
        # host no longer running ahead of the device within a step: only when asked for.
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _sampling_batch(
        self, plan: StepPlan, inputs: StepInputs, input_ids: torch.Tensor
    ) -> SamplingBatch:
        """The sampling parameters of the step's logits rows; ``input_ids``: the step's flat
        input ids on the device (penalties count the outputs among them)."""
        b = self.batch
        rows = np.repeat(inputs.slots, inputs.num_logits)
        # Output index of the token each row samples: row j of a request samples output n + j.
        first = np.repeat(
            b.num_tokens[inputs.slots] - b.num_prompt_tokens[inputs.slots], inputs.num_logits
        )
        logits_start = np.cumsum(inputs.num_logits) - inputs.num_logits
        output_pos = first + np.arange(len(rows)) - np.repeat(logits_start, inputs.num_logits)
        seeded = np.flatnonzero(b.has_seed[rows])
        seeds = [(int(i), b.seed[rows[i]], int(output_pos[i])) for i in seeded]
        grammar = self._grammar_masks(plan, inputs)
        # A structured output allows its end tokens only once complete, and nothing else
        # then: min_tokens does not hold it (the scheduler ends it there).
        constrained = {row for row, _ in grammar}
        allowed = self._with_allowed_tokens(grammar, inputs)
        banned = [
            (int(i), b.stop_ids[rows[i]])
            for i in np.flatnonzero(output_pos < b.min_tokens[rows])
            if len(b.stop_ids.get(rows[i], ())) and int(i) not in constrained
        ]
        logit_bias = (
            [
                (i, *b.logit_bias[slot])
                for i, slot in enumerate(rows.tolist())
                if slot in b.logit_bias
            ]
            if b.logit_bias
            else []
        )
        return SamplingBatch.build(
            b.temperature[rows],
            b.top_k[rows],
            b.top_p[rows],
            b.min_p[rows],
            device=self.device,
            seeds=seeds,
            num_logprobs=int(b.num_logprobs[rows].max(initial=-1)),
            banned=banned,
            logit_bias=logit_bias,
            penalties=self._penalties(inputs, rows, input_ids),
            allowed=allowed,
            bad_words=self._bad_words(inputs, rows, input_ids),
            grammar=grammar,
        )

    def _with_allowed_tokens(
        self, grammar: list[tuple[int, bytes]], inputs: StepInputs
    ) -> list[tuple[int, bytes]]:
        """``grammar``'s (logits row, bitmask) pairs with every row of a request that has
        allowed_token_ids held to them (ANDed with its grammar's mask where it has one)."""
        b = self.batch
        if not b.allowed_tokens:
            return grammar
        masks = dict(grammar)
        first_row = np.cumsum(inputs.num_logits) - inputs.num_logits
        for i, slot in enumerate(inputs.slots.tolist()):
            tokens = b.allowed_tokens.get(slot)
            if tokens is None:
                continue
            for row in range(int(first_row[i]), int(first_row[i] + inputs.num_logits[i])):
                mask = masks.get(row)
                masks[row] = (
                    tokens
                    if mask is None
                    else (np.frombuffer(mask, "<i4") & np.frombuffer(tokens, "<i4")).tobytes()
                )
        return list(masks.items())

    def _grammar_masks(self, plan: StepPlan, inputs: StepInputs) -> list[tuple[int, bytes]]:
        """(logits row, bitmask) of each structured-output request the step samples for: a
        mask a row (a request that verifies drafts has one after each)."""
        if not plan.grammar_bitmask:
            return []
        size = 4 * cdiv(self.config.vocab_size, 32)
        first_row = np.cumsum(inputs.num_logits) - inputs.num_logits
        allowed = []
        for i, req_id in enumerate(inputs.req_ids):
            mask = plan.grammar_bitmask.get(req_id)
            rows = int(inputs.num_logits[i])
            if mask is not None and rows:
                if len(mask) != size * rows:
                    raise ValueError(
                        f"request {req_id!r}: a bitmask of {len(mask)} bytes for {rows} "
                        f"position(s) of a vocabulary of {self.config.vocab_size} tokens"
                    )
                row = int(first_row[i])
                allowed += [(row + j, mask[j * size : (j + 1) * size]) for j in range(rows)]
        return allowed

    def _bad_words(
        self, inputs: StepInputs, rows: np.ndarray, input_ids: torch.Tensor
    ) -> BadWords | None:
        """The bad words of the logits rows of slots ``rows`` (None where no row has any):
        each row's recent outputs, the ones this step feeds read from ``input_ids``."""
        b = self.batch
        if not b.bad_words:
            return None
        with_words = np.flatnonzero([slot in b.bad_words for slot in rows.tolist()])
        if not len(with_words):
            return None
        words = [b.bad_words[int(rows[i])] for i in with_words]
        length = max(before.shape[1] for _, before in words)
        history, (fed_rows, fed_columns, fed_index) = b.bad_word_history(inputs, with_words, length)
        pair_of = np.repeat(np.arange(len(words)), [len(last) for last, _ in words])
        prefix = np.concatenate(
            [
                np.pad(before, ((0, 0), (length - before.shape[1], 0)), constant_values=ANY_TOKEN)
                for _, before in words
            ]
        )
        dev = self._to_device
        on_device = dev(history)
        if len(fed_rows):
            on_device[dev(fed_rows), dev(fed_columns)] = input_ids[dev(fed_index)].long()
        return BadWords(
            rows=dev(with_words[pair_of].astype(np.int64)),
            last=dev(np.concatenate([last for last, _ in words])),
            prefix=dev(prefix),
            history=on_device[dev(pair_of)],
        )

    def _penalties(
        self, inputs: StepInputs, rows: np.ndarray, input_ids: torch.Tensor
    ) -> Penalties | None:
        """The penalties of the logits rows of slots ``rows``, or None where no row has any."""
        b = self.batch
        penalized = np.flatnonzero(
            (b.presence_penalty[rows] != 0)
            | (b.frequency_penalty[rows] != 0)
            | (b.repetition_penalty[rows] != 1)
        )
        if not len(penalized):
            return None
        tokens = b.penalty_tokens(inputs, penalized)
        dev = self._to_device
        fed_rows, fed_index = tokens.fed
        output = (
            torch.cat((dev(tokens.output[0]), dev(fed_rows))),
            torch.cat((dev(tokens.output[1]), input_ids[dev(fed_index)].long())),
        )
        slots = rows[penalized]
        return Penalties(
            rows=dev(penalized),
            presence=dev(b.presence_penalty[slots]),
            frequency=dev(b.frequency_penalty[slots]),
            repetition=dev(b.repetition_penalty[slots]),
            output=output,
            prompt=None
            if tokens.prompt is None
            else (dev(tokens.prompt[0]), dev(tokens.prompt[1])),
        )

    def _collect(self, step: LaunchedStep) -> StepResult:
        # A step that samples carries all three (``_sample``).
        assert step.ids is not None and step.inputs is not None and step.num_logprobs is not None
        inputs, b = step.inputs, self.batch
        ids = step.ids.tolist()
        if step.reserved is not None:
            b.fill_reserved(step.reserved, step.ids[:, 0].numpy())
            if step.logprobs is None:
                # No drafts to verify and no logprobs (the common decode step): each request
                # that samples keeps its one token, a row [token] of ``ids``.
                sampled = (
                    inputs.req_ids
                    if inputs.num_logits.all()
                    else [r for r, n in zip(inputs.req_ids, inputs.num_logits.tolist()) if n]
                )
                return StepResult(
                    sampled_token_ids=dict(zip(sampled, ids)), step_id=step.plan.step_id
                )
        lps = None if step.logprobs is None else step.logprobs.tolist()
        tokens = [row[0] for row in ids]
        result: dict[str, list[int]] = {}
        logprobs: dict[str, SampleLogprobs] = {}
        row = 0
        for req_id, slot, num_logits, num_spec, n in zip(
            inputs.req_ids,
            inputs.slots.tolist(),
            inputs.num_logits.tolist(),
            inputs.num_spec.tolist(),
            step.num_logprobs.tolist(),
        ):
            if num_logits == 0:
                continue
            targets = tokens[row : row + num_logits]
            out = targets
            if step.reserved is None:
                accepted = 0
                if num_spec:
                    start = int(b.num_tokens[slot])
                    drafts = b.token_ids[slot, start : start + num_spec].tolist()
                    # Keep drafts while each equals the token the target model samples there.
                    while accepted < num_spec and drafts[accepted] == targets[accepted]:
                        accepted += 1
                out = targets[: accepted + 1]
                b.append_tokens(slot, out)
            result[req_id] = out
            if n >= 0 and lps is not None:
                rows = range(row, row + len(out))
                logprobs[req_id] = SampleLogprobs(
                    token_ids=[ids[i][: n + 1] for i in rows],
                    logprobs=[lps[i][: n + 1] for i in rows],
                )
            row += num_logits
        return StepResult(
            sampled_token_ids=result, logprobs=logprobs or None, step_id=step.plan.step_id
        )


def _give_back_freed_memory(device: torch.device) -> None:
    """Return freed memory to the system: CUDA's cached blocks, or on a CPU the heap pages
    glibc keeps (its mmap threshold grows with each large free, so freed tensors stay in
    the heap: a level-2 sleep would give back a third of the weights without this)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _scatter(input_ids: torch.Tensor, fed: torch.Tensor, previous: LaunchedStep | None) -> None:
    """Write the tokens ``previous`` samples into ``input_ids`` where ``fed`` (``_feed``'s
    indices, on the device) says: there are such indices only after a previous step."""
    assert previous is not None and previous.token_ids is not None
    rows, sampled = fed
    input_ids[rows] = previous.token_ids[sampled].to(input_ids.dtype)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to the host without waiting (into pinned memory, which
    a non-blocking device-to-host copy allocates); on a CPU, the tensor itself."""
    if tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)
