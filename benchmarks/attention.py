"""Benchmark the Triton paged attention against PyTorch SDPA on equivalent dense tensors.

Decode batches (1..256 sequences, context 512..32k) and mixed batches (prefill chunks with
context, decodes, speculative queries). For each: kernel time, achieved memory bandwidth
(bytes of K/V read plus Q read and O written, divided by the time) and its share of the
device's peak, for the Triton kernels (single pass, split-KV into the maximum number of
segments, prefill and decode launches one after the other, and the default: the launches,
segments and streams paged_attention picks from the step's hints) and for torch's scaled_dot_product_attention in the same run, plus the largest
difference between the two outputs, and the issue's floors. Writes its table into docs/benchmarks.md between
the attention markers, leaving the rest of the file alone.

Usage: python benchmarks/attention.py [--quick] [--peak-gbps N] [--no-write] [--kv-cache-dtype fp8]
                                     [--sweep-segments] [--sweep-tiles] [--no-graphs]
Each call is timed as launched from Python (triton.testing.do_bench: the host's launch cost
shows where the kernel is shorter) and, for the default launches and SDPA, replayed from a
CUDA graph, as the executor replays every step of up to 8192 tokens (`graph_time_ms`: the L2
cache flushed before each call as do_bench does; --no-graphs skips it).
--sweep-segments also times each batch with requests on the decode launch (mixed batches too,
whose decode launch the rule never splits) at split-KV segment counts SWEPT_SEGMENTS (the
rule's powers of two, and 3 and 6, which can fill waves of programs that powers of two leave
part-empty: 32 x 8 programs x 3 segments take 97% of two waves of 3 programs on 132 SMs, x 4
86% of three) and prints them beside the count the rule picks.
--sweep-tiles also times each batch's default launches with other tile constants
(TILE_ALTERNATIVES: the 3 software-pipelining stages the kernels ran until 2026-12-04, decode
tiles of 32 keys, prefill tiles of 128 keys or of 64 rows), in a CUDA graph unless --no-graphs;
one that this GPU's Triton cannot compile, or that computes another result, is said and not
timed.
With an fp8 cache (K/V one byte a value, read as such; SDPA reads widened dense copies) the
table is printed only. Needs a CUDA GPU; elsewhere it exits with status 2.
"""

import argparse
import datetime
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from weir.services.executor.model_runner import FP8_KV_CACHE_DTYPES

if TYPE_CHECKING:
    from weir.kernels.triton_attention import LaunchPlan

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- attention:begin -->", "<!-- attention:end -->"
# Peak HBM bandwidth in GB/s by device name, from the vendors' data sheets.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "L40S": 864.0,
}
DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXTS = [512, 4096, 16384, 32768]
QUICK_DECODE = [(1, 512), (1, 4096), (8, 4096), (32, 4096), (256, 4096)]


@dataclass(slots=True)
class Batch:
    """A step as (context_len, query_len) per request."""

    name: str
    requests: list[tuple[int, int]]

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for _, q in self.requests)


@dataclass(slots=True)
class Result:
    batch: Batch
    single_ms: float
    split_ms: float | None
    default_ms: float  # the launches paged_attention picks by default, given the step's hints
    segments: int  # split-KV segments of the default
    serial_ms: float | None  # the default with prefill and decode launches one after the other
    sdpa_ms: float | None
    bytes_moved: int
    max_abs_diff: float | None
    # --sweep-segments: µs of the launches at each segment count (batches with decode requests)
    sweep_us: dict[int, float] | None = None
    graph_ms: float | None = None  # the default, replayed from a CUDA graph
    sdpa_graph_ms: float | None = None
    # --sweep-tiles: µs of the default launches with each of TILE_ALTERNATIVES (None: not applicable)
    tiles_us: dict[str, float | None] | None = None


def stages_before(plan: "LaunchPlan") -> "LaunchPlan":
    """The plan with the 3 pipelining stages every Hopper tile had until 2026-12-04."""
    prefill = None if plan.prefill is None else replace(plan.prefill, num_stages=3)
    return replace(plan, decode=replace(plan.decode, num_stages=3), prefill=prefill)


def decode_keys_32(plan: "LaunchPlan") -> "LaunchPlan | None":
    return (
        None if plan.decode.tile_n == 32 else replace(plan, decode=replace(plan.decode, tile_n=32))
    )


