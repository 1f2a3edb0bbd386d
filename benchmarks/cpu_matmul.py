"""The CPU's projections: native panels vs oneDNN's packed matmul vs `F.linear`, in float32
and with bfloat16 weights.

    .venv/bin/python benchmarks/cpu_matmul.py [--threads 2] [--rows 1 8 38 64 2048]

Shapes are SmolLM2-135M's four fused projections (q/k/v 960 x 576, o 576 x 576, gate/up
3072 x 576, down 576 x 1536) over 30 layers of their own random weights, so every call reads
its weight from memory as a forward does, plus the LM head (49152 x 576). Each row count is
a decode step's (1-64 rows) or a prefill step's (2048); the packings run interleaved round
by round, and the best round of each is reported as GFLOP/s. "F.linear bf16" and "native
bf16" round x and the weight to bfloat16 and sum in float32 (the latter: `--dtype
bfloat16`'s panels; the former: PyTorch's bf16 matmul, its input converted and its output
widened as in a float32 model). Where the native bf16 matmul runs on AMX's tiles, "native
bf16 no AMX" is the same source built without them (its vector kernel).
"""

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from weir.kernels import cpu_native
from weir.services.executor.packed_weights import PackedLinear

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LM_HEAD = (49152, 576)
LAYERS = 30


def packings(kernels: cpu_native.CpuKernels) -> dict[str, Callable[[torch.Tensor], Callable]]:
    """name -> (weight -> callable(x))."""

    def dense(w: torch.Tensor) -> Callable:
        return lambda x: F.linear(x, w)

    def dense_bf16(w: torch.Tensor) -> Callable:
        w = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), w).float()

    ways = {
        "F.linear (MKL)": dense,
        "oneDNN packed": lambda w: PackedLinear(w),
        "native panels": lambda w: PackedLinear(w, kernels=kernels),
        "F.linear bf16": dense_bf16,
        "native bf16": lambda w: PackedLinear(w.bfloat16(), kernels=kernels),
    }
    if kernels.bf16_matmul_unit == "AMX tiles":
        vector = cpu_native.load_with(("-mno-amx-tile",))
        ways["native bf16 no AMX"] = lambda w: PackedLinear(w.bfloat16(), kernels=vector)
    return ways


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 38, 64, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_native.load()
    if kernels is None:
        raise SystemExit("the native kernels are not available here (see kernels/cpu_native.py)")
    gen = torch.Generator().manual_seed(0)
    layers = [
        [torch.randn(n, k, generator=gen) * 0.02 for n, k in LAYER_SHAPES] for _ in range(LAYERS)
    ]
    lm_head = torch.randn(*LM_HEAD, generator=gen) * 0.02
    ways = packings(kernels)
    packed = {
        name: ([[pack(w) for w in layer] for layer in layers], pack(lm_head))
        for name, pack in ways.items()
    }
    print(f"threads {args.threads}, best of {args.rounds} rounds, GFLOP/s")
    print(f"{'rows':>5} {'what':<28}" + "".join(f"{name:>20}" for name in ways))
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=gen) for _, k in LAYER_SHAPES]
        x_head = torch.randn(rows, LM_HEAD[1], generator=gen)
        for name, (fns, head) in packed.items():  # same results before timing
            tol = dict(atol=3e-2, rtol=1e-2) if "bf16" in name else dict(atol=1e-3, rtol=1e-4)
            want = F.linear(xs[2], layers[0][2])
            torch.testing.assert_close(fns[0][2](xs[2]), want, **tol)
            torch.testing.assert_close(head(x_head), F.linear(x_head, lm_head), **tol)
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for name, (fns, head) in packed.items():
                start = time.perf_counter()
                for layer in fns:
                    for fn, x in zip(layer, xs, strict=True):
                        fn(x)
                mid = time.perf_counter()
                head(x_head)
                end = time.perf_counter()
                for what, secs in (("30 layers", mid - start), ("LM head", end - mid)):
                    best[what, name] = min(best.get((what, name), float("inf")), secs)
        layer_flops = 2 * rows * sum(n * k for n, k in LAYER_SHAPES) * LAYERS
        head_flops = 2 * rows * LM_HEAD[0] * LM_HEAD[1]
        for what, flops in (("30 layers", layer_flops), ("LM head", head_flops)):
            rates = "".join(f"{flops / best[what, name] / 1e9:20.1f}" for name in ways)
            print(f"{rows:>5} {what:<28}{rates}")


if __name__ == "__main__":
    main()
