"""The cache keys of Triton kernel launches, computed by Triton's own binder for an sm_90 GPU.

Triton compiles a kernel again for every new key: the compile-time constants, and the class
(1, a multiple of 16, other) of each specialized integer argument and pointer. The binder is
the function Triton runs on every launch to compute it; it needs no GPU, so the keys a run
would compile on a GPU can be counted under the interpreter on a CPU too.
"""

from collections.abc import Iterable

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from weir.kernels import triton_attention

ATTENTION_KERNELS = (
    triton_attention._prefill_attention_kernel,
    triton_attention._decode_attention_kernel,
    triton_attention._merge_segments_kernel,
)


class LaunchKeys:
    """Within ``with``, each launch of ``kernels`` adds (kernel name, key) to ``keys``."""

    def __init__(self, kernels: Iterable = ATTENTION_KERNELS) -> None:
        self.kernels = tuple(kernels)
        self.keys: set[tuple[str, str]] = set()

    def __enter__(self) -> "LaunchKeys":
        backend = make_backend(GPUTarget("cuda", 90, 32))
        for kernel in self.kernels:
            jit = (
                kernel
                if isinstance(kernel, JITFunction)
                else JITFunction(kernel.fn, **kernel.kwargs)
            )
            bind = create_function_from_signature(jit.signature, jit.params, backend)
            kernel.add_pre_run_hook(self._recorder(kernel.fn.__name__, bind))
        return self

    def _recorder(self, name, bind):
        def record(*args, **kwargs):
            _, specialization, options = bind(*args, **kwargs)
            self.keys.add((name, repr((specialization, sorted(options.items())))))

        return record

    def __exit__(self, *exc: object) -> None:
        for kernel in self.kernels:
            kernel.pre_run_hooks.clear()

    def per_kernel(self) -> dict[str, int]:
        counts = {kernel.fn.__name__: 0 for kernel in self.kernels}
        for name, _ in self.keys:
            counts[name] += 1
        return counts