def prefill_keys_128(plan: "LaunchPlan") -> "LaunchPlan | None":
    """Prefill tiles of 128 keys (FlashAttention's 128 x 128 on Hopper). Compiled for sm_90
    with Triton 3.8 (2026-12-05): no spills, 4 copy groups in flight; 236 registers and 231,424
    B of shared memory at head_dim 128 (just inside the 232,448 a block may take), 202 and
    116,736 at 64."""
    if plan.prefill is None or plan.prefill.tile_n == 128:
        return None
    return replace(plan, prefill=replace(plan.prefill, tile_n=128))


def prefill_rows_64(plan: "LaunchPlan") -> "LaunchPlan | None":
    """Prefill tiles of 64 rows and 4 warps (one warpgroup): twice the programs, finer causal
    skipping. sm_90, Triton 3.8: 190 registers and 115,712 B at head_dim 128, 134 and 58,368
    at 64, no spills, 4 copy groups in flight."""
    if plan.prefill is None or plan.prefill.block_m == 64:
        return None
    return replace(plan, prefill=replace(plan.prefill, block_m=64, num_warps=4))


# --sweep-tiles: other tile constants for a batch's default plan (None where one does not apply).
TILE_ALTERNATIVES: dict[str, Callable[["LaunchPlan"], "LaunchPlan | None"]] = {
    "3 stages (before)": stages_before,
    "decode 32 keys": decode_keys_32,
    "prefill 128 keys": prefill_keys_128,
    "prefill 64 rows, 4 warps": prefill_rows_64,
}


