"""How long Triton takes to compile the attention kernel variants a model's warm-up compiles,
and what they compile to.

Compiles, ahead of time and without a GPU (Triton's bundled ptxas, as
tests/kernels/test_triton_sm90_compile.py does), every launch of the steps
`warm_up_hints` picks for one layer shape on an sm_90 GPU of 132 SMs, into an empty cache,
and prints each compilation's time (what a GPU's first start, or a step meeting a variant
first without the warm-up, spends on the host), its registers per thread and shared memory
(cuobjdump), and how many copy groups its key loop keeps in flight where it waits (0: it
drains every copy each iteration; see LaunchPlan). ``--stages N`` compiles the same tiles
with N software-pipelining stages instead of the default.

    TRITON_INTERPRET=0 .venv/bin/python benchmarks/kernel_compile_time.py  # Llama-3.2-1B shape
    TRITON_INTERPRET=0 .venv/bin/python benchmarks/kernel_compile_time.py --heads 32 8 128
"""

import argparse
import os
import re
import subprocess
import tempfile
import time
from dataclasses import replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weir.kernels import triton_attention as ta

POINTERS = (
    {name: "bf16" for name in ("query_ptr", "cache_ptr", "out_ptr", "sinks_ptr")}
    | {name: "fp32" for name in ("segm_acc_ptr", "segm_max_ptr", "segm_sum_ptr")}
    | {name: "i32" for name in ("query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr")}
)


def source(fn, constexprs: dict) -> ASTSource:
    """The kernel as a launch specializes it: pointers aligned, strides multiples of 16, the
    block table's column stride 1, the step-varying arguments left alone."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name], attrs[(i,)] = "*" + POINTERS[name], [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        elif name in ta.STEP_VARYING_ARGS:
            signature[name] = "i32"
        elif name == "stride_bt_block":
            signature[name], constexprs = "constexpr", {**constexprs, name: 1}
        else:
            signature[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs, attrs)


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(kernel) -> tuple[int, int, int]:
    """(registers per thread, bytes of shared memory, copy groups in flight at the loop's wait)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    waits = re.findall(r"async_wait[^{]*[{]num = (\d+)", kernel.asm["ttgir"])
    return registers, kernel.metadata.shared, max(map(int, waits), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--heads", type=int, nargs=3, default=[32, 8, 64], metavar=("Q", "KV", "DIM")
    )
    parser.add_argument("--stages", type=int, default=None, help="pipelining stages of every tile")
    args = parser.parse_args()
    num_heads, num_kv_heads, head_dim = args.heads
    layer = ta.LayerAttention(num_heads, num_kv_heads, head_dim)
    hints = ta.warm_up_hints([layer], 16, torch.bfloat16, False, 131072, (132, 9))
    compiled: set[str] = set()
    total = 0.0
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        for query_len, max_seq_len in hints:
            plan = layer.plan(
                query_len, 1, query_len, max_seq_len, block_size=16,
                compute_dtype=torch.bfloat16, fp8_cache=False, device_info=(132, 9),
            )  # fmt: skip
            if args.stages is not None:
                prefill = plan.prefill and replace(plan.prefill, num_stages=args.stages)
                decode = replace(plan.decode, num_stages=args.stages)
                plan = replace(plan, decode=decode, prefill=prefill)
            launches = [
                (
                    ta._decode_attention_kernel,
                    plan.decode_constexprs(),
                    {"num_warps": plan.decode.num_warps, "num_stages": plan.decode.num_stages},
                )
            ]
            if plan.prefill is not None:
                launches.append(
                    (
                        ta._prefill_attention_kernel,
                        plan.constexprs(plan.prefill),
                        {
                            "num_warps": plan.prefill.num_warps,
                            "num_stages": plan.prefill.num_stages,
                        },
                    )
                )
            if plan.segments > 1:
                launches.append(
                    (
                        ta._merge_segments_kernel,
                        plan.merge_constexprs(),
                        {"num_warps": ta.MERGE_NUM_WARPS},
                    )
                )
            for fn, constexprs, options in launches:
                label = f"{fn.fn.__name__} {sorted(constexprs.items())} {options}"
                if label in compiled:
                    continue
                compiled.add(label)
                start = time.perf_counter()
                kernel = triton.compile(
                    source(fn, constexprs), target=GPUTarget("cuda", 90, 32), options=options
                )
                seconds = time.perf_counter() - start
                total += seconds
                registers, shared, in_flight = resources(kernel)
                print(
                    f"q={query_len:<3} max_seq_len={max_seq_len:<5} {fn.fn.__name__:<26} "
                    f"segments {plan.segments:<2} {seconds:.2f} s, {registers} registers, "
                    f"{shared} B shared, {in_flight} copy groups in flight"
                )
    print(
        f"{len(compiled)} variants from {len(hints)} warm-up steps ({num_heads}/{num_kv_heads} "
        f"heads of {head_dim}, sm_90, 132 SMs): {total:.1f} s of compiling"
    )


if __name__ == "__main__":
    main()
