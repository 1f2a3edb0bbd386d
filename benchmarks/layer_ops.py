"""A decoder layer's elementwise work on a GPU: PyTorch operators against the Triton layer
kernels (`weir.kernels.triton_layers`), per call and per decode step.

    python benchmarks/layer_ops.py [--layers 16] [--hidden 2048] [--heads 32 8] [--head-dim 64]
        [--intermediate 8192] [--tokens 1 256 2048] [--device cpu]

For each token count and operation (RMSNorm, RoPE over the Q and K heads of a fused QKV
output, SiLU-and-multiply over a fused gate/up output; bf16, the Llama-3.2-1B shape by
default): the device time of one call, replayed from a CUDA graph
(`triton.testing.do_bench_cudagraph`: no launch cost), and the wall time of one call
when 500 are issued eagerly and then waited for (launches included: what an eager step
pays). The last table adds them up for one step of ``--layers`` layers (two norms, one
RoPE and one SiLU-and-multiply each, plus the final norm). ``--device cpu`` runs the
kernels under the Triton interpreter (a dry run of this script: no device times, and the
eager times say nothing).
"""

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

EAGER_CALLS = 500


def eager_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Wall time per call of ``calls`` calls issued back to back, then synchronized."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def _no_sync() -> None:
    pass


def operations(
    num_tokens: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[Callable[[], object], Callable[[], object], float]]:
    """Per operation: the PyTorch operators, the kernel, and the largest difference between
    their results, on random bf16 activations of ``num_tokens`` tokens."""
    from weir.kernels.triton_layers import TritonLayerKernels
    from weir.services.executor.layers import RMSNorm, apply_rope, silu_and_mul

    kernels = TritonLayerKernels()
    num_q, num_kv = args.heads
    norm = RMSNorm(args.hidden, 1e-5, device, dtype)
    norm.weight.fill_(1.0)
    x = torch.randn(num_tokens, args.hidden, device=device, dtype=dtype)
    qkv = torch.randn(num_tokens, num_q + 2 * num_kv, args.head_dim, device=device, dtype=dtype)
    qk = qkv[:, : num_q + num_kv]  # the Q and K heads of a fused projection: strided rows
    freqs = torch.arange(num_tokens, device=device)[:, None] * torch.rand(
        args.head_dim // 2, device=device
    )
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    gate_up = torch.randn(num_tokens, 2 * args.intermediate, device=device, dtype=dtype)

    def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item()

    rotated = qk.clone()
    kernels.rope_(rotated, cos, sin)
    return {
        "rms_norm": (
            lambda: norm(x),
            lambda: kernels.rms_norm(x, norm.weight, norm.eps),
            max_diff(kernels.rms_norm(x, norm.weight, norm.eps), norm(x)),
        ),
        "rope": (
            lambda: apply_rope(qk, cos[:, None], sin[:, None]),
            lambda: kernels.rope_(qk, cos, sin),
            max_diff(rotated, apply_rope(qk, cos[:, None], sin[:, None])),
        ),
        "silu_mul": (
            lambda: silu_and_mul(gate_up, None),
            lambda: kernels.silu_mul_(gate_up),
            max_diff(kernels.silu_mul_(gate_up.clone()), silu_and_mul(gate_up.clone(), None)),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 2048])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    on_gpu = args.device == "cuda"
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import triton.testing

    device, dtype = torch.device(args.device), torch.bfloat16 if on_gpu else torch.float16
    sync = torch.cuda.synchronize if on_gpu else _no_sync
    calls = EAGER_CALLS if on_gpu else 2
    name = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter"
    print(f"# {name}, {dtype}, hidden {args.hidden}, heads {args.heads[0]}/{args.heads[1]}")
    print("| tokens | op | operators: device us | kernel: device us | operators: eager us "
          "| kernel: eager us | max abs diff |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    per_step = []
    for num_tokens in args.tokens:
        times = {}
        for op, (operators, kernel, diff) in operations(num_tokens, args, device, dtype).items():
            graphed = [triton.testing.do_bench_cudagraph(f) * 1e3 if on_gpu else float("nan")
                       for f in (operators, kernel)]  # fmt: skip
            eager = [eager_us(f, calls, sync) for f in (operators, kernel)]
            times[op] = row = (*graphed, *eager)
            cells = " | ".join(f"{t:.1f}" for t in row)
            print(f"| {num_tokens} | {op} | {cells} | {diff:.3g} |")
        norms = 2 * args.layers + 1
        per_step.append(
            (
                num_tokens,
                [norms * times["rms_norm"][i] + args.layers * (times["rope"][i] + times["silu_mul"][i])
                 for i in range(4)],
            )
        )  # fmt: skip
    print(
        f"\nOne step of {args.layers} layers (their norms, RoPE, SiLU-and-multiply; the final norm):"
    )
    print("| tokens | operators: device ms | kernels: device ms | operators: eager ms "
          "| kernels: eager ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for num_tokens, step in per_step:
        print(f"| {num_tokens} | " + " | ".join(f"{t / 1e3:.3f}" for t in step) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
