"""Triton attention over the paged KV cache for a whole mixed batch in one launch.

Same semantics and positional signature as `weir.kernels.reference.paged_attention`
(prefill chunks with cached context, decodes and speculative 1 + k queries share the
flat layout; query i of request r sees key j iff j <= context_len + i).

Work decomposition. The T query tokens are cut into "query blocks" of BLOCK_Q tokens
that never straddle two requests. Request r's blocks are numbered from
`query_start_loc[r] // BLOCK_Q + r`, which bounds the total by `T // BLOCK_Q + R`
without reading any length back to the host; a program finds its request by binary
search over query_start_loc and exits if its block lies past the request's tokens.
One program handles one query block for one KV head: its tile rows are the BLOCK_Q
tokens times the GROUP query heads sharing that KV head (grouped-query attention), so
each K/V tile is loaded once for all of them. It walks the request's keys in tiles of
TILE_N positions, independent of the page size, with an online softmax accumulated in
fp32.

Split-KV. When the grid above is too small to fill the GPU (few decodes over long
contexts) a third grid axis cuts each program's key range into NUM_SEGMENTS segments;
each writes an unnormalised partial result (accumulator, running max, running sum)
into a workspace and a second kernel merges them. The workspace can be allocated once
(`allocate_split_kv_workspace`) so the pair can be captured in a CUDA graph.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weir.kernels.triton_cache import reshape_and_cache

__all__ = [
    "NUM_SEGMENTS",
    "attention_constexprs",
    "SplitKVWorkspace",
    "allocate_split_kv_workspace",
    "paged_attention",
    "prefers_split_kv",
    "reshape_and_cache",
]

# Key-range segments per program on the split-KV path; fixed so the workspace and the
# grid depend only on shapes.
NUM_SEGMENTS = 16
TILE_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MERGE_NUM_WARPS = 4
# Compiled for sm_90 (Triton 3.8), a 16-row decode tile uses 110-150 registers per thread and about
# 39 KB of shared memory, so three or four programs share an SM; fewer busy programs than that per
# SM leave memory bandwidth unused, and the split-KV path is taken instead.
PROGRAMS_PER_SM = 4
LOG2_E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_requests, BLOCK_Q: tl.constexpr):
    """Last request whose first query block (query_start_loc[r] // BLOCK_Q + r) is <= q_block."""
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    segm_acc_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    num_requests,
    num_heads,
    head_dim,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_req,
    stride_bt_block,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, q_block, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    # Row m of the tile is query token m // GROUP of this block, for query head m % GROUP of this KV head.
    rows = tl.arange(0, BLOCK_M)
    q_pos = q_block_local * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < query_len)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    tokens = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)

    # Keys this block can see at all: up to the causal limit of its last token.
    kv_len = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_begin = segment * tiles_per_segment
    tile_end = tl.minimum(tile_begin + tiles_per_segment, num_tiles)

    last_visible = context_len + q_pos
    offs_n = tl.arange(0, TILE_N)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    k_base = cache_ptr + kv_head * stride_c_head
    v_base = k_base + stride_c_kv

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in range(tile_begin, tile_end):
        key_pos = tile * TILE_N + offs_n
        key_valid = key_pos < kv_len
        page = tl.load(
            block_table_row + (key_pos // BLOCK_SIZE) * stride_bt_block, mask=key_valid, other=0
        )
        page = page.to(tl.int64)
        slot_offset = page * stride_c_block + (key_pos % BLOCK_SIZE) * stride_c_slot
        k = tl.load(
            k_base + slot_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + slot_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        # Also hides key_pos >= kv_len, since a valid row's last visible key is below kv_len.
        s = tl.where(key_pos[None, :] <= last_visible[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        partial = (tokens * num_heads + heads) * NUM_SEGMENTS + segment
        tl.store(segm_max_ptr + partial, m_i, mask=row_valid)
        tl.store(segm_sum_ptr + partial, l_i, mask=row_valid)
        tl.store(
            segm_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    segm_acc_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, BLOCK_D)
    partial = (token * num_heads + head) * NUM_SEGMENTS + segments

    seg_max = tl.load(segm_max_ptr + partial)
    # Every token of a request sees key 0 in some segment, so the overall max is finite and the total >= 1.
    weight = tl.exp2(seg_max - tl.max(seg_max, axis=0))
    total = tl.sum(tl.load(segm_sum_ptr + partial) * weight, axis=0)
    acc = tl.load(segm_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    out_row = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@dataclass(slots=True)
class SplitKVWorkspace:
    """Partial results of the split-KV path, indexed [token, query head, segment(, dim)]."""

    acc: (
        torch.Tensor
    )  # fp32 [max_num_tokens, num_heads, NUM_SEGMENTS, padded head_dim], unnormalised
    max: torch.Tensor  # fp32 [max_num_tokens, num_heads, NUM_SEGMENTS], running max in log2 units
    sum: torch.Tensor  # fp32 [max_num_tokens, num_heads, NUM_SEGMENTS], running sum of exponentials

    @property
    def max_num_tokens(self) -> int:
        return self.acc.shape[0]


def allocate_split_kv_workspace(
    max_num_tokens: int, num_heads: int, head_dim: int, device: torch.device | str
) -> SplitKVWorkspace:
    """Workspace for split-KV batches of up to max_num_tokens query tokens (allocate once, reuse)."""
    shape = (max_num_tokens, num_heads, NUM_SEGMENTS)
    return SplitKVWorkspace(
        acc=torch.empty(
            *shape, triton.next_power_of_2(head_dim), dtype=torch.float32, device=device
        ),
        max=torch.empty(shape, dtype=torch.float32, device=device),
        sum=torch.empty(shape, dtype=torch.float32, device=device),
    )


def _tile_rows(group: int, max_query_len: int) -> int:
    """Rows of a query tile: every query head of the longest request if it fits, at least 16 (the
    smallest tl.dot tile) and at most 64 unless one token's query heads alone need more."""
    wanted = triton.next_power_of_2(group * max(max_query_len, 1))
    return min(max(wanted, 16), max(64, triton.next_power_of_2(group)))


def attention_constexprs(
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    num_segments: int,
    cache_dtype: torch.dtype,
) -> dict[str, int | str]:
    """Compile-time parameters of the attention kernel for one batch shape (num_segments 1 = single pass).
    The page size is one of them so that finding a key's page is a shift, not a division."""
    block_m = _tile_rows(group, max_query_len)
    return {
        "BLOCK_SIZE": block_size,
        "GROUP": group,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "TILE_N": TILE_N,
        "NUM_SEGMENTS": num_segments,
        # tl.dot on fp32 would otherwise round its inputs to tf32.
        "DOT_PRECISION": "ieee" if cache_dtype == torch.float32 else "tf32",
    }


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefers_split_kv(
    num_requests: int, num_heads: int, num_kv_heads: int, max_query_len: int, device: torch.device
) -> bool:
    """Whether paged_attention takes the split-KV path by default: every request fits one query
    tile (decodes, short speculative queries) and there are too few (request, KV head) programs
    to keep the GPU's SMs busy. Never on a CPU (the interpreter)."""
    group = num_heads // num_kv_heads
    fits_one_tile = max_query_len <= _tile_rows(group, max_query_len) // group
    return fits_one_tile and num_requests * num_kv_heads < PROGRAMS_PER_SM * _num_sms(device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    split_kv: bool | None = None,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys, in one launch (two on split-KV).

    The cache must already hold the new tokens' K/V (call reshape_and_cache first). Nothing is read
    back to the host. Optional keyword arguments, all host-side:
      out           preallocated [T, num_heads, head_dim] result; rows of tokens outside every request
                    are unspecified, as in the reference.
      max_query_len longest query of the step, known to the caller; only picks the tile size and the
                    path. Without it T - R + 1 is used, exact when every request has a query token.
      split_kv      force (True) or forbid (False) the split-KV path; None takes it for decode-like
                    batches whose grid would leave the GPU's SMs short of work.
      workspace     split-KV buffers from allocate_split_kv_workspace; allocated per call if absent.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    num_requests = seq_lens.shape[0]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_cache.shape[4]}")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("paged_attention needs a contiguous head dimension in query and kv_cache")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(2) != 1:
        raise ValueError("out must have the query's shape and a contiguous head dimension")
    if num_tokens == 0 or num_requests == 0:
        return out

    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = num_tokens - num_requests + 1 if num_tokens >= num_requests else num_tokens
    if split_kv is None:
        split_kv = prefers_split_kv(
            num_requests, num_heads, num_kv_heads, max_query_len, query.device
        ) and (workspace is None or workspace.max_num_tokens >= num_tokens)
    num_segments = NUM_SEGMENTS if split_kv else 1
    constexprs = attention_constexprs(
        group, head_dim, kv_cache.shape[2], max_query_len, num_segments, kv_cache.dtype
    )
    block_d = constexprs["BLOCK_D"]
    if split_kv:
        if workspace is None:
            workspace = allocate_split_kv_workspace(num_tokens, num_heads, head_dim, query.device)
        elif workspace.max_num_tokens < num_tokens or workspace.acc.shape[1:] != (
            num_heads,
            NUM_SEGMENTS,
            block_d,
        ):
            raise ValueError("split-KV workspace does not fit this batch")
        segm_acc, segm_max, segm_sum = workspace.acc, workspace.max, workspace.sum
    else:
        segm_acc = segm_max = segm_sum = out  # unused on the single-pass path

    block_q = constexprs["BLOCK_Q"]
    grid = (num_tokens // block_q + num_requests, num_kv_heads, constexprs["NUM_SEGMENTS"])
    _unified_attention_kernel[grid](
        query,
        kv_cache,
        out,
        segm_acc,
        segm_max,
        segm_sum,
        query_start_loc,
        seq_lens,
        block_table,
        scale * LOG2_E,
        num_requests,
        num_heads,
        head_dim,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        block_table.stride(1),
        **constexprs,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if split_kv:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            segm_acc,
            segm_max,
            segm_sum,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            BLOCK_D=block_d,
            NUM_SEGMENTS=NUM_SEGMENTS,
            num_warps=MERGE_NUM_WARPS,
        )
    return out