def alternative_us(
    label: str,
    call: Callable[[], None],
    timer: Callable[[Callable[[], None]], float],
    out: torch.Tensor,
    default_out: torch.Tensor,
) -> float | None:
    """µs of an alternative's launches, or None (said why) where this GPU's Triton does not
    compile them or they compute another result than the default's (into ``out``)."""
    # Compilation errors, ptxas's and a launch out of shared memory all derive from it.
    from triton.errors import TritonError

    try:
        ms = timer(call)
    except TritonError as exc:
        print(f"{label}: not timed ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    diff = (out.float() - default_out.float()).abs().max().item()
    if not diff <= 2e-2:
        print(f"{label}: not timed (its output differs from the default's by {diff:.3g})")
        return None
    return 1e3 * ms


def mixed_batches() -> list[Batch]:
    return [
        Batch("chunk 512 @ctx 2k + 63 decodes @4k", [(2048, 512)] + [(4096, 1)] * 63),
        Batch("4 prefills 1k + 60 decodes @2k", [(0, 1024)] * 4 + [(2048, 1)] * 60),
        Batch("64 speculative (1+3) @4k", [(4096, 4)] * 64),
        Batch("prefill 4k, no context", [(0, 4096)]),
    ]


def decode_batches(quick: bool) -> list[Batch]:
    shapes = QUICK_DECODE if quick else [(r, c) for c in DECODE_CONTEXTS for r in DECODE_BATCHES]
    return [Batch(f"decode {r} x {c}", [(c - 1, 1)] * r) for r, c in shapes]


def peak_gbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    matches = [gbps for key, gbps in PEAK_GBPS.items() if key in device_name]
    return matches[0] if matches else None


def build_step(batch: Batch, args: argparse.Namespace, gen: torch.Generator) -> dict:
    dtype, device, bs = getattr(torch, args.dtype), "cuda", args.block_size
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    seq_lens = [c + q for c, q in batch.requests]
    blocks = [math.ceil(s / bs) for s in seq_lens]
    physical = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    cursor = 0
    for r, n in enumerate(blocks):
        table[r, :n] = physical[cursor : cursor + n]
        cursor += n
    kv_cache = torch.randn(2, sum(blocks), bs, hkv, d, dtype=dtype, device=device)
    if args.kv_cache_dtype != "auto":
        kv_cache = kv_cache.to(FP8_KV_CACHE_DTYPES[args.kv_cache_dtype])
    starts = [0]
    for _, q in batch.requests:
        starts.append(starts[-1] + q)
    return {
        "query": torch.randn(starts[-1], hq, d, dtype=dtype, device=device),
        "kv_cache": kv_cache,
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "block_table": table.to(device),
        "scale": d**-0.5,
    }


def dense_sdpa_inputs(batch: Batch, step: dict) -> dict:
    """The same attention as padded dense tensors: q [R, Hq, max_q, D], k/v [R, Hkv, max_s, D], and a
    mask only where equal-length decodes (no mask) or context-free equal prefills (is_causal) do not fit."""
    kv_cache, table = step["kv_cache"].to(step["query"].dtype), step["block_table"]
    _, _, bs, hkv, d = kv_cache.shape
    max_q = max(q for _, q in batch.requests)
    max_s = max(c + q for c, q in batch.requests)
    num_r = len(batch.requests)
    q = torch.zeros(num_r, step["query"].shape[1], max_q, d, dtype=kv_cache.dtype, device="cuda")
    k = torch.zeros(num_r, hkv, max_s, d, dtype=kv_cache.dtype, device="cuda")
    v = torch.zeros_like(k)
    uniform = len(set(batch.requests)) == 1
    is_causal = uniform and batch.requests[0][0] == 0 and not batch.is_decode
    needs_mask = not (uniform and (batch.is_decode or is_causal))
    mask = (
        torch.zeros(num_r, 1, max_q, max_s, dtype=torch.bool, device="cuda") if needs_mask else None
    )
    starts = step["query_start_loc"].tolist()
    for r, (ctx, qlen) in enumerate(batch.requests):
        s = ctx + qlen
        pages = table[r, : math.ceil(s / bs)].long()
        k[r, :, :s] = kv_cache[0, pages].reshape(-1, hkv, d)[:s].transpose(0, 1)
        v[r, :, :s] = kv_cache[1, pages].reshape(-1, hkv, d)[:s].transpose(0, 1)
        q[r, :, :qlen] = step["query"][starts[r] : starts[r + 1]].transpose(0, 1)
        if mask is not None:
            q_pos = torch.arange(qlen, device="cuda")[:, None] + ctx
            mask[r, 0, :qlen, :s] = torch.arange(s, device="cuda")[None, :] <= q_pos
            mask[r, 0, qlen:, 0] = True  # padding rows attend somewhere, so they are not NaN
    return {"query": q, "key": k, "value": v, "attn_mask": mask, "is_causal": is_causal}


def bytes_moved(batch: Batch, args: argparse.Namespace) -> int:
    elt = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    kv_elt = elt if args.kv_cache_dtype == "auto" else 1
    kv = sum(c + q for c, q in batch.requests) * args.num_kv_heads * args.head_dim * 2
    qo = sum(q for _, q in batch.requests) * args.num_heads * args.head_dim * 2
    return kv * kv_elt + qo * elt


# Calls per graph: the flush-and-call pairs one timed replay runs (enough that the events'
# resolution and the replay's launch vanish in the mean).
GRAPH_CALLS = 20
# The split-KV segment counts --sweep-segments times (see the docstring).
SWEPT_SEGMENTS = (1, 2, 3, 4, 6, 8, 16)

FLUSH_BYTES = 256 << 20  # as triton.testing.do_bench: more than any GPU's L2 cache


def graph_time_ms(fn: Callable[[], object], runs: int = 5) -> float:
    """Device milliseconds of one ``fn()`` replayed from a CUDA graph: a graph of GRAPH_CALLS
    (L2 flush, call) pairs against one of the flushes alone, the median of ``runs`` replays
    each, the difference per call. ``fn`` runs once first (compilation, allocation)."""
    flush_buffer = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    calls, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(calls):
        for _ in range(GRAPH_CALLS):
            flush_buffer.zero_()
            fn()
    with torch.cuda.graph(flushes):
        for _ in range(GRAPH_CALLS):
            flush_buffer.zero_()

    def median_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()  # the first replay uploads the graph
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    per_call = (median_ms(calls) - median_ms(flushes)) / GRAPH_CALLS
    del calls, flushes, flush_buffer
    return per_call


def run_batch(batch: Batch, args: argparse.Namespace, gen: torch.Generator) -> Result:
    import triton.testing

    from weir.kernels import triton_attention as ta

    step = build_step(batch, args, gen)
    num_tokens = step["query"].shape[0]
    max_query_len = max(q for _, q in batch.requests)
    max_seq_len = max(c + q for c, q in batch.requests)
    plan = ta.plan_for(
        step["query"],
        step["kv_cache"],
        len(batch.requests),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    segments = plan.segments
    # Every batch with requests on the decode launch: mixed ones too, whose decode launch the
    # rule never splits: whether splitting it would pay.
    sweep = args.sweep_segments and any(q <= plan.short_query_len for _, q in batch.requests)
    measure_split = segments > 1 or max_query_len <= 4 or sweep
    workspace = (
        ta.allocate_split_kv_workspace(num_tokens, args.num_heads, args.head_dim, "cuda")
        if measure_split
        else None
    )
    positional = [
        step[k]
        for k in ("query", "kv_cache", "query_start_loc", "seq_lens", "block_table", "scale")
    ]
    out = torch.empty_like(step["query"])

    def triton_call(
        split: bool | None, concurrent: bool = True, plan: "LaunchPlan | None" = None
    ) -> None:
        # F821: ``out`` and ``workspace`` are deleted at the end, after the last call.
        ta.paged_attention(
            *positional,
            out=out,  # noqa: F821
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            split_kv=split,
            workspace=workspace,  # noqa: F821
            concurrent=concurrent,
            plan=plan,
        )

    single_ms = triton.testing.do_bench(lambda: triton_call(False))
    split_ms = triton.testing.do_bench(lambda: triton_call(True)) if measure_split else None
    default_ms = triton.testing.do_bench(lambda: triton_call(None))
    serial_ms = (
        triton.testing.do_bench(lambda: triton_call(None, concurrent=False))
        if plan.prefill is not None
        else None
    )
    sweep_us = (
        {s: 1e3 * triton.testing.do_bench(lambda s=s: triton_call(s)) for s in SWEPT_SEGMENTS}
        if sweep
        else None
    )
    graph_ms = None if args.no_graphs else graph_time_ms(lambda: triton_call(None))
    tiles_us = None
    if args.sweep_tiles:
        timer = triton.testing.do_bench if args.no_graphs else graph_time_ms
        triton_call(None)
        default_out = out.clone()
        tiles_us = {}
        for name, alternative in TILE_ALTERNATIVES.items():
            other = alternative(plan)
            tiles_us[name] = (
                None
                if other is None
                else alternative_us(
                    f"{batch.name}, {name}",
                    lambda other=other: triton_call(None, plan=other),
                    timer,
                    out,
                    default_out,
                )
            )
    triton_call(None)

    sdpa_ms = sdpa_graph_ms = max_abs_diff = None
    if not args.no_sdpa:
        dense_inputs = dense_sdpa_inputs(batch, step)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def sdpa_call() -> torch.Tensor:
            return sdpa(**dense_inputs, scale=step["scale"], enable_gqa=True)  # noqa: F821

        sdpa_ms = triton.testing.do_bench(sdpa_call)
        sdpa_graph_ms = None if args.no_graphs else graph_time_ms(sdpa_call)
        dense = sdpa_call()
        starts = step["query_start_loc"].tolist()
        max_abs_diff = max(
            (out[starts[r] : starts[r + 1]].float() - dense[r, :, :qlen].transpose(0, 1).float())
            .abs()
            .max()
            .item()
            for r, (_, qlen) in enumerate(batch.requests)
        )
        del dense_inputs, dense
    del step, workspace, out
    torch.cuda.empty_cache()
    return Result(
        batch,
        single_ms,
        split_ms,
        default_ms,
        segments,
        serial_ms,
        sdpa_ms,
        bytes_moved(batch, args),
        max_abs_diff,
        sweep_us,
        graph_ms,
        sdpa_graph_ms,
        tiles_us,
    )


def _gbps(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None else nbytes / (ms * 1e-3) / 1e9


def _cell(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def format_table(results: list[Result], peak: float | None) -> list[str]:
    lines = [
        "| batch | single µs | split µs | serial µs | default µs | GB/s | % peak | SDPA µs | SDPA GB/s | SDPA % peak | max abs diff | graph µs | graph % peak | SDPA graph µs |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(ms: float | None, r: Result) -> float | None:
        gbps = _gbps(r.bytes_moved, ms)
        return None if peak is None or gbps is None else 100 * gbps / peak

    def us(ms: float | None) -> str:
        return _cell(None if ms is None else ms * 1e3, ".1f")

    for r in results:
        gbps, sdpa_gbps = _gbps(r.bytes_moved, r.default_ms), _gbps(r.bytes_moved, r.sdpa_ms)
        lines.append(
            f"| {r.batch.name} | {r.single_ms * 1e3:.1f} | {us(r.split_ms)} | {us(r.serial_ms)}"
            f" | {f'split {r.segments}' if r.segments > 1 else 'single'} {r.default_ms * 1e3:.1f}"
            f" | {gbps:.0f} | {_cell(pct(r.default_ms, r), '.1f')}"
            f" | {us(r.sdpa_ms)} | {_cell(sdpa_gbps, '.0f')}"
            f" | {_cell(pct(r.sdpa_ms, r), '.1f')} | {_cell(r.max_abs_diff, '.2e')}"
            f" | {us(r.graph_ms)} | {_cell(pct(r.graph_ms, r), '.1f')} | {us(r.sdpa_graph_ms)} |"
        )
    return lines


# Issue 11's time floors: batch name -> (the bound, what it is measured against).
SDPA_FLOORS = {"decode 1 x 4096": 1.3, "decode 8 x 4096": 1.3, "prefill 4k, no context": 1.25}
MIXED_FLOORS_US = {
    "chunk 512 @ctx 2k + 63 decodes @4k": 244.0,
    "4 prefills 1k + 60 decodes @2k": 190.0,
}


def sweep_table(results: list[Result]) -> list[str]:
    """Each swept batch's time at every segment count, beside the count the rule picks: the
    measurements a split-KV rule is set from."""
    swept = [r for r in results if r.sweep_us]
    if not swept:
        return []
    counts = sorted(swept[0].sweep_us or {})
    lines = [
        "| batch | " + " | ".join(f"{s} seg. µs" for s in counts) + " | fastest | rule's |",
        "|---|" + "---:|" * len(counts) + "---:|---:|",
    ]
    for r in swept:
        us = r.sweep_us or {}
        fastest = min(us, key=us.__getitem__)
        lines.append(
            f"| {r.batch.name} | "
            + " | ".join(f"{us[s]:.1f}" for s in counts)
            + f" | {fastest} | {r.segments} |"
        )
    return lines


def tiles_table(results: list[Result]) -> list[str]:
    """Each batch's default launches against the same launches with other tile constants."""
    swept = [r for r in results if r.tiles_us is not None]
    if not swept:
        return []
    names = list(TILE_ALTERNATIVES)
    lines = [
        "| batch | default µs | " + " | ".join(f"{n} µs" for n in names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for r in swept:
        us = r.tiles_us or {}
        default = r.graph_ms if r.graph_ms is not None else r.default_ms
        lines.append(
            f"| {r.batch.name} | {default * 1e3:.1f} | "
            + " | ".join(_cell(us.get(n), ".1f") for n in names)
            + " |"
        )
    return lines


def floor_lines(results: list[Result], peak: float | None) -> list[str]:
    """Issue 11's floors: decodes with >= 32 sequences at >= 4k context reach >= 85% of peak
    bandwidth; small decodes and the 4k prefill within a factor of SDPA; the mixed batches in
    time. Judged on the calls launched from Python and, where timed, replayed from CUDA graphs
    (both Weir's and SDPA's)."""

    def judged(verdict: Callable[[float | None, float | None], str | None], r: Result) -> str:
        eager = verdict(r.default_ms, r.sdpa_ms)
        graphed = verdict(r.graph_ms, r.sdpa_graph_ms) if r.graph_ms is not None else None
        return f"{eager}" + ("" if graphed is None else f"; in CUDA graphs: {graphed}")

    covered = [
        r
        for r in results
        if r.batch.is_decode
        and len(r.batch.requests) >= 32
        and min(c + q for c, q in r.batch.requests) >= 4096
    ]
    if peak is None or not covered:
        lines = ["Floor (decode, >= 32 sequences, >= 4k context, >= 85% of peak): not evaluated."]
    else:

        def lowest(timed: Callable[[Result], float | None]) -> str | None:
            if any(timed(r) is None for r in covered):
                return None
            worst = min(covered, key=lambda r: r.bytes_moved / timed(r))  # type: ignore[operator]
            pct = 100 * _gbps(worst.bytes_moved, timed(worst)) / peak  # type: ignore[operator]
            return f"{'met' if pct >= 85 else 'NOT met'}; lowest {pct:.1f}% ({worst.batch.name})"

        graphed = lowest(lambda r: r.graph_ms)
        lines = [
            "Floor (decode, >= 32 sequences, >= 4k context, >= 85% of peak): "
            + f"{lowest(lambda r: r.default_ms)}"
            + ("" if graphed is None else f"; in CUDA graphs: {graphed}")
            + "."
        ]
    for r in results:
        name = r.batch.name
        if name in SDPA_FLOORS and r.sdpa_ms is not None:
            bound = SDPA_FLOORS[name]

            def against_sdpa(ms: float | None, sdpa_ms: float | None, bound=bound) -> str | None:
                if ms is None or sdpa_ms is None:
                    return None
                ratio = ms / sdpa_ms
                return f"{'met' if ratio <= bound else 'NOT met'}; {ratio:.2f}x"

            lines.append(f"Floor ({name} within {bound}x SDPA): {judged(against_sdpa, r)}.")
        if name in MIXED_FLOORS_US:
            bound_us = MIXED_FLOORS_US[name]

            def in_time(ms: float | None, _: float | None, bound_us=bound_us) -> str | None:
                if ms is None:
                    return None
                return f"{'met' if ms * 1e3 <= bound_us else 'NOT met'}; {ms * 1e3:.1f} µs"

            lines.append(f"Floor ({name} <= {bound_us:.0f} µs): {judged(in_time, r)}.")
    return lines


def write_section(section: str, path: Path) -> None:
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\nMeasured numbers only, each with the command that produced it.\n"
    )
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a few decode shapes and the mixed batches"
    )
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--peak-gbps", type=float, help="device peak memory bandwidth (default: from its name)"
    )
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA comparison")
    parser.add_argument(
        "--sweep-segments",
        action="store_true",
        help="also time every batch without prefill tiles at each split-KV segment count",
    )
    parser.add_argument(
        "--no-graphs", action="store_true", help="do not time the calls replayed from CUDA graphs"
    )
    parser.add_argument(
        "--sweep-tiles",
        action="store_true",
        help="also time every batch's default launches with other tile constants",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *FP8_KV_CACHE_DTYPES],
        default="auto",
        help="the cache's dtype (auto: --dtype); an fp8 run prints its table only",
    )
    parser.add_argument(
        "--no-write", action="store_true", help=f"print the table, do not update {DOC.name}"
    )
    parser.add_argument("--output", type=Path, default=DOC)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py: no CUDA GPU found; this benchmark only runs on a GPU",
            file=sys.stderr,
        )
        return 2

    device_name = torch.cuda.get_device_name()
    peak = peak_gbps(device_name, args.peak_gbps)
    gen = torch.Generator().manual_seed(0)
    results = []
    for batch in decode_batches(args.quick) + mixed_batches():
        results.append(run_batch(batch, args, gen))
        print("\n".join(format_table(results[-1:], peak)[2:]), flush=True)

    import triton

    command = (
        "python benchmarks/attention.py"
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    )
    section = "\n".join(
        [
            "## Attention kernels",
            "",
            f"Measured {datetime.date.today().isoformat()} on {device_name}"
            f" (peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}), torch {torch.__version__},"
            f" triton {triton.__version__}; {args.dtype}, {args.kv_cache_dtype} KV cache, {args.num_heads} query heads, {args.num_kv_heads} KV heads,"
            f" head_dim {args.head_dim}, block size {args.block_size}, shuffled blocks.",
            f"Command: `{command}`. Bandwidth = (K/V read + Q read + O written) / time; times from"
            " triton.testing.do_bench (launched from Python) and, in the graph columns, replayed from"
            " CUDA graphs with the L2 cache flushed before each call (graph_time_ms). SDPA runs on"
            " dense copies (padded and masked where lengths differ).",
            "",
            *format_table(results, peak),
            "",
            *sweep_table(results),
            "",
            *tiles_table(results),
            "",
            *floor_lines(results, peak),
        ]
    )
    print("\n".join(sweep_table(results) + tiles_table(results) + floor_lines(results, peak)))
    if args.no_write or args.kv_cache_dtype != "auto":
        print(section)
    else:
        write_section(section, args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
