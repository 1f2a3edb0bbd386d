"""The native CPU paged-attention kernel at the shapes of the default model's steps.

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--library OLD.so ...]

Cases are a decode step (38 requests at ~280 tokens of context, what `executor_step.py`'s
decode steps average) and a prefill step (2048 tokens in prompts of 32-256), SmolLM2-135M's
heads (9 query, 3 KV, head_dim 64), block size 16, shuffled blocks. Each call reads a
different layer's cache of 30, as a forward does, so K/V come from memory and not from the
last call's cache lines. Decode is reported as GB/s of K/V read (the bound), prefill as
GFLOP/s of QK and PV. `--softcap CAP` caps every score (Gemma 2's attention, e.g. 50).
`--kv-cache-dtype fp8` (or fp8_e5m2, or bfloat16: the cache of `--dtype bfloat16`'s float32
model) adds each case over that cache (its GB/s count its bytes), in the same rounds.
`--library` adds builds to compare (e.g. one compiled from an older
`cpu_kernels.c`); they run interleaved with the current source's build, round by round.
"""

import argparse
import ctypes
import random
import statistics
import time
from pathlib import Path

import torch

from weir.kernels import cpu_native
from weir.services.executor.model_runner import FP8_KV_CACHE_DTYPES

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
NARROW_CACHES = {**FP8_KV_CACHE_DTYPES, "bfloat16": torch.bfloat16}


class AttentionOnly:
    """`CpuKernels.paged_attention` over another build, which may lack later kernels."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        restype, argtypes = cpu_native._SIGNATURES["weir_paged_attention"]
        lib.weir_paged_attention.restype, lib.weir_paged_attention.argtypes = restype, argtypes
        self._lib = lib

    paged_attention = cpu_native.CpuKernels.paged_attention


def make_case(lens: list[tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    """lens: (query tokens, total tokens) per request."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-total // BLOCK) for _, total in lens]
    num_blocks = sum(blocks_per_req)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    table = torch.zeros(len(lens), max(blocks_per_req), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    q_lens = torch.tensor([q for q, _ in lens], dtype=torch.int32)
    return {
        "query": torch.randn(int(q_lens.sum()), HEADS, HEAD_DIM, generator=gen),
        "caches": torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
        "query_start_loc": torch.cat((torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0)))
        .to(torch.int32)
        .contiguous(),
        "seq_lens": torch.tensor([t for _, t in lens], dtype=torch.int32),
        "block_table": table,
    }


def kv_bytes(case: dict[str, torch.Tensor]) -> int:
    itemsize = case["caches"].element_size()
    return int(case["seq_lens"].sum()) * 2 * KV_HEADS * HEAD_DIM * itemsize


def attention_flops(case: dict[str, torch.Tensor]) -> int:
    seq = case["seq_lens"].tolist()
    qsl = case["query_start_loc"].tolist()
    pairs = 0
    for r, total in enumerate(seq):
        q = qsl[r + 1] - qsl[r]
        pairs += sum(total - q + i + 1 for i in range(q))
    return pairs * HEADS * HEAD_DIM * 4


def time_layers(
    kernels: cpu_native.CpuKernels | AttentionOnly,
    case: dict[str, torch.Tensor],
    softcap: float | None,
) -> float:
    """Seconds per call, averaged over one pass of the 30 layers."""
    start = time.perf_counter()
    for layer in range(LAYERS):
        kernels.paged_attention(
            case["query"],
            case["caches"][layer],
            case["query_start_loc"],
            case["seq_lens"],
            case["block_table"],
            HEAD_DIM**-0.5,
            softcap=softcap,
        )
    return (time.perf_counter() - start) / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--library", type=Path, nargs="*", default=[], help="other builds")
    parser.add_argument("--softcap", type=float, default=None, help="cap every score at this")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=list(NARROW_CACHES),
        default=None,
        help="also time a cache of this dtype",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    current = cpu_native.load()
    if current is None:
        raise SystemExit("the native kernels are not available here (see kernels/cpu_native.py)")
    builds: dict[str, cpu_native.CpuKernels | AttentionOnly] = {"current": current}
    for path in args.library:
        builds[path.name] = AttentionOnly(ctypes.CDLL(str(path.resolve())))

    rng = random.Random(0)
    decode = make_case([(1, rng.randint(200, 360)) for _ in range(38)], 1)
    prompts = []
    while sum(prompts) < 2048:
        prompts.append(min(rng.randint(32, 256), 2048 - sum(prompts)))
    prefill = make_case([(n, n) for n in prompts], 2)
    cases = {
        "decode 38 x ~280": (decode, kv_bytes(decode), "GB/s"),
        f"prefill {len(prompts)} prompts, 2048 tokens": (
            prefill,
            attention_flops(prefill),
            "GFLOP/s",
        ),
    }
    if args.kv_cache_dtype is not None:
        for name, (case, work, unit) in list(cases.items()):
            narrow = {**case, "caches": case["caches"].to(NARROW_CACHES[args.kv_cache_dtype])}
            cases[f"{name}, {args.kv_cache_dtype}"] = (
                narrow,
                kv_bytes(narrow) if unit == "GB/s" else work,
                unit,
            )
    for name, (case, _, _) in cases.items():  # the builds agree before they are timed
        outs = {
            build: k.paged_attention(
                case["query"],
                case["caches"][0],
                case["query_start_loc"],
                case["seq_lens"],
                case["block_table"],
                HEAD_DIM**-0.5,
                softcap=args.softcap,
            )
            for build, k in builds.items()
        }
        for build, out in outs.items():
            diff = (out - outs["current"]).abs().max().item()
            if diff > 1e-4:
                raise SystemExit(f"{build} differs from the current build on {name}: {diff}")

    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, (case, _, _) in cases.items():
            for build, kernels in builds.items():
                time_layers(kernels, case, args.softcap)
                samples.setdefault((name, build), []).append(
                    time_layers(kernels, case, args.softcap)
                )

    print(f"threads {args.threads}, median of {args.rounds} rounds, each over {LAYERS} layers")
    print(f"{'case':<40} {'build':<28} {'ms/call':>8} {'rate':>14}")
    for (name, build), secs in samples.items():
        _, work, unit = cases[name]
        t = statistics.median(secs)
        print(f"{name:<40} {build:<28} {t * 1e3:8.3f} {work / t / 1e9:9.1f} {unit}")


if __name__ == "__main__":
    main()
