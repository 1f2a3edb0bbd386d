"""The native CPU kernels' builds a test checks: the one `-march=native` gives here and, on a
machine with AVX-512, the 256-bit one too (built with ``-mno-avx512f``), which AVX2 machines
run: the matmul, the attention and the activations have a kernel for each vector width. The
bfloat16 matmul has a third where the CPU has AVX512_BF16: the 512-bit build without it
(``-mno-avx512bf16``), which widens the pairs as AVX-512 machines without it do."""

import functools

import pytest

from weir.kernels import cpu_native

NATIVE = cpu_native.load()
AVX512 = NATIVE is not None and "avx512f" in cpu_native._cpu_id().split()
AVX512_BF16 = NATIVE is not None and "avx512_bf16" in cpu_native._cpu_id().split()


@functools.cache
def narrow() -> cpu_native.CpuKernels:
    return cpu_native.load_with(("-mno-avx512f",))


@functools.cache
def without_bf16() -> cpu_native.CpuKernels:
    return cpu_native.load_with(("-mno-avx512bf16",))


def build(name: str) -> cpu_native.CpuKernels | None:
    """The kernels of a BUILDS or BF16_BUILDS name."""
    if name == "native-256":
        return narrow()
    return without_bf16() if name == "native-no-bf16" else NATIVE


BUILDS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(NATIVE is None, reason="native CPU kernels not built here"),
    ),
    pytest.param(
        "native-256",
        marks=pytest.mark.skipif(
            not AVX512, reason="no AVX-512 here: 'native' is the 256-bit build"
        ),
    ),
]
BF16_BUILDS = [
    *BUILDS,
    pytest.param(
        "native-no-bf16",
        marks=pytest.mark.skipif(
            not AVX512_BF16, reason="no AVX512_BF16 here: 'native' widens the pairs"
        ),
    ),
]
