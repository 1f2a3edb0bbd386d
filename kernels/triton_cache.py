"""Triton kernel that writes new tokens' K and V into the paged KV cache.

Same semantics and signature as `weir.kernels.reference.reshape_and_cache`:
token t goes to block `slot_mapping[t] // block_size`, offset
`slot_mapping[t] % block_size`; a slot of -1 is padding and is skipped.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )

    if FP8_MAX > 0:  # an fp8 cache saturates, as weir.kernels.reference.to_cache
        key = tl.minimum(tl.maximum(key.to(tl.float32), -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value.to(tl.float32), -FP8_MAX), FP8_MAX)
    dst = (
        cache_ptr
        + block * stride_c_block
        + offset * stride_c_slot
        + heads[:, None] * stride_c_head
        + dims[None, :]
    )
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K and V into its cache slot (in place).

    key, value: [T, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim] with a contiguous last dimension (any float dtype, fp8 included);
    slot_mapping: [T].
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(
            "reshape_and_cache needs a contiguous head dimension in key, value and kv_cache"
        )
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=torch.finfo(kv_cache.dtype).max if kv_cache.element_size() == 1 else 0.0,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
