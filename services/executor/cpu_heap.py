"""glibc's malloc asked to keep a CPU step's large buffers between layers and steps.

glibc maps every allocation from its mmap threshold up afresh and unmaps it when freed (the
threshold rises with what is freed, to 32 MiB at most), and hands the top of its heap back
to the kernel once more than its trim threshold lies free there. A CPU step's large tensors
(a prefill's gate/up output, a decode's logits) were therefore page-faulted in again in
every layer and every step: a quarter of a 2,048-token prefill step on a 2-core VM
(docs/benchmarks.md). With the mmap threshold above the step's largest tensor and the trim
threshold at twice that, freed buffers stay in the heap for the next layer to reuse; the
process holds at most the trim threshold in freed memory. Another C library (musl) is left
as it is; with an allocator preloaded in glibc's place (tcmalloc, jemalloc) the call sets
what that allocator does not use.
"""

import ctypes
import logging
import os

from weir.shared.model_config import ModelConfig

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MAX_MMAP_THRESHOLD = 512 << 20  # mallopt takes an int: twice this still fits


def step_buffer_bytes(config: ModelConfig, max_num_batched_tokens: int, sampled_rows: int) -> int:
    """The largest float32 tensor a CPU step allocates, of those that grow with it: a full
    step's gated-MLP gate/up output, a mixture of experts' routed rows (each token once per
    expert it chose) or their gate/up output, every sampled row's logits, or (Qwen 3.5's) the
    recurrent states of a step's decodes, one a sampled row, gathered from their slots."""
    routed = max_num_batched_tokens * max(1, config.num_experts_per_tok)
    linear = config.linear_attention
    state = 0 if linear is None else linear.num_v_heads * linear.head_k_dim * linear.head_v_dim
    return 4 * max(
        max_num_batched_tokens * 2 * config.intermediate_size,
        routed * max(config.hidden_size, 2 * config.moe_intermediate_size),
        sampled_rows * max(config.vocab_size, state),
    )


def is_glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a GNU C library
        return False


def keep_step_buffers(largest_bytes: int) -> bool:
    """Have glibc serve allocations up to ``largest_bytes`` (and a page more) from its heap
    and keep twice that free there. Process-wide. False where this is not glibc."""
    if not is_glibc():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = min(largest_bytes + 4096, MAX_MMAP_THRESHOLD)
    kept = bool(mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, 2 * threshold))
    log.debug("malloc mmap threshold %d, trim threshold %d: %s", threshold, 2 * threshold, kept)
    return kept
