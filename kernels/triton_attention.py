"""Triton attention over the paged KV cache for a whole mixed batch.

Same semantics, positional signature and span and softcap keywords as
`weir.kernels.reference.paged_attention` (prefill chunks with cached context, decodes and
speculative 1 + k queries share the flat layout; query i of request r sees key j iff
j <= context_len + i, and with a span (a sliding window or a chunk) also
j >= span.first_key(context_len + i); with a soft cap c each scaled score s becomes c * tanh(s / c)).

Two kinds of tile, one launch each (no launch when the step has none of that kind):

- Decode tiles, one program per (request, KV head, KV segment). Its rows are the query
  tokens of the request times the GROUP query heads sharing that KV head (grouped-query
  attention), so each K/V tile is loaded once for all of them; 16 rows (up to 64 when
  every query of the step fits) keep tl.dot at its smallest tensor-core shape, which is
  what a memory-bound decode wants. Requests whose query does not fit one decode tile
  are left to the prefill launch, which in a mixed step runs beside the decode launch on
  a side stream.
- Prefill tiles, one program per (KV head, query block). A query block is BLOCK_Q
  consecutive tokens of one long request times the GROUP heads: 64-128 rows, so both
  tl.dot (QK^T and PV) run at full tensor-core width. Request r's blocks are numbered
  from `query_start_loc[r] // BLOCK_Q + r`, which bounds the total by
  `T // BLOCK_Q + R` without reading any length back to the host; a program finds its
  request by binary search over query_start_loc and exits if its block lies past the
  request's tokens or the request is short. The heaviest blocks (last in a request, most
  keys) are scheduled first.

Either kind walks its request's keys in tiles of TILE_N positions (independent of the
page size) with an online softmax accumulated in fp32. Key tiles past the causal limit
of a block's last token are never visited, nor, with a span, tiles below the first key of
its first token: a windowed or chunked step reads O(W) or O(C) keys per block however long
the context. In prefill tiles, key tiles that every row of the block sees whole are processed
without masks, and only the one or two tiles on the diagonal (or holding the sequence end), and
with a span those at its lower edge, are masked. The span is a compile-time constant
(one compilation per span, as a model has one or two): without one, the kernels
are exactly the unspanned ones. So is the soft cap (one per model), applied to each key
tile's scores in every loop; without one the kernels are exactly the uncapped ones.

Split-KV. When the decode launch of a step without long queries would leave the GPU's
SMs short of programs (few requests over long contexts) a third grid axis cuts each
request's key range into `segments` parts; each writes an unnormalised partial result (accumulator, running
max, running sum) into a workspace and a second kernel merges them. The workspace can
be allocated once (`allocate_split_kv_workspace`) so the launches can be captured in a
CUDA graph. The rule and the per-GPU tile constants are explained at `LaunchPlan`.

Every grid depends only on tensor shapes, the device, the span and the host-side hints
(max_query_len, max_seq_len); the hints choose tiles and launches, never the result.
"""

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weir.kernels.reference import AttentionSpan, check_sinks
from weir.kernels.triton_cache import reshape_and_cache

__all__ = [
    "MAX_SEGMENTS",
    "STEP_VARYING_ARGS",
    "LaunchPlan",
    "LayerAttention",
    "SplitKVWorkspace",
    "TileShape",
    "allocate_split_kv_workspace",
    "device_class",
    "paged_attention",
    "plan_for",
    "plan_launches",
    "reshape_and_cache",
    "split_kv_rows",
    "split_kv_segments",
    "warm_up_hints",
]

