"""Attention metadata for one flat mixed batch, and the switch between kernel backends.

Every backend implements the semantics of `weir.kernels.reference` (paged KV layout
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, flat token batch, causal rule
relative to each request's context length, a layer's span (a sliding window or Llama 4's
attention chunk), soft cap and attention sinks if it has them). "native" runs `weir.kernels.cpu_native`
(compiled C, attending straight from the paged cache) and is the CPU default in float32
where a C compiler is at hand; its kernels also serve the model's norms and rotary
embeddings. "torch" runs `weir.kernels.cpu_attention` (batched PyTorch operators, planned
once per step for each span and shape of heads): the CPU path in other dtypes or without a
compiler. "reference" calls the reference directly (one request at a time, slow; for
checking); "triton" calls `weir.kernels.triton_attention` and is the CUDA default.

Layers of one model may differ in KV heads and head_dim (Gemma 4's full-attention layers
against its sliding-window ones), so every backend takes those from each call's cache and
query, never from `prepare`'s.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weir.kernels import cpu_attention, cpu_native
from weir.kernels.reference import AttentionSpan
from weir.services.executor.linear_states import LinearStep


@dataclass(slots=True)
class AttentionMetadata:
    """Where every token of a step reads and writes K/V. Tensors live on the model's device."""

    query_start_loc: torch.Tensor  # [R + 1] int32, request r owns rows [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # [R] int32, context + new tokens of request r
    block_table: torch.Tensor  # [R, max_blocks] int32, physical block of each logical block
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = padding
    max_query_len: int  # host-side hints so kernels need no device sync to size their grid
    max_seq_len: int
    plan: object | None = None  # what a backend derives once per step in `prepare`, for every layer
    # The requests' linear-attention state rows (Qwen 3.5's); None: a model without such
    # layers, or a pass outside serving that brings none (a kernel warm-up: scratch states).
    linear: LinearStep | None = None


class AttentionBackend(Protocol):
    name: str

    @property
    def kernels(self) -> cpu_native.CpuKernels | None:
        """Native CPU kernels the model also uses for its norms and rotations; None elsewhere."""

    def prepare(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        """Called once per step, before any layer's write_kv/attend, with the first attention
        layer's cache (others may differ in KV heads and head_dim, not in block size)."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        span: AttentionSpan | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class TorchStep:
    """TorchAttention's state of one step: its metadata copied to the host once, where every
    layer writes, and a plan per (span, query heads, KV heads), made by the first layer that
    needs it: a spanned plan gathers only the keys its span shows, and the cache rows a plan
    gathers depend on the layer's heads."""

    query_start_loc: torch.Tensor  # on the host, as the rest
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    device: torch.device
    writes: cpu_attention.CacheWrites  # on the device
    plans: dict[tuple[AttentionSpan | None, int, int], cpu_attention.StepPlan] = field(
        default_factory=dict
    )

    def plan(
        self, span: AttentionSpan | None, num_heads: int, num_kv_heads: int
    ) -> cpu_attention.StepPlan:
        key = (span, num_heads, num_kv_heads)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = cpu_attention.plan_step(
                self.query_start_loc,
                self.seq_lens,
                self.block_table,
                block_size=self.block_size,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                device=self.device,
                span=span,
            )
        return plan


class TorchAttention:
    """Batched PyTorch operators over the paged cache: the CPU path."""

    name = "torch"
    kernels = None

    def prepare(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        meta.plan = TorchStep(
            meta.query_start_loc.cpu(),
            meta.seq_lens.cpu(),
            meta.block_table.cpu(),
            kv_cache.shape[2],
            kv_cache.device,
            cpu_attention.plan_writes(meta.slot_mapping.cpu(), kv_cache.device),
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        assert isinstance(meta.plan, TorchStep)
        cpu_attention.reshape_and_cache(key, value, kv_cache, meta.plan.writes)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        span: AttentionSpan | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta.plan, TorchStep)
        plan = meta.plan.plan(span, query.shape[1], kv_cache.shape[3])
        return cpu_attention.paged_attention(query, kv_cache, plan, scale, softcap, sinks)


class PagedKernelAttention:
    """Kernels with kernels/reference.py's signatures: the reference itself (one request at
    a time), the Triton kernels (a few launches for the whole batch) or the native CPU
    kernels (one call per layer each to write and to attend)."""

    def __init__(
        self,
        name: str,
        module: Any,
        *,
        takes_hints: bool,
        kernels: cpu_native.CpuKernels | None = None,
    ) -> None:
        self.name = name
        self._module = module
        self._takes_hints = takes_hints
        self.kernels = kernels

    def prepare(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        pass

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        self._module.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        span: AttentionSpan | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hints = (
            {"max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len}
            if self._takes_hints
            else {}
        )
        # The kernels' module is chosen at run time (Any): what it returns is a tensor.
        out: torch.Tensor = self._module.paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            span=span,
            softcap=softcap,
            sinks=sinks,
            **hints,
        )
        return out


def _native() -> PagedKernelAttention:
    kernels = cpu_native.load()
    if kernels is None:
        raise ValueError(
            "the native attention backend is unavailable (no working C compiler, or "
            "WEIR_NATIVE_CPU_KERNELS=0); use --attention-backend torch"
        )
    return PagedKernelAttention("native", kernels, takes_hints=False, kernels=kernels)


def _module(name: str) -> Any:
    # Imported only when chosen: importing triton is slow and needs a GPU or the interpreter.
    return importlib.import_module(f"weir.kernels.{name}")


# Keyed by the names `--attention-backend` offers (weir.shared.config.ATTENTION_BACKENDS).
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "native": _native,
    "torch": TorchAttention,
    "reference": lambda: PagedKernelAttention("reference", _module("reference"), takes_hints=False),
    "triton": lambda: PagedKernelAttention("triton", _module("triton_attention"), takes_hints=True),
}


def get_attention_backend(
    name: str | None, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """`None` picks "triton" on CUDA, and on a CPU "native" in float32 where it compiled,
    else "torch"."""
    if name is None:
        if torch.device(device).type == "cuda":
            name = "triton"
        else:
            native = dtype == torch.float32 and cpu_native.load() is not None
            name = "native" if native else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "native" and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(
            f"the native attention backend runs float32 on the CPU, not {dtype} on {device}; "
            "use --attention-backend torch"
        )
    return BACKENDS[name]()
