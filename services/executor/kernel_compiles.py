"""Triton kernels compiled while this process serves: counted, timed and logged.

Every kernel variant a step can launch is compiled before serving (`kernel_warmup`, the CUDA
graphs' capture); one compiled later stalls every running request while it compiles
(0.3-0.6 s for an attention variant on a 2-core host). Triton calls a hook before and after
each compilation it makes (its process-wide ``knobs.runtime.jit_cache_hook`` and
``jit_post_compile_hook``, a load from its cache on disk included); ``KernelCompiles.watch``
sets them, once per process, so a compilation after start-up shows in the executor's
metrics and log, naming the kernel.
"""

import time
from collections.abc import Callable

from triton import knobs


class KernelCompiles:
    """Calls ``on_compile(kernel, seconds)`` after each Triton compilation from ``watch`` on."""

    def __init__(self, on_compile: Callable[[str, float], None]) -> None:
        self._on_compile = on_compile
        self._started = 0.0

    def watch(self) -> None:
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **_: object) -> None:
        # Returning None: Triton goes on to compile (True would skip the launch).
        self._started = time.perf_counter()

    def _after(self, *, repr: str, **_: object) -> None:
        self._on_compile(repr, time.perf_counter() - self._started)
