"""Tensor parallelism: the collectives a rank calls (which slice of the model it holds is
``weir.shared.shard_layout``, read by the scheduler too).

Megatron-style: the fused QKV and gate/up projections are split by output rows
(column-parallel: each rank computes its own heads and its share of the MLP), the
output and down projections by input columns (row-parallel: each rank's product is a
partial sum, added up by one all-reduce). The embedding and the LM head are split by
vocabulary rows: a rank embeds only the tokens in its range (the others read zeros; one
all-reduce) and computes the logits of its range (gathered on rank 0, which samples and
broadcasts the tokens so every rank's persistent batch advances alike). With fewer KV
heads than ranks, each rank holds the one KV head its query heads read (replicated).

Per step: 2 all-reduces per layer (3 with OLMo's q/k norms of whole projections) + 1 for
the embedding, one logits gather, one token broadcast. A world of size 1 has no ``TensorParallel`` at all (``None``): the model
calls no collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = "29500"  # torchrun's default
# Rendezvous wait and collective timeout: ranks load the checkpoint at different speeds.
GROUP_TIMEOUT = timedelta(minutes=10)


class GroupBrokenError(RuntimeError):
    """A collective failed: a peer rank died (or the network between the ranks did). The
    step failed through no fault of its requests, and this group cannot run another."""


def _collective(op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        op(*args, **kwargs)
    except RuntimeError as exc:  # gloo raises RuntimeError, NCCL DistBackendError (one too)
        raise GroupBrokenError(f"tensor-parallel {op.__name__} failed: {exc}") from exc


class TensorParallel:
    """The collectives of one rank in the default process group. The model calls every
    collective through this object (so a test can count them)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place."""
        _collective(dist.all_reduce, tensor)
        return tensor

    def gather_logits(self, shard: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: the full fp32 logits [N, vocab_size] from every rank's [N, vocab/world]
        slice; other ranks: None."""
        parts = (
            [torch.empty_like(shard) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        _collective(dist.gather, shard, parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def broadcast_tokens(
        self, token_ids: torch.Tensor | None, num: int, device: torch.device
    ) -> torch.Tensor:
        """Rank 0's sampled token ids, on every rank."""
        if token_ids is None:
            token_ids = torch.empty(num, dtype=torch.int64, device=device)
        _collective(dist.broadcast, token_ids, src=0)
        return token_ids


def init_tensor_parallel(world_size: int, rank: int, device: torch.device) -> TensorParallel | None:
    """Join the group of ``world_size`` ranks through the env:// rendezvous (``MASTER_ADDR``,
    ``MASTER_PORT``; default 127.0.0.1:29500): gloo on a CPU, NCCL on CUDA. None for 1."""
    if world_size == 1:
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
        os.environ.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=GROUP_TIMEOUT,
        )
    return TensorParallel(rank, world_size)


def local_cuda_device(rank: int) -> torch.device:
    """The GPU of ``rank`` on its node: ``LOCAL_RANK`` when set (one pod per rank: 0), else
    the rank modulo the GPUs visible."""
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else rank % max(torch.cuda.device_count(), 1)
    return torch.device("cuda", index)
