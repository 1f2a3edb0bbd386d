"""Triton kernels for a decoder layer's elementwise work on a GPU: RMSNorm, rotary
embedding, SiLU-and-multiply, one launch each (and a Gated DeltaNet's decode step,
`triton_gated_delta.py`).

In PyTorch operators these are 4 kernels per RMSNorm in bf16 (upcast, normalise, downcast,
scale), 6 for the rotate-half RoPE and 2 for SiLU and multiply: 16 of the ~22 kernels a
decoder layer launches in a decode step (counted from the operators), each moving a few
megabytes or less. Each costs a launch on the host in an eager step, and a few microseconds
of the GPU even inside a CUDA graph; here they are 3.

Every kernel rounds where the PyTorch operators it replaces round (to the activations'
dtype after each operator, with fp32 in between), so the results equal theirs up to the
fp32 rounding of a reduction order or an ``exp``: within one unit in the last place of
bf16 or fp16, and equal in fp32 up to fp32 rounding.
``CpuKernels`` (`weir.kernels.cpu_native`) offers the same three methods on the CPU.
"""

import torch
import triton
import triton.language as tl

from weir.kernels.triton_gated_delta import gated_delta_decode


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x, stride_out, dim, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / dim + eps))
    normed = (x * rstd).to(out_ptr.dtype.element_ty)  # as HF: normalise in fp32, then cast
    weight = tl.load(weight_ptr + cols, mask=mask)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    num_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(first, mask=mask)
    x2 = tl.load(first + half, mask=mask)
    dtype = x1.dtype
    cos = tl.load(cos_ptr + token * stride_ct + dims, mask=dims < half).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + dims, mask=dims < half).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x1*cos - x2*sin and x2*cos + x1*sin, each product rounded as its own operator is.
    out1 = (a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)
    out2 = (a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, stride_row, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    gate_ptr = gate_up_ptr + row * stride_row + cols
    gate = tl.load(gate_ptr, mask=mask)
    up = tl.load(gate_ptr + dim, mask=mask)
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    tl.store(gate_ptr, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


# Columns of gate per SiLU-and-multiply program: 8 KB of bf16 gate and up per program.
SILU_BLOCK = 2048


class TritonLayerKernels:
    """RMSNorm, RoPE and SiLU-and-multiply of `weir.services.executor.layers`, one launch
    each. Tensors are on one device; the last dimension of every activation is contiguous,
    rows (and RoPE's heads) may be strided."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [T, dim] into a new [T, dim] tensor of x's dtype."""
        num_tokens, dim = x.shape
        out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
        block = triton.next_power_of_2(dim)
        if num_tokens:
            _rms_norm_kernel[(num_tokens,)](
                x, weight, out, x.stride(0), out.stride(0), dim, eps,
                BLOCK=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
            )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half RoPE in place: x [T, heads, D]; cos, sin [T, D/2] with contiguous rows."""
        num_tokens, num_heads, head_dim = x.shape
        if not num_tokens:
            return
        half = head_dim // 2
        _rope_kernel[(num_tokens,)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), num_heads, half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4,
        )  # fmt: skip

    def silu_mul_(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up written over gate, for gate_up [T, 2 * I] (rows may be strided):
        returns that [T, I] view."""
        num_tokens, dim = gate_up.shape[0], gate_up.shape[1] // 2
        block = min(SILU_BLOCK, triton.next_power_of_2(dim))
        if num_tokens:
            _silu_mul_kernel[(num_tokens, triton.cdiv(dim, block))](
                gate_up, gate_up.stride(0), dim, BLOCK=block, num_warps=4
            )
        return gate_up[:, :dim]

    # A Gated DeltaNet's decodes, one launch.
    gated_delta_decode = staticmethod(gated_delta_decode)
