"""Prepacked projections compute what `F.linear` computes, in both packings: the native
kernels' panels and oneDNN's layout (the whole model with packed weights is checked against
transformers in test_model_core and test_smollm2_greedy), and packing applies to float32 on
a CPU only."""

import pytest
import torch
from native_builds import AMX_BF16, AVX512, AVX512_BF16, BF16_BUILDS, BUILDS, NATIVE, build

from weir.kernels import cpu_native
from weir.services.executor.packed_weights import PackedLinear, can_pack

PACKINGS = [
    *BUILDS,
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(
            not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
        ),
    ),
]


def kernels_of(packing: str) -> cpu_native.CpuKernels | None:
    return None if packing == "onednn" else build(packing)


# Rows around the kernel's 6-row blocks and 96-row chunks; 100 outputs leave a partial panel.
@pytest.mark.parametrize("rows", [1, 5, 7, 13, 64, 97, 300])
@pytest.mark.parametrize("packing", PACKINGS)
def test_packed_linear_matches_f_linear(rows, packing):
    kernels = kernels_of(packing)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 72, generator=gen)
    bias = torch.randn(100, generator=gen)
    x = torch.randn(rows, 2 * 72, generator=gen)[:, :72]  # strided rows, as split views are
    residual = torch.randn(rows, 3 * 100, generator=gen)[:, 100:200]
    packed = PackedLinear(weight, bias, kernels)
    want = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(packed(x), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(packed.add_to(residual, x), want + residual, atol=1e-4, rtol=1e-5)
    assert torch.equal(packed.dense_weight(), weight)
    unbiased = PackedLinear(weight, kernels=kernels)
    torch.testing.assert_close(unbiased(x), want - bias, atol=1e-4, rtol=1e-5)


# 2 x 48 outputs: each half fills whole panels, so the native packing fuses the activation
# into the matmul; 2 x 40 do not, so it falls back to the projection then SiLU-and-multiply.
@pytest.mark.parametrize("intermediate", [48, 40])
@pytest.mark.parametrize("rows", [1, 7, 97])
@pytest.mark.parametrize("packing", PACKINGS)
def test_packed_gate_up_silu_mul_matches_pytorch(intermediate, rows, packing):
    kernels = kernels_of(packing)
    gen = torch.Generator().manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, 72, generator=gen)
    bias = torch.randn(2 * intermediate, generator=gen)
    x = torch.randn(rows, 2 * 72, generator=gen)[:, :72]
    gate, up = torch.nn.functional.linear(x, weight, bias).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = PackedLinear(weight, bias, kernels).silu_mul(x)
    assert got.shape == (rows, intermediate)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    unbiased = PackedLinear(weight, kernels=kernels).silu_mul(x)
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    torch.testing.assert_close(unbiased, torch.nn.functional.silu(gate) * up, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not AVX512, reason="one native kernel here")
def test_the_512_and_256_bit_kernels_give_equal_results():
    """Each output is summed in the same order by both: a model decodes the same on either."""
    narrow = kernels_of("native-256")
    gen = torch.Generator().manual_seed(1)
    for n, k, m in ((100, 72, 13), (3072, 576, 97)):
        weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
        wide_out = NATIVE.linear(x, NATIVE.pack_panels(weight), n)
        assert torch.equal(wide_out, narrow.linear(x, narrow.pack_panels(weight), n))
    gated = NATIVE.linear_silu_mul(x, NATIVE.pack_panels(weight), n // 2)
    assert torch.equal(gated, narrow.linear_silu_mul(x, narrow.pack_panels(weight), n // 2))


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """What bf16 panels compute, in float64: x and the weight rounded to bfloat16 (PyTorch's
    rounding), their products summed exactly."""
    want = x.bfloat16().double() @ weight.bfloat16().double().t()
    return want if bias is None else want + bias.double()


# 71 inputs: an odd count, so the last pair is half padding; 96: three steps of AMX's tiles
# (used from 5 rows where the CPU has them), seven panels the last unit's one alone.
@pytest.mark.parametrize("inputs", [71, 96])
@pytest.mark.parametrize("rows", [1, 5, 7, 13, 64, 97, 300])
@pytest.mark.parametrize("build_name", BF16_BUILDS)
def test_bf16_panels_match_the_bf16_rounded_product(inputs, rows, build_name):
    kernels = build(build_name)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, inputs, generator=gen)
    bias = torch.randn(100, generator=gen)
    x = torch.randn(rows, 2 * inputs, generator=gen)[:, :inputs]
    residual = torch.randn(rows, 3 * 100, generator=gen)[:, 100:200]
    packed = PackedLinear(weight.bfloat16(), bias, kernels)
    assert packed.weight.dtype == torch.int32
    assert packed.weight.shape == (7, -(-inputs // 2), 16)
    want = bf16_reference(x, weight, bias)
    # float32 sums of ~100 products of magnitude ~1: within 1e-5 of the exact sum.
    torch.testing.assert_close(packed(x).double(), want, atol=1e-4, rtol=1e-5)
    got = packed.add_to(residual, x).double()
    torch.testing.assert_close(got, want + residual.double(), atol=1e-4, rtol=1e-5)
    assert torch.equal(packed.dense_weight(), weight.bfloat16())
    # Far from x @ weight.T in float32: the rounding is there, not only the sums' order.
    assert (packed(x) - torch.nn.functional.linear(x, weight, bias)).abs().max() > 1e-3


# 72 inputs: the vector kernel's; 64: AMX's tiles where the CPU has them (from 5 rows).
@pytest.mark.parametrize("inputs", [72, 64])
@pytest.mark.parametrize("rows", [1, 7, 97])
@pytest.mark.parametrize("build_name", BF16_BUILDS)
def test_bf16_gate_up_silu_mul_matches_the_bf16_rounded_product(inputs, rows, build_name):
    kernels = build(build_name)
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(2 * 48, inputs, generator=gen)
    bias = torch.randn(2 * 48, generator=gen)
    x = torch.randn(rows, inputs, generator=gen)
    gate, up = bf16_reference(x, weight, bias).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = PackedLinear(weight.bfloat16(), bias, kernels).silu_mul(x)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("build_name", BF16_BUILDS)
def test_bf16_panels_at_the_default_models_gate_up_shape(build_name):
    """3072 x 576 over 97 rows (two chunks of rows, 192 panels): the same product, with sums
    576 long."""
    kernels = build(build_name)
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(3072, 576, generator=gen), torch.randn(97, 576, generator=gen)
    got = kernels.linear(x, kernels.pack_panels(weight.bfloat16()), 3072)
    torch.testing.assert_close(got.double(), bf16_reference(x, weight), atol=2e-4, rtol=1e-5)


@pytest.mark.skipif(NATIVE is None, reason="native CPU kernels not built here")
def test_each_build_names_what_its_bf16_matmul_multiplies_with():
    """The CPU's flags (from /proc/cpuinfo) against what each build reports: AMX's tiles
    where the CPU has them, else AVX512_BF16's dot products, else float32 FMAs."""
    want = "AMX tiles" if AMX_BF16 else "AVX512_BF16" if AVX512_BF16 else "float32 FMAs"
    assert NATIVE.bf16_matmul_unit == want
    if AVX512:
        assert build("native-256").bf16_matmul_unit == "float32 FMAs"
    if AVX512_BF16:
        assert build("native-no-bf16").bf16_matmul_unit == "float32 FMAs"
    if AMX_BF16:
        assert build("native-no-amx").bf16_matmul_unit == "AVX512_BF16"


@pytest.mark.skipif(NATIVE is None, reason="native CPU kernels not built here")
def test_native_linear_refuses_a_mismatched_input():
    packed = PackedLinear(torch.randn(32, 16), kernels=NATIVE)
    with pytest.raises(ValueError, match="16 inputs"):
        packed(torch.randn(4, 17))
    with pytest.raises(ValueError, match="16 inputs"):
        packed(torch.randn(16, 4).t())
    panels = NATIVE.pack_panels(torch.randn(32, 16))
    with pytest.raises(ValueError, match="need 4 panels"):
        NATIVE.linear_silu_mul(torch.randn(4, 16), panels, 32)
    bf16 = PackedLinear(torch.randn(32, 16).bfloat16(), kernels=NATIVE)
    with pytest.raises(ValueError, match="8 input pairs"):
        bf16(torch.randn(4, 18))


def test_only_float32_on_a_cpu_is_packed():
    assert not can_pack(torch.device("cpu"), torch.bfloat16, NATIVE)
    assert not can_pack(torch.device("cuda"), torch.float32, NATIVE)