LOG2_E = 1.4426950408889634
_LOG2_E: tl.constexpr = tl.constexpr(LOG2_E)  # the kernels' copy: a global they read must be one
INT32_MAX = 2**31 - 1
# Integer arguments whose value changes from step to step. Triton compiles a variant of a kernel
# for each class of every integer argument (1, a multiple of 16, any other): left specialized,
# these would compile new variants in the middle of serving (0.3-0.6 s each for sm_90 on a
# 2-core host: benchmarks/kernel_compile_time.py) whenever a step first meets a new class (one
# request, a block table 16 blocks wide...).
# None of them strides the contiguous head dimension, so no vectorized load depends on them.
STEP_VARYING_ARGS = ("num_requests", "short_query_len", "stride_bt_req")


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
def _first_key(pos, SPAN: tl.constexpr, CHUNKED: tl.constexpr):
    """AttentionSpan.first_key: the first key a query at ``pos`` sees under a span of SPAN."""
    if CHUNKED:
        return pos - pos % SPAN
    else:
        return pos - (SPAN - 1)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _tanh(x):
    """tanh in fp32, within a few ulp. Written out because Triton has no tl.tanh and libdevice's
    does not run in the interpreter. exp2(-2|x| log2(e)) cannot overflow and goes to 0 for large
    |x|, so the quotient saturates at 1; below 1/4, where 1 - t would cancel, the odd Taylor
    series to x^9 (its first omitted term is under 1e-8 of the result there)."""
    t = tl.exp2(tl.abs(x) * (-2.0 * _LOG2_E))
    large = (1.0 - t) / (1.0 + t)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835)))))
    return tl.where(tl.abs(x) < 0.25, small, tl.where(x < 0, -large, large))


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    block_table_row,
    tile_begin,
    tile_end,
    kv_len,
    last_visible,
    qk_scale,
    stride_bt_block,
    stride_c_block,
    stride_c_slot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPAN: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over key tiles [tile_begin, tile_end). Unless MASKED, every row sees every
    key of these tiles and they lie inside the sequence: no bounds checks, causal or span masks.
    Scores are kept in log2 units for exp2; qk_scale takes q.k there (scale * log2(e)), or with a
    SOFTCAP to the tanh's argument (scale / SOFTCAP)."""
    offs_n = tl.arange(0, TILE_N)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    mask_dims: tl.constexpr = BLOCK_D != HEAD_DIM
    for tile in range(tile_begin, tile_end):
        key_pos = tile * TILE_N + offs_n
        key_valid = key_pos < kv_len
        page = _load(
            block_table_row + (key_pos // BLOCK_SIZE) * stride_bt_block, key_valid, MASKED
        ).to(tl.int64)
        slot_offset = page * stride_c_block + (key_pos % BLOCK_SIZE) * stride_c_slot
        k = _load(
            k_base + slot_offset[None, :] + dims[:, None],
            key_valid[None, :] & dim_valid[:, None],
            MASKED or mask_dims,
        )
        v = _load(
            v_base + slot_offset[:, None] + dims[None, :],
            key_valid[:, None] & dim_valid[None, :],
            MASKED or mask_dims,
        )
        # An fp8 cache's tiles are widened to the query's dtype (no-ops for other caches).
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            s = _tanh(s) * (SOFTCAP * _LOG2_E)
        if MASKED:
            # Also hides key_pos >= kv_len, since a valid row's last visible key is below kv_len.
            visible = key_pos[None, :] <= last_visible[:, None]
            if SPAN:
                visible &= key_pos[None, :] >= _first_key(last_visible, SPAN, CHUNKED)[:, None]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_query_block(
    query_ptr,
    cache_ptr,
    out_ptr,
    segm_acc_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    block_table_ptr,
    sinks_ptr,
    req,
    q_start,
    query_len,
    seq_len,
    q_block_local,
    kv_head,
    segment,
    qk_scale,
    num_heads,
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
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPAN: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UNMASKED_TILES: tl.constexpr,
    PARTIALS_BY_REQUEST: tl.constexpr,
):
    """Query tokens [q_block_local * BLOCK_Q, + BLOCK_Q) of request req, every query head of one
    KV head, over key segment `segment` of NUM_SEGMENTS: the result, or its partial on split-KV
    (at its token's workspace row, or with PARTIALS_BY_REQUEST at req * BLOCK_Q + its index in
    the request: see split_kv_rows).
    UNMASKED_TILES: key tiles every row sees whole skip the masks (a second loop; worth its
    registers on compute-bound prefill tiles, not on memory-bound decode tiles)."""
    context_len = seq_len - query_len
    q_first = q_block_local * BLOCK_Q
    # Row m of the tile is query token m // GROUP of this block, for query head m % GROUP of this KV head.
    rows = tl.arange(0, BLOCK_M)
    q_pos = q_first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_pos < query_len)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    tokens = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    # The products run in the cache's dtype, or the query's over an fp8 cache.
    if not cache_ptr.dtype.element_ty.is_fp8():
        q = q.to(cache_ptr.dtype.element_ty)

    # Keys this block can see at all: up to the causal limit of its last token, and from the
    # span's lower edge for its first token; tiles outside are skipped, segments split the rest.
    kv_len = tl.minimum(seq_len, context_len + q_first + BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    if SPAN:
        # Clamped after the division (truncating: a negative edge gives at most 0), not before: the
        # same tile, but ptxas then fits the sm_90 split decode tile in 128 registers, not 142.
        first_tile = tl.maximum(_first_key(context_len + q_first, SPAN, CHUNKED) // TILE_N, 0)
        tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
        tile_begin = first_tile + segment * tiles_per_segment
    else:
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_begin = segment * tiles_per_segment
    tile_end = tl.minimum(tile_begin + tiles_per_segment, num_tiles)
    # Tiles below the first token's causal limit (and, with a span, from the last token's first
    # key: no row's is later) are seen whole by every row; masked tiles remain only at the edges.
    if UNMASKED_TILES:
        full_end = tl.maximum(
            tl.minimum((context_len + q_first + 1) // TILE_N, tile_end), tile_begin
        )
        if SPAN:
            # The block's last token is at kv_len - 1.
            full_begin = tl.minimum(
                tl.maximum(tl.cdiv(_first_key(kv_len - 1, SPAN, CHUNKED), TILE_N), tile_begin),
                full_end,
            )
        else:
            full_begin = tile_begin
    else:
        full_end = tile_begin

    last_visible = context_len + q_pos
    if SPAN:
        # Rows past the request's end are never stored; given its last token's span, they still
        # see a key, so that no 0 / 0 (a NaN) is computed even there.
        last_visible = tl.minimum(last_visible, seq_len - 1)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    k_base = cache_ptr + kv_head * stride_c_head
    v_base = k_base + stride_c_kv

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if UNMASKED_TILES:
        if SPAN:
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, k_base, v_base, block_table_row, tile_begin, full_begin, kv_len,
                last_visible, qk_scale, stride_bt_block, stride_c_block, stride_c_slot, BLOCK_SIZE,
                BLOCK_D, HEAD_DIM, TILE_N, DOT_PRECISION, SPAN, CHUNKED, SOFTCAP, True,
            )  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_base, v_base, block_table_row, full_begin, full_end, kv_len,
            last_visible, qk_scale, stride_bt_block, stride_c_block, stride_c_slot, BLOCK_SIZE,
            BLOCK_D, HEAD_DIM, TILE_N, DOT_PRECISION, SPAN, CHUNKED, SOFTCAP, False,
        )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, block_table_row, full_end, tile_end, kv_len,
        last_visible, qk_scale, stride_bt_block, stride_c_block, stride_c_slot,
        BLOCK_SIZE, BLOCK_D, HEAD_DIM, TILE_N, DOT_PRECISION, SPAN, CHUNKED, SOFTCAP, True,
    )  # fmt: skip

    if NUM_SEGMENTS == 1:
        if HAS_SINKS:
            # The head's sink is one more exponential in the softmax's sum (l_i is in units of
            # 2^m_i), with no value: an overflow to inf is the right limit, an output of 0.
            sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0).to(tl.float32)
            l_i += tl.exp2(sink * _LOG2_E - m_i)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        if PARTIALS_BY_REQUEST:
            partial_rows = (req * BLOCK_Q + q_pos).to(tl.int64)
        else:
            partial_rows = tokens
        partial = (partial_rows * num_heads + heads) * NUM_SEGMENTS + segment
        tl.store(segm_max_ptr + partial, m_i, mask=row_valid)
        tl.store(segm_sum_ptr + partial, l_i, mask=row_valid)
        tl.store(
            segm_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit(do_not_specialize=STEP_VARYING_ARGS)
def _decode_attention_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    segm_acc_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,
    qk_scale,
    short_query_len,
    num_heads,
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
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPAN: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PARTIALS_BY_REQUEST: tl.constexpr,
):
    """One request (longer than short_query_len: left to the prefill launch), one KV head, one key
    segment. A query longer than one tile (a max_query_len hint below the truth) is walked tile by tile."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if query_len <= short_query_len:
        seq_len = tl.load(seq_lens_ptr + req)
        for q_block_local in range(0, tl.cdiv(query_len, BLOCK_Q)):
            _attend_query_block(
                query_ptr, cache_ptr, out_ptr, segm_acc_ptr, segm_max_ptr, segm_sum_ptr,
                block_table_ptr, sinks_ptr, req, q_start, query_len, seq_len, q_block_local,
                kv_head, segment, qk_scale, num_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt_req,
                stride_bt_block, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_Q, BLOCK_D, HEAD_DIM, TILE_N,
                NUM_SEGMENTS, DOT_PRECISION, SPAN, CHUNKED, SOFTCAP, HAS_SINKS, False,
                PARTIALS_BY_REQUEST,
            )  # fmt: skip


@triton.jit(do_not_specialize=STEP_VARYING_ARGS)
def _prefill_attention_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,
    qk_scale,
    short_query_len,
    num_requests,
    num_heads,
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
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPAN: tl.constexpr,
    CHUNKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One query block of a request longer than short_query_len, one KV head, single pass."""
    kv_head = tl.program_id(0)
    # Reversed so that the last blocks of each request, which see the most keys, start first.
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if query_len > short_query_len and q_block_local * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + req)
        # Heads of 512 channels keep one key loop, every tile masked: the unmasked loop's registers
        # spill their 64 x 512 accumulator on sm_90, and beside products that wide the masks cost
        # little (LaunchPlan).
        _attend_query_block(
            query_ptr, cache_ptr, out_ptr, out_ptr, out_ptr, out_ptr, block_table_ptr, sinks_ptr,
            req, q_start, query_len, seq_len, q_block_local, kv_head, 0, qk_scale, num_heads,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_c_kv, stride_c_block, stride_c_slot,
            stride_c_head, stride_bt_req, stride_bt_block, BLOCK_SIZE, GROUP, BLOCK_M, BLOCK_Q,
            BLOCK_D, HEAD_DIM, TILE_N, 1, DOT_PRECISION, SPAN, CHUNKED, SOFTCAP, HAS_SINKS,
            BLOCK_D <= 256, False,
        )  # fmt: skip


