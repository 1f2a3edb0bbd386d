r"""The native CPU kernels of this build against another build, call by call inside the executor.

    git show REV:kernels/csrc/cpu_kernels.c > old.c
    cc -O3 -march=native -ffp-contract=fast -falign-loops=64 -fopenmp -shared -fPIC -std=c11 \
        -o old.so old.c -lm           # the flags of kernels/cpu_native.py (or REV's own)
    .venv/bin/python benchmarks/kernel_ab.py old.so [--threads 2] [--dtype bfloat16]

The executor runs `executor_step.py`'s workload once (64 requests,
the real scheduler's steps) on this build; every call of a kernel that has no side effects
(attention, RMSNorm, the matmuls) is made a second time on the other build with the same
inputs, the two in alternating order, and each build's time is summed per kernel and step
kind. The fused gate/up matmul is also timed against its unfused equivalent (`linear`
then `silu_mul_`) the same way, and both results must be equal. On a VM whose speed drifts
by 15% within minutes, builds compared within each call agree to ~1% (a build against a
copy of itself, or against one with the same kernels: 0.99-1.01), where whole runs one after
the other do not. RMSNorm at prefill steps (150 calls with 4.7 MB outputs) is the exception:
0.57-1.16 between identical kernels, so that row says nothing. `--dtype bfloat16` serves the
model as `--dtype bfloat16` does on a CPU (bf16 panels, a bf16 cache): the other build may be
this source built without AMX (`-mno-amx-tile`), say.
"""

import argparse
import ctypes
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from executor_step import Timers, run_workload

from weir.kernels import cpu_native
from weir.services.bench.workload import (
    RandomWorkload,
    load_tokenizer,
    normal_vocab_ids,
    random_requests,
)
from weir.services.executor.model_runner import ModelRunner
from weir.shared.model_store import resolve_model

PURE = ("paged_attention", "rms_norm", "linear")  # no side effects: safe to call twice


def step_kind(args: tuple) -> str:
    """A kernel's step kind from its first argument's rows: prefill steps carry ~2k tokens."""
    return "prefill" if args[0].shape[0] > 300 else "decode"


def bind(lib: ctypes.CDLL) -> cpu_native.CpuKernels:
    """`CpuKernels` over another build, with the signatures of the functions it has (an
    older build may lack later kernels; only `PURE` ones are called)."""
    for name, (restype, argtypes) in cpu_native._SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    kernels = cpu_native.CpuKernels.__new__(cpu_native.CpuKernels)
    kernels._lib = lib
    return kernels


class CallAB:
    """Wraps kernels so each call also runs an alternative, the order alternating call by
    call; seconds[(kernel, step kind)] = [A's, B's]."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.labels: dict[str, tuple[str, str]] = {}
        self.a_first = False

    def wrap(
        self, name: str, a: Callable, b: Callable, labels: tuple[str, str], same: bool = False
    ) -> Callable:
        """`a` wrapped; `same`: the two results must be equal."""
        self.labels[name] = labels

        def both(*args: Any, **kwargs: Any) -> Any:
            self.a_first = not self.a_first
            order = (0, 1) if self.a_first else (1, 0)
            outs: list[Any] = [None, None]
            seconds = self.seconds[name, step_kind(args)]
            for i in order:
                start = time.perf_counter()
                outs[i] = (a, b)[i](*args, **kwargs)
                seconds[i] += time.perf_counter() - start
            if same and not torch.equal(*outs):
                raise SystemExit(f"{name}: {labels[0]} and {labels[1]} differ")
            return outs[0]

        return both


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("library", type=Path, help="the other build (.so)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--dtype", default="float32", help="bfloat16: the bf16 panels' matmuls (AMX's, say)"
    )
    args = parser.parse_args()

    model_dir = resolve_model(None)
    runner = ModelRunner(
        model_dir,
        device="cpu",
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        num_threads=args.threads,
        dtype=args.dtype,
    )
    kernels = runner.model.attention.kernels
    if kernels is None:
        raise SystemExit("the native kernels are not available here (see kernels/cpu_native.py)")
    other = bind(ctypes.CDLL(str(args.library.resolve())))
    linear, silu_mul_ = kernels.linear, kernels.silu_mul_
    ab = CallAB()
    for name in PURE:
        setattr(
            kernels,
            name,
            ab.wrap(name, getattr(kernels, name), getattr(other, name), ("this", "other")),
        )

    def unfused(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias=None):
        return silu_mul_(linear(x, panels, 2 * out_features, bias))

    kernels.linear_silu_mul = ab.wrap(
        "gate/up + SiLU", kernels.linear_silu_mul, unfused, ("fused", "unfused"), same=True
    )

    spec = RandomWorkload(64, 32, 256, 32, 128, 0)
    requests = random_requests(spec, normal_vocab_ids(load_tokenizer(model_dir)))
    print(
        f"this build vs {args.library.name}, {runner.precision}, "
        f"torch threads {torch.get_num_threads()}"
    )
    run_workload(runner, requests, 2048, Timers())
    print(f"{'kernel':16s} {'steps':8s} {'A':>8s} {'s':>7s} {'B':>8s} {'s':>7s} {'B / A':>7s}")
    for (name, kind), (sa, sb) in sorted(ab.seconds.items()):
        a, b = ab.labels[name]
        print(f"{name:16s} {kind:8s} {a:>8s} {sa:7.2f} {b:>8s} {sb:7.2f} {sb / sa:7.3f}")


if __name__ == "__main__":
    main()
