"""The decodes' step of the gated delta rule (`weir.kernels.gated_delta_net`) on a GPU, in
place in the requests' state slots: one launch for every decode of a step, each state tile
read once and written once.

In PyTorch operators the step gathers the slots' states, makes four passes over them (decay,
read, write, read) and scatters them back: ~12 kernels and six trips through HBM for
tensors of 1 MB a request and layer (Qwen 3.5's 16 value heads of 128 x 128 float32).
Here a program holds a [head_k_dim, BLOCK_V] tile of one request's value head in registers
and does all of it there: S *= exp(g); u = beta * (v - S^T k); S += k u^T; o = S^T q.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    state_ptr,
    rows_ptr,
    slots_ptr,
    fresh_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    num_v_heads,
    group,
    k_dim,
    v_dim,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    decode = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + decode)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    k_mask, v_mask = ks < k_dim, cols < v_dim
    slot = tl.load(slots_ptr + decode)
    fresh = tl.load(fresh_ptr + decode) != 0
    # q and k are the key head's, which serves ``group`` consecutive value heads.
    key_row = (row * (num_v_heads // group) + head // group) * k_dim
    q = tl.load(q_ptr + key_row + ks, mask=k_mask, other=0.0)
    k = tl.load(k_ptr + key_row + ks, mask=k_mask, other=0.0)
    head_row = row * num_v_heads + head
    v = tl.load(v_ptr + head_row * v_dim + cols, mask=v_mask, other=0.0)
    g = tl.load(g_ptr + head_row)
    beta = tl.load(beta_ptr + head_row)
    tile = state_ptr + ((slot * num_v_heads + head) * k_dim + ks[:, None]) * v_dim + cols[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    # A fresh request's slot holds another's state (or nothing): never read.
    s = tl.load(tile, mask=mask & ~fresh, other=0.0) * tl.exp(g)
    u = beta * (v - tl.sum(s * k[:, None], axis=0))
    s += k[:, None] * u[None, :]
    tl.store(tile, s, mask=mask)
    out = out_ptr + (decode * num_v_heads + head) * v_dim + cols
    tl.store(out, tl.sum(s * q[:, None], axis=0), mask=v_mask)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """`CpuKernels.gated_delta_decode`'s step on a GPU: D single-token requests, request r's
    token row rows[r] of q, k [T, Hk, Dk] (L2-normalized, q scaled by Dk ** -0.5), v [T, Hv,
    Dv] and g, beta [T, Hv], all float32 and contiguous; its state slot slots[r] of state [S,
    Hv, Dk, Dv] (float32, contiguous), updated in place, zero where fresh[r] is 1 (rows,
    slots, fresh int64 [D]). Returns o [D, Hv, Dv] float32."""
    num_v_heads, v_dim = v.shape[1:]
    k_dim = k.shape[2]
    out = torch.empty(len(rows), num_v_heads, v_dim, dtype=torch.float32, device=v.device)
    if not len(rows):
        return out
    block_v = min(32, triton.next_power_of_2(v_dim))
    grid = (len(rows), num_v_heads, triton.cdiv(v_dim, block_v))
    _decode_kernel[grid](
        state, rows, slots, fresh, q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
        beta.contiguous(), out, num_v_heads, num_v_heads // k.shape[1], k_dim, v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, num_warps=4,
    )  # fmt: skip
    return out