@triton.jit(do_not_specialize=("short_query_len",))
def _merge_segments_kernel(
    out_ptr,
    segm_acc_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    short_query_len,
    num_heads,
    stride_ot,
    stride_oh,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENT_SLOTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PARTIALS_BY_REQUEST: tl.constexpr,
):
    """Every token of one request that the decode launch handled, one query head.
    SEGMENT_SLOTS: NUM_SEGMENTS rounded up to a power of two (a tl.arange's length); the slots
    past NUM_SEGMENTS are masked off."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if query_len <= short_query_len:
        segments = tl.arange(0, SEGMENT_SLOTS)
        written = segments < NUM_SEGMENTS
        dims = tl.arange(0, BLOCK_D)
        for i in range(0, query_len):
            token = (q_start + i).to(tl.int64)
            if PARTIALS_BY_REQUEST:  # short_query_len is then the decode tiles' BLOCK_Q
                row = (req * short_query_len + i).to(tl.int64)
            else:
                row = token
            partial = (row * num_heads + head) * NUM_SEGMENTS + segments
            seg_max = tl.load(segm_max_ptr + partial, mask=written, other=float("-inf"))
            # Every token sees its own key in some segment, so the overall max is finite and the total
            # >= 1; a segment holding none of its keys (max -inf, sum and acc 0) gets weight 0.
            top = tl.max(seg_max, axis=0)
            weight = tl.exp2(seg_max - top)
            total = tl.sum(
                tl.load(segm_sum_ptr + partial, mask=written, other=0.0) * weight, axis=0
            )
            if HAS_SINKS:
                total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * _LOG2_E - top)
            acc = tl.load(
                segm_acc_ptr + partial[:, None] * BLOCK_D + dims[None, :],
                mask=written[:, None],
                other=0.0,
            )
            out = tl.sum(acc * weight[:, None], axis=0) / total
            out_row = out_ptr + token * stride_ot + head * stride_oh
            tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# Split-KV workspace slots per (token, query head); a launch uses up to this many (the rule a
# power of two; `benchmarks/attention.py --sweep-segments` also times counts between them).
MAX_SEGMENTS = 16
# Software-pipelining stages of every Hopper tile (see LaunchPlan: with fewer, a tile's K/V copies
# are not kept in flight).
HOPPER_STAGES = 5
# A decode launch is split until it has this many programs per SM, since fewer busy programs leave
# HBM bandwidth unused. Set when a decode tile (3 stages then) took 39 KB of shared memory and four
# shared an SM; at 5 stages three do. Kept at four until the segment sweep of
# `benchmarks/attention.py` measures it again: it errs toward one more segment, which the H200
# measured no worse at 32 x 4096 (split 4 161 µs, single 167 µs, 2026-12-04).
SPLIT_PROGRAMS_PER_SM = 4
# ...but never into segments shorter than this many keys: each program pays a fixed start (request
# metadata, Q tile, pipeline fill) that short segments do not amortise. On the H200 run of 2026-11-30
# the same 4096 programs (32 requests x 8 KV heads x 16 segments) reached 69% of peak bandwidth with
# segments of 256 keys (32 x 4k) and 84% with segments of 1k keys (32 x 16k).
MIN_KEYS_PER_SEGMENT = 512
# A decode tile holds every query token of a request when the whole step fits in this many rows
# (decodes, speculative 1 + k); with long queries in the step it holds 16 rows, and longer requests
# take prefill tiles.
DECODE_MAX_ROWS = 64
MERGE_NUM_WARPS = 4


@dataclass(frozen=True, slots=True)
class TileShape:
    """Tile of one launch: BLOCK_M rows (query tokens x the GQA group of one KV head) by TILE_N keys."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


