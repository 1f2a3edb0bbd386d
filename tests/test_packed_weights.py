"""Projections prepacked for oneDNN compute what `F.linear` computes (the whole model with
packed weights is checked against transformers in test_model_core and
test_smollm2_greedy), and packing applies to float32 on a CPU only."""

import pytest
import torch

from weir.services.executor.packed_weights import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="PyTorch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 72, generator=gen)
    bias = torch.randn(100, generator=gen)
    x = torch.randn(rows, 2 * 72, generator=gen)[:, :72]  # strided rows, as split views are
    residual = torch.randn(rows, 100, generator=gen)
    packed = PackedLinear(weight, bias)
    want = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(packed(x), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed.add_to(residual, x), want + residual, atol=1e-4, rtol=1e-5)
    assert torch.equal(packed.dense_weight(), weight)
    assert PackedLinear(weight)(x).shape == (rows, 100)


def test_only_float32_on_a_cpu_is_packed():
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)
