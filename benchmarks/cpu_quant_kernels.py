"""CPU matmul kernels for quantized / bfloat16 weights on a whole model's shapes.

    .venv/bin/python benchmarks/cpu_quant_kernels.py [--threads 1] [--rows 1 8 16 64] [--rounds 5]

One "pass" is every projection of SmolLM2-135M's 30 layers (distinct weights, so a decode
step reads them from memory, not cache: 576->960 qkv, 576->576 o, 576->3072 gate/up,
1536->576 down) plus the 49152x576 LM head, on M rows of activations. Kernels, each timed
including its input/output conversions: fp32 ``F.linear``; Weir's float32 panels
(``fp32-panels``, what the float32 default runs); bf16 ``F.linear``; PyTorch's packed int8
(``_weight_int8pack_mm``, bf16 in/out), packed int4 (``_weight_int4pack_mm_for_cpu``, group 32,
bf16 in/out); fbgemm's dynamic int8 (``quantized.linear_dynamic``, activations quantized per
tensor); and Weir's ``Int8Weight.matmul`` (what ``--quantization int8`` runs): over the native
int8 panels (``weir-int8``) and without the native kernels (``weir-int8-pytorch``). Methods are
interleaved and the minimum over rounds is kept, so a shared machine's noise hits all.
"""

import argparse
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from weir.kernels import cpu_native
from weir.kernels.cpu_native import CpuKernels
from weir.services.executor.packed_weights import PackedLinear
from weir.services.executor.quantization import Int8Weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS = 30
VOCAB = 49152
INT4_GROUP = 32


def _int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).view(n, k), 8)
    # The kernel computes (code - 8) * scale + zero.
    scale_zero = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return packed, scale_zero.bfloat16()


def kernel(method: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ w.T`` (float32 in and out) by ``method``."""
    if method == "fp32":
        return lambda x: F.linear(x, w)
    if method == "bf16":
        wb = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb).float()
    if method == "int8pack":
        codes, scale = _int8_codes(w)
        scale_bf16 = scale.bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes, scale_bf16).float()
    if method == "int4pack":
        packed, scale_zero = _int4_packed(w)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), packed, INT4_GROUP, scale_zero
        ).float()
    if method == "fbgemm-dyn":
        _, scale = _int8_codes(w)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        qw = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        packed_fb = torch.ops.quantized.linear_prepack(qw, None)
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed_fb, True)
    if method == "fp32-panels":
        return PackedLinear(w, kernels=_native()).forward
    if method == "weir-int8":
        return Int8Weight(w, _native()).matmul
    if method == "weir-int8-pytorch":
        return Int8Weight(w).matmul
    raise ValueError(method)


def _native() -> CpuKernels:
    kernels = cpu_native.load()
    if kernels is None:
        raise SystemExit(
            "the native CPU kernels did not build here: leave out fp32-panels, weir-int8"
        )
    return kernels


METHODS = (
    "fp32",
    "fp32-panels",
    "bf16",
    "int8pack",
    "int4pack",
    "fbgemm-dyn",
    "weir-int8",
    "weir-int8-pytorch",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.ao's deprecation notices
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for _ in range(NUM_LAYERS) for n, k in SHAPES]
    head = torch.randn(VOCAB, 576, generator=g) * 0.02
    kernels = {m: ([kernel(m, w) for w in weights], kernel(m, head)) for m in args.methods}
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
            for method, (layer_fns, head_fn) in kernels.items():
                start = time.perf_counter()
                for fn, w in zip(layer_fns, weights):
                    fn(xs[w.shape[1]])
                mid = time.perf_counter()
                head_fn(xs[576])
                end = time.perf_counter()
                old = best.get((method, rows), (float("inf"), float("inf")))
                best[(method, rows)] = (min(old[0], mid - start), min(old[1], end - mid))
    print(f"torch {torch.__version__}, {args.threads} threads, min over {args.rounds} rounds")
    print("| rows | kernel | layers ms | LM head ms | ms per row |")
    print("|---:|---|---:|---:|---:|")
    for rows in args.rows:
        for method in args.methods:
            layers, lm_head = best[(method, rows)]
            print(
                f"| {rows} | {method} | {1e3 * layers:.1f} | {1e3 * lm_head:.1f} | "
                f"{1e3 * (layers + lm_head) / rows:.2f} |"
            )


if __name__ == "__main__":
    main()