# Heads wider than 512 channels (DeepSeek's latent rows: 576, padded to 1024) take decode
# tiles of 16 rows x 16 keys, 8 warps, 2 stages: 99 KB of shared memory and 178 registers on
# sm_90 without spills, where a prefill tile's 64 query rows of 1024 channels alone would take
# 128 KB. Every query is walked through them, without split-KV; only 16 query heads fit a
# tile's rows (at 512 channels too: see LaunchPlan).
WIDE_DECODE = TileShape(16, 16, 8, 2)
# At 512 channels (Gemma 4's full-attention layers) a decode tile holds every query token of a
# request up to this many rows (a 64-row one takes 255 registers); longer ones take prefill tiles.
HEAD_512_DECODE_MAX_ROWS = 32


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """The launches of one attention call, a function of shapes, device and hints only.

    Tile constants for Hopper (sm_90: H100, H200), fixed per shape class, no autotuning:
      decode tiles   16-64 rows x 64 keys, 4 warps, HOPPER_STAGES stages, every key tile masked.
                     Memory-bound: the smallest tensor-core tile and one key loop. At head_dim 128 a
                     16-row tile takes 110-146 registers per thread and 71 KB of shared memory (two
                     K/V tiles) on sm_90: three programs per SM (five at head_dim 64: 37 KB); the
                     32- and 64-row tiles of speculative steps 136-238 registers and 77-113 KB.
      prefill tiles  128 rows x 64 keys, 8 warps, HOPPER_STAGES stages (head_dim <= 128):
                     FlashAttention-2's and Triton's fused-attention tile for Hopper, 128-row tl.dot for
                     both products (two warpgroups of wgmma); 188 registers per thread and 129 KB of
                     shared memory (Q and three K/V tiles): one program per SM.
      head_dim 256   prefill 64 x 32 keys, 8 warps (4 spill the 64 x 256 accumulator); decode tiles of
                     32 keys.
      head_dim 512   (Gemma 4's full-attention layers; heads of 257-511 channels pad to it.) Tiles
                     of 16 keys, 8 warps: decode tiles of 16-32 rows (HEAD_512_DECODE_MAX_ROWS),
                     96-182 registers and 81-97 KB of shared memory; prefill 64 x 16 keys, wgmma,
                     236-255 registers (the 64 x 512 fp32 accumulator alone takes 128) and 160 KB
                     (Q and three K/V tiles), with one key loop, every tile masked: the unmasked
                     loop's registers made it spill, and beside 512-channel products the masks cost
                     little. 32 keys would take 257 KB at 5 stages. At most 16 query heads a KV
                     head, as for wider heads. Not yet measured on a GPU.
      fp8 cache      decode tiles of 32 keys (the widened tile's registers; not yet measured on a GPU).
    Why HOPPER_STAGES is 5: a key tile's K/V addresses come from a load (its pages in the block
    table), and Triton's software pipeliner puts such a dependent load one stage after the load it
    depends on. With 3 or 4 stages that left one shared-memory buffer for K and one for V, and the
    loop waited for every copy in flight at the top of each iteration (async_wait num=0 in the
    TTGIR): the next tile's K/V was requested only after the current one was consumed, so each
    program read its keys one round trip at a time. 5 stages give two buffers (three for prefill
    tiles) and a wait that leaves the next copies in flight (num=2, 4). Up to 2026-12-04 the kernels
    ran 3 stages; `benchmarks/attention.py --sweep-tiles` times both on one GPU.
    tests/kernels/test_triton_sm90_compile.py compiles these shapes for sm_90 (and the fallback for
    sm_80) without a GPU and checks that none spills, that decode tiles keep three programs per SM
    (registers and shared memory), that the Hopper tiles' loops keep copies in flight and that the
    Hopper prefill tiles use wgmma.
    Other GPUs (Ampere, Ada, Blackwell until measured) and the interpreter take a conservative fallback
    that fits 100 KB of shared memory: prefill 64 x 64 keys (32 at head_dim 256; 32 x 16 at head_dim
    512, 65 KB, where 64 rows spill on sm_80), 8 warps (4 spill on sm_80), 2 stages; decode tiles as
    on Hopper with 2 stages.

    Split-KV (by default only in steps without a prefill launch): see split_kv_segments. With a
    span (a sliding window or a chunk) the segments divide only the tiles a request's span covers,
    so the rule counts the span (plus the query), not the sequence, as the keys to split.
    """

    group: int
    block_d: int
    head_dim: int
    block_size: int
    dot_precision: str
    decode: TileShape
    decode_grid: tuple[int, int, int]
    segments: int
    # Requests with longer queries are left to the prefill launch (INT32_MAX: there is none).
    short_query_len: int
    prefill: TileShape | None
    prefill_grid: tuple[int, int] | None
    span: AttentionSpan | None
    softcap: float | None
    has_sinks: bool

    @property
    def variant(self) -> tuple[TileShape, int, TileShape | None]:
        """What Triton compiles a kernel for (the per-layer constants aside): the tiles, the
        segments and whether a prefill launch runs. Grids and the step-varying arguments vary
        freely within one variant."""
        return self.decode, self.segments, self.prefill

    def constexprs(self, tile: TileShape) -> dict[str, int | float | str]:
        return {
            "BLOCK_SIZE": self.block_size,
            "GROUP": self.group,
            "BLOCK_M": tile.block_m,
            "BLOCK_Q": tile.block_m // self.group,
            "BLOCK_D": self.block_d,
            "HEAD_DIM": self.head_dim,
            "TILE_N": tile.tile_n,
            "DOT_PRECISION": self.dot_precision,
            "SPAN": 0 if self.span is None else self.span.size,
            "CHUNKED": self.span is not None and self.span.chunked,
            "SOFTCAP": self.softcap or 0.0,
            "HAS_SINKS": self.has_sinks,
        }

    @property
    def partials_by_request(self) -> bool:
        """Whether split-KV partials are indexed by request (beside a prefill launch), not by
        token: see split_kv_rows."""
        return self.prefill is not None and self.segments > 1

    def decode_constexprs(self) -> dict[str, int | float | str]:
        """The decode launch's compile-time constants."""
        return {
            **self.constexprs(self.decode),
            "NUM_SEGMENTS": self.segments,
            "PARTIALS_BY_REQUEST": self.partials_by_request,
        }

    def merge_constexprs(self) -> dict[str, int | float | str]:
        """The merge launch's compile-time constants (split-KV only)."""
        return {
            "BLOCK_D": self.block_d,
            "HEAD_DIM": self.head_dim,
            "NUM_SEGMENTS": self.segments,
            "SEGMENT_SLOTS": triton.next_power_of_2(self.segments),
            "HAS_SINKS": self.has_sinks,
            "PARTIALS_BY_REQUEST": self.partials_by_request,
        }


