"""Triton reshape_and_cache against the PyTorch reference (on CPU), on a GPU or under the interpreter."""

import pytest
import torch

from weir.kernels import reference
from weir.kernels.triton_cache import reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_cache_after(key, value, initial, slot_mapping) -> torch.Tensor:
    cache = initial.clone().to(DEVICE)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), cache, slot_mapping.to(DEVICE))
    return cache.cpu()


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [(2, 64, 16, torch.float32), (3, 80, 32, torch.float16), (1, 128, 16, torch.float16)],
)
def test_reshape_and_cache_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 11
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Distinct slots scattered over the cache, with two padding tokens.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 7]] = -1
    initial = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(
        dtype
    )

    expected = initial.clone()
    reference.reshape_and_cache(key, value, expected, slots)

    assert torch.equal(triton_cache_after(key, value, initial, slots.to(torch.int32)), expected)


def test_reshape_and_cache_casts_and_reads_strided_inputs():
    # K and V as views into one fused projection output (non-contiguous token stride), cast to fp16.
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 64, 16
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.tensor([17, 0, -1, 31, 16])
    expected = torch.zeros(2, 3, block_size, num_kv_heads, head_dim, dtype=torch.float16)
    reference.reshape_and_cache(key.cpu(), value.cpu(), expected, slots)

    actual = triton_cache_after(key, value, torch.zeros_like(expected), slots)

    assert torch.equal(actual, expected)
    assert actual[:, 2].abs().sum() == 0  # block 2 was never addressed


# The interpreter's float downcast (triton/runtime/interpreter.py, _convert_float) rounds
# half up without carrying into the exponent: 31.07 becomes 16 in e4m3, not 32. The GPU's
# cvt instructions round to nearest even.
@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter's fp8 cast rounds wrongly")
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_takes_keys_converted_as_pytorch_converts_them(dtype, cache_dtype):
    """--kv-cache-dtype fp8: every byte as the reference's saturating cast writes it, values
    far past e4m3's 448 (and, in bfloat16, e5m2's 57344) included."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_kv_heads, head_dim, block_size = 9, 2, 64, 16
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3e4).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([17, 0, -1, 31, 16, 40, 3, -1, 47])
    initial = torch.randn(2, 3, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    expected = initial.clone()
    reference.reshape_and_cache(key, value, expected, slots)

    actual = triton_cache_after(key, value, initial, slots)

    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
