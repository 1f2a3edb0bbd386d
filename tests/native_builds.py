"""The native CPU kernels' builds a test checks: the one `-march=native` gives here and, on a
machine with AVX-512, the 256-bit one too (built with ``-mno-avx512f``), which AVX2 machines
run: the matmul, the attention and the activations have a kernel for each vector width."""

import functools

import pytest

from weir.kernels import cpu_native

NATIVE = cpu_native.load()
AVX512 = NATIVE is not None and "avx512f" in cpu_native._cpu_id().split()


@functools.cache
def narrow() -> cpu_native.CpuKernels:
    return cpu_native.load_with(("-mno-avx512f",))


def build(name: str) -> cpu_native.CpuKernels | None:
    """The kernels of a BUILDS name."""
    return narrow() if name == "native-256" else NATIVE


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