def split_kv_segments(
    num_requests: int, num_kv_heads: int, num_sms: int, max_seq_len: int | None = None
) -> int:
    """Key segments per request of a decode launch: the smallest power of two that gives
    SPLIT_PROGRAMS_PER_SM programs per SM, at most MAX_SEGMENTS and at most one per
    MIN_KEYS_PER_SEGMENT keys of the longest sequence (when known). 1 = single pass, as on a CPU."""
    if num_sms <= 0:
        return 1
    most = (
        MAX_SEGMENTS
        if max_seq_len is None
        else min(MAX_SEGMENTS, max_seq_len // MIN_KEYS_PER_SEGMENT)
    )
    programs = num_requests * num_kv_heads
    segments = 1
    while segments * 2 <= most and programs * segments < SPLIT_PROGRAMS_PER_SM * num_sms:
        segments *= 2
    return segments


@functools.cache
def device_class(device: torch.device) -> tuple[int, int]:
    """(SM count, compute capability major) of a CUDA device; (0, 0) elsewhere."""
    if device.type != "cuda":
        return 0, 0
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.major


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream decode launches share with prefill launches on a GPU; None elsewhere."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=1024, typed=True)
def plan_launches(
    num_tokens: int,
    num_requests: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    compute_dtype: torch.dtype,
    capability_major: int,
    num_sms: int,
    max_query_len: int,
    max_seq_len: int | None,
    split_kv: bool | int | None,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    has_sinks: bool = False,
    fp8_cache: bool = False,
) -> LaunchPlan:
    """The launch plan for one batch shape (cached: the same shape recurs every layer and step)."""
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap={softcap}: a soft cap must be positive and finite")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    hopper = capability_major == 9
    stages = HOPPER_STAGES if hopper else 2
    wide = block_d > 128
    # An fp8 tile widened to the query's dtype in registers: 32 keys take 128-162 registers on
    # sm_90 (64 keys took 168 at 3 stages), which keeps three decode programs per SM.
    decode_keys = 32 if wide or fp8_cache else 64
    min_rows = max(16, triton.next_power_of_2(group))
    all_rows = triton.next_power_of_2(group * max(max_query_len, 1))
    if block_d > 256 and min_rows > 16:
        raise ValueError(
            f"{group} query heads over one KV head of {head_dim} channels do not fit the "
            "Triton kernel's tiles (at most 16 such heads a KV head on a GPU): split the "
            "heads with --tensor-parallel-size, or use --attention-backend torch"
        )
    if block_d > 512:
        decode, short_query_len = WIDE_DECODE, INT32_MAX
    elif block_d == 512 and all_rows <= HEAD_512_DECODE_MAX_ROWS:
        decode, short_query_len = TileShape(max(all_rows, min_rows), 16, 8, stages), INT32_MAX
    elif block_d == 512:
        decode, short_query_len = TileShape(min_rows, 16, 8, stages), min_rows // group
    elif all_rows <= max(DECODE_MAX_ROWS, min_rows):
        decode = TileShape(max(all_rows, min_rows), decode_keys, 4, stages)
        short_query_len = INT32_MAX
    else:
        decode = TileShape(min_rows, decode_keys, 4, stages)
        short_query_len = min_rows // group
    prefill = prefill_grid = None
    if short_query_len != INT32_MAX:
        if block_d == 512:
            prefill = TileShape(64, 16, 8, HOPPER_STAGES) if hopper else TileShape(32, 16, 8, 2)
        elif hopper and not wide:
            prefill = TileShape(max(128, min_rows), 64, 8, HOPPER_STAGES)
        else:
            prefill = TileShape(max(64, min_rows), 32 if wide else 64, 8, stages)
        prefill_grid = (num_kv_heads, num_tokens // (prefill.block_m // group) + num_requests)

    if decode is WIDE_DECODE:
        segments = 1
    elif split_kv is None:
        # Not beside a prefill launch until measured: a mixed step served replays a graph padded
        # to max_num_seqs requests, so a rule by request count would never split it, and whether
        # splitting the decode launch pays there is for `attention.py --sweep-segments` to say.
        # (An explicit split_kv splits it: partials by request, see split_kv_rows.)
        if span is not None:
            # A decode tile visits at most the span of its first token plus its other tokens.
            span_keys = span.size + max_query_len - 1
            max_seq_len = span_keys if max_seq_len is None else min(max_seq_len, span_keys)
        segments = (
            split_kv_segments(num_requests, num_kv_heads, num_sms, max_seq_len)
            if prefill is None
            else 1
        )
    elif isinstance(split_kv, bool):
        segments = MAX_SEGMENTS if split_kv else 1
    else:
        segments = split_kv
    if not 1 <= segments <= MAX_SEGMENTS:
        raise ValueError(f"split_kv={split_kv}: segments must be from 1 to {MAX_SEGMENTS}")
    return LaunchPlan(
        group=group,
        block_d=block_d,
        head_dim=head_dim,
        block_size=block_size,
        # tl.dot on fp32 would otherwise round its inputs to tf32.
        dot_precision="ieee" if compute_dtype == torch.float32 else "tf32",
        decode=decode,
        decode_grid=(num_requests, num_kv_heads, segments),
        segments=segments,
        short_query_len=short_query_len,
        prefill=prefill,
        prefill_grid=prefill_grid,
        span=span,
        softcap=None if softcap is None else float(softcap),
        has_sinks=has_sinks,
    )


def plan_for(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    num_requests: int,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    split_kv: bool | int | None = None,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    has_sinks: bool = False,
) -> LaunchPlan:
    """The launches paged_attention makes for these tensors and hints (same defaults)."""
    num_tokens, num_heads, head_dim = query.shape
    if max_query_len is None:
        max_query_len = num_tokens - num_requests + 1 if num_tokens >= num_requests else num_tokens
    num_sms, capability_major = device_class(query.device)
    return plan_launches(
        num_tokens,
        num_requests,
        num_heads,
        kv_cache.shape[3],
        head_dim,
        kv_cache.shape[2],
        query.dtype if kv_cache.element_size() == 1 else kv_cache.dtype,  # fp8 widens to it
        capability_major,
        num_sms,
        max_query_len,
        max_seq_len,
        split_kv,
        span,
        softcap,
        has_sinks,
        kv_cache.element_size() == 1,
    )


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer passes paged_attention besides the batch: its shapes and options."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    span: AttentionSpan | None = None
    softcap: float | None = None
    has_sinks: bool = False

    def plan(
        self,
        num_tokens: int,
        num_requests: int,
        max_query_len: int,
        max_seq_len: int | None,
        *,
        block_size: int,
        compute_dtype: torch.dtype,
        fp8_cache: bool,
        device_info: tuple[int, int],
    ) -> LaunchPlan:
        """The launches this layer makes for a batch of that shape, as paged_attention plans
        them on a device of ``device_info`` (SM count, compute capability major)."""
        num_sms, capability_major = device_info
        return plan_launches(
            num_tokens, num_requests, self.num_heads, self.num_kv_heads, self.head_dim,
            block_size, compute_dtype, capability_major, num_sms, max_query_len, max_seq_len,
            None, self.span, self.softcap, self.has_sinks, fp8_cache,
        )  # fmt: skip


def warm_up_hints(
    layers: Iterable[LayerAttention],
    block_size: int,
    compute_dtype: torch.dtype,
    fp8_cache: bool,
    max_model_len: int,
    device_info: tuple[int, int],
) -> list[tuple[int, int]]:
    """(max_query_len, max_seq_len) hints of one-request steps that, run through ``layers``,
    launch every kernel variant (tiles, segments, launches: the compile-time constants)
    that plan_launches can choose for these layers on a device of ``device_info`` (its SM count
    and compute capability major, as `device_class` gives them), each variant once.

    Steps differ in two ways that reach a new variant: the query length (decode tiles grow
    with it until the request goes to the prefill launch, whose tile is fixed) and the
    segments split-KV picks, largest for one request and capped by max_seq_len (more
    requests only lower it). So one request per (query length, segment cap) reaches all."""
    layers = tuple(dict.fromkeys(layers))
    # Past this length every query goes to the prefill launch (or, for heads too wide for
    # prefill tiles, to the one wide decode tile): nothing new to reach.
    longest = max(DECODE_MAX_ROWS, *(layer.num_heads for layer in layers)) + 1
    hints: dict[tuple[tuple[TileShape, int, TileShape | None], ...], tuple[int, int]] = {}
    query_len, prefill = 1, False
    while not prefill and query_len <= longest:
        for segments in (2**i for i in range(MAX_SEGMENTS.bit_length())):
            max_seq_len = max(min(segments * MIN_KEYS_PER_SEGMENT, max_model_len), query_len)
            plans = [
                layer.plan(
                    query_len,
                    1,
                    query_len,
                    max_seq_len,
                    block_size=block_size,
                    compute_dtype=compute_dtype,
                    fp8_cache=fp8_cache,
                    device_info=device_info,
                )
                for layer in layers
            ]
            variants = tuple(p.variant for p in plans)
            hints.setdefault(variants, (query_len, max_seq_len))
            prefill = all(p.prefill is not None for p in plans)
        query_len += 1
    return list(hints.values())


@dataclass(slots=True)
class SplitKVWorkspace:
    """Partial results of the split-KV path, indexed [row, query head, segment(, dim)]: a token's
    row is its index, or beside a prefill launch request r's i-th token's r * short_query_len + i
    (split_kv_rows); a launch with fewer than MAX_SEGMENTS segments packs its partials densely
    into the same buffers."""

    acc: torch.Tensor  # fp32 [max_rows, num_heads, MAX_SEGMENTS, padded head_dim], unnormalised
    max: torch.Tensor  # fp32 [max_rows, num_heads, MAX_SEGMENTS], running max in log2 units
    sum: torch.Tensor  # fp32 [max_rows, num_heads, MAX_SEGMENTS], running sum of exponentials

    @property
    def max_rows(self) -> int:
        return self.acc.shape[0]


def allocate_split_kv_workspace(
    max_rows: int, num_heads: int, head_dim: int, device: torch.device | str
) -> SplitKVWorkspace:
    """Workspace for split-KV launches of up to max_rows rows (split_kv_rows; allocate once,
    reuse)."""
    shape = (max_rows, num_heads, MAX_SEGMENTS)
    return SplitKVWorkspace(
        acc=torch.empty(
            *shape, triton.next_power_of_2(head_dim), dtype=torch.float32, device=device
        ),
        max=torch.empty(shape, dtype=torch.float32, device=device),
        sum=torch.empty(shape, dtype=torch.float32, device=device),
    )


def split_kv_rows(plan: LaunchPlan, num_tokens: int, num_requests: int) -> int:
    """Workspace rows a split launch of this plan writes: one per token, or beside a prefill
    launch (partials_by_request) short_query_len per request, which holds at most that many
    tokens on the decode launch: the prefill chunks' tokens then take no rows, and a mixed
    step of 8192 tokens and 256 requests 1024 at 4 query heads a KV head, not 8192."""
    return num_requests * plan.short_query_len if plan.partials_by_request else num_tokens


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    span: AttentionSpan | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    split_kv: bool | int | None = None,
    workspace: SplitKVWorkspace | None = None,
    concurrent: bool = True,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """Attention of every new token over its request's cached keys: a prefill-tile launch when the
    step has long queries, a decode-tile launch, and a merge launch on split-KV.

    The cache must already hold the new tokens' K/V (call reshape_and_cache first). Nothing is read
    back to the host. Optional keyword arguments, all host-side (the executor passes the layer's
    span and softcap and the max_query_len and max_seq_len hints; out, split_kv, workspace
    and concurrent are for benchmarks and tests):
      span          each token sees only the keys from span.first_key of its position on, its
                    sliding window or its chunk (None: every earlier key), as in the reference.
      softcap       each scaled score s becomes softcap * tanh(s / softcap) before the mask and the
                    softmax (None: no cap), as in the reference.
      sinks         [num_heads] logits, one more term of each head's softmax with no value (gpt-oss;
                    None: none), as in the reference.
      out           preallocated [T, num_heads, head_dim] result; rows of tokens outside every request
                    are unspecified, as in the reference.
      max_query_len longest query of the step, known to the caller; picks the tiles and launches.
                    Without it T - R + 1 is used, exact when every request has a query token.
      max_seq_len   longest sequence (context + query) of the step; bounds the split-KV segments.
      split_kv      segments per request on the decode launch: an int (1 to MAX_SEGMENTS), True
                    (MAX_SEGMENTS), False (1: single pass) or None (the rule of split_kv_segments
                    for this GPU, a power of two; never split on a CPU).
      workspace     split-KV buffers from allocate_split_kv_workspace; allocated per call if absent.
      concurrent    on a GPU, run the decode launch on a side stream beside the prefill launch
                    (False: one after the other on the caller's stream).
      plan          launch as this plan says instead of planning (plan_for's plan for the same
                    tensors and hints with other tile constants, for a benchmark comparing them).
    A hint below the truth costs speed, never correctness.
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
    if sinks is not None:
        check_sinks(sinks, num_heads)
    if num_tokens == 0 or num_requests == 0:
        return out

    if split_kv is None and workspace is not None and workspace.max_rows < num_tokens:
        split_kv = False
    if plan is None:
        plan = plan_for(
            query,
            kv_cache,
            num_requests,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            split_kv=split_kv,
            span=span,
            softcap=softcap,
            has_sinks=sinks is not None,
        )
    if plan.segments > 1:
        rows = split_kv_rows(plan, num_tokens, num_requests)
        if workspace is None:
            workspace = allocate_split_kv_workspace(rows, num_heads, head_dim, query.device)
        elif workspace.max_rows < rows or workspace.acc.shape[1:] != (
            num_heads,
            MAX_SEGMENTS,
            plan.block_d,
        ):
            raise ValueError("split-KV workspace does not fit this batch")
        segm_acc, segm_max, segm_sum = workspace.acc, workspace.max, workspace.sum
    else:
        segm_acc = segm_max = segm_sum = out  # unused on the single-pass path

    strides = (
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
    )
    # With a cap the kernels take the tanh in natural units and only then scale to log2 units.
    qk_scale = scale * LOG2_E if plan.softcap is None else scale / plan.softcap
    # The decode launch (memory-bound) runs beside the prefill launch (compute-bound) on a side
    # stream, so that decode programs fill the registers and bandwidth a prefill program leaves on
    # each SM. The side stream waits for what came before (the cache write) and the caller's stream
    # for the side stream, so both launches stay inside the caller's stream order (and a CUDA graph).
    side = _side_stream(query.device) if concurrent and plan.prefill is not None else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(query.device))
    if plan.prefill is not None:
        _prefill_attention_kernel[plan.prefill_grid](
            query,
            kv_cache,
            out,
            query_start_loc,
            seq_lens,
            block_table,
            out if sinks is None else sinks,  # never read without sinks
            qk_scale,
            plan.short_query_len,
            num_requests,
            num_heads,
            *strides,
            **plan.constexprs(plan.prefill),
            num_warps=plan.prefill.num_warps,
            num_stages=plan.prefill.num_stages,
        )
    with torch.cuda.stream(side):  # no-op for None
        _decode_attention_kernel[plan.decode_grid](
            query,
            kv_cache,
            out,
            segm_acc,
            segm_max,
            segm_sum,
            query_start_loc,
            seq_lens,
            block_table,
            out if sinks is None else sinks,
            qk_scale,
            plan.short_query_len,
            num_heads,
            *strides,
            **plan.decode_constexprs(),
            num_warps=plan.decode.num_warps,
            num_stages=plan.decode.num_stages,
        )
        if plan.segments > 1:
            _merge_segments_kernel[(num_requests, num_heads)](
                out,
                segm_acc,
                segm_max,
                segm_sum,
                query_start_loc,
                out if sinks is None else sinks,
                plan.short_query_len,
                num_heads,
                out.stride(0),
                out.stride(1),
                **plan.merge_constexprs(),
                num_warps=MERGE_NUM_WARPS,
            )
    if side is not None:
        torch.cuda.current_stream(query.device).wait_stream(side)
    return out
