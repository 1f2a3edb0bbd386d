"""The native CPU kernels' builds a test checks: the one `-march=native` gives here and, on a
machine with AVX-512, the 256-bit one too (built with ``-mno-avx512f``), which AVX2 machines
run: the matmul, the attention and the activations have a kernel for each vector width. The
bfloat16 matmul has two more where the CPU has them: where it has AVX512_BF16, the 512-bit
build without it (``-mno-avx512bf16``), which widens the pairs as AVX-512 machines without it
do; where it has AMX (whose tiles the native build uses from a few rows up), the build without
AMX (``-mno-amx-tile``), whose vector kernel the other rows and machines without AMX run. The
builds without a feature drop AMX too, as the machines they stand for have none."""

import functools

import pytest

from weir.kernels import cpu_native

NATIVE = cpu_native.load()
FLAGS = cpu_native._cpu_id().split() if NATIVE is not None else []
AVX512 = "avx512f" in FLAGS
AVX512_BF16 = "avx512_bf16" in FLAGS
AMX_BF16 = "amx_bf16" in FLAGS

NO_AMX = ("-mno-amx-tile",) if AMX_BF16 else ()  # a compiler without AMX may not know it
BUILD_FLAGS = {
    "native-256": ("-mno-avx512f", *NO_AMX),
    "native-no-bf16": ("-mno-avx512bf16", *NO_AMX),
    "native-no-amx": NO_AMX,
}


@functools.cache
def build(name: str) -> cpu_native.CpuKernels | None:
    """The kernels of a BUILDS or BF16_BUILDS name."""
    return cpu_native.load_with(BUILD_FLAGS[name]) if name in BUILD_FLAGS else NATIVE


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
    pytest.param(
        "native-no-amx",
        marks=pytest.mark.skipif(not AMX_BF16, reason="no AMX here: 'native' has no tiles"),
    ),
]
