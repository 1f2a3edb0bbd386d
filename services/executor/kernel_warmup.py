"""Compile every Triton attention variant a model can launch before the first request.

Triton compiles a kernel the first time it is launched with a new set of compile-time
constants (tiles, split-KV segments, the prefill launch or not): 0.3-0.6 s per attention
variant for sm_90 on a 2-core host (`benchmarks/kernel_compile_time.py`). Left to the steps
that first need them, those compilations land in the middle of serving: the first short
prompt, the first speculative step, the first batch small enough to split its keys each
stall every running request.
So the executor runs, once its KV caches exist, one tiny step per variant that
`weir.kernels.triton_attention.warm_up_hints` finds reachable, through the model itself
(the real layers, caches and strides, so each launch is the one serving makes). The steps
write nothing (every slot is padding) and read block 0 only; Triton's cache on disk keeps
the compiled kernels for the next start, which then only loads them.
"""

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from weir.services.executor.attention import AttentionMetadata
from weir.services.executor.eagle import EagleHead
from weir.services.executor.model import CausalLM
from weir.shared.arith import cdiv

logger = logging.getLogger(__name__)


# A model's pass over a step: input ids, positions, metadata and its KV caches.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor]], object]


@torch.inference_mode()
def warm_up_attention(
    model: CausalLM | EagleHead,
    kv_caches: list[torch.Tensor],
    block_size: int,
    max_model_len: int,
    forward: Forward | None = None,
) -> None:
    """Run ``model`` (through ``forward``, where it takes more than a step's tokens) over one
    step per attention kernel variant it can launch."""
    # Imported here, as the attention backend imports it: Triton decides between compiling and
    # interpreting (TRITON_INTERPRET, tests on a CPU) when the kernel module is first imported.
    from weir.kernels.triton_attention import LayerAttention, device_class, warm_up_hints

    start = time.perf_counter()
    fp8_cache = kv_caches[0].element_size() == 1
    layers = [
        LayerAttention(
            layer.num_heads,
            cache.shape[3],
            cache.shape[4],
            layer.span,
            layer.softcap,
            layer.sinks is not None,
        )
        for layer, cache in zip(model.layers, kv_caches, strict=True)
    ]
    compute_dtype = model.dtype if fp8_cache else kv_caches[0].dtype
    device = model.device
    hints = warm_up_hints(
        layers, block_size, compute_dtype, fp8_cache, max_model_len, device_class(device)
    )
    for query_len, max_seq_len in hints:
        blocks = cdiv(query_len, block_size)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
            block_table=torch.zeros((1, blocks), dtype=torch.int32, device=device),
            slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=device),
            max_query_len=query_len,
            max_seq_len=max_seq_len,
        )
        input_ids = torch.zeros(query_len, dtype=torch.int64, device=device)
        positions = torch.from_numpy(np.arange(query_len)).to(device)
        (model if forward is None else forward)(input_ids, positions, meta, kv_caches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info(
        "attention kernels warmed up: %d steps in %.2fs", len(hints), time.perf_counter() - start
    )
