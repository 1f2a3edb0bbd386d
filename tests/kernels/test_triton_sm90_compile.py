"""The kernels compile for an H200 (sm_90), and the fallback tiles for an A100 (sm_80), without a GPU.

Triton compiles ahead of time to a cubin with its bundled ptxas; no driver is needed. This
catches code the interpreter runs but the GPU compiler rejects, and register spills. It runs
in subprocesses because this test process has Triton in interpreter mode. Integer arguments
get the specialisation a real launch gives them: multiples of 16 are marked divisible by 16
and arguments equal to 1 become constants, except the step-varying ones the attention kernels
leave unspecialized (`STEP_VARYING_ARGS`).
"""

import json
import os
import subprocess
import sys

# Compiling is single-threaded: the kernels are dealt out to one process per core this test
# may use (one under `make test`, whose workers each hold a core).
SHARDS = len(os.sched_getaffinity(0))
SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from weir.kernels import triton_attention as ta, triton_cache as tc, triton_layers as tly
from weir.kernels import triton_gated_delta as tgd

PTXAS_DIR = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SHARD, SHARDS = map(int, sys.argv[1:])
calls = 0


def compile_kernel(label, fn, pointers, ints, constexprs, capability=90, **options):
    global calls
    calls += 1
    if calls % SHARDS != SHARD:  # another process compiles this one
        return
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "eps"):
            signature[name] = "fp32"
        elif name in ta.STEP_VARYING_ARGS:  # never specialized (see the kernel)
            signature[name] = "i32"
        else:
            value = ints[name]
            if value == 1:
                signature[name] = "constexpr"
                constexprs = {**constexprs, name: 1}
                continue
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(PTXAS_DIR, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    fields = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split())
    # How many copy groups a loop leaves in flight where it waits (0: it drains them all).
    in_flight = max(map(int, re.findall(r"async_wait[^{]*[{]num = (\d+)", kernel.asm["ttgir"])), default=0)
    print(json.dumps({"kernel": label, "registers": int(fields["REG"]), "stack": int(fields["STACK"]),
                      "shared": kernel.metadata.shared, "wgmma": "wgmma.mma_async" in kernel.asm["ptx"],
                      "in_flight": in_flight}))


def attention(label, dtype, num_heads, num_kv_heads, head_dim, max_query_len, num_requests, split_kv=None,
              capability=90, span=None, softcap=None, has_sinks=False, cache=None):
    cache_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]  # an fp8 cache widens to it
    block_size, max_blocks = 16, 2048
    num_tokens = num_requests * max_query_len
    plan = ta.plan_launches(num_tokens, num_requests, num_heads, num_kv_heads, head_dim, block_size,
                            cache_dtype, capability // 10, 132, max_query_len, 4096, split_kv,
                            span, softcap, has_sinks, cache is not None)
    pointers = {name: dtype for name in ("query_ptr", "cache_ptr", "out_ptr", "sinks_ptr")}
    pointers["cache_ptr"] = cache or dtype
    pointers |= {name: "fp32" for name in ("segm_acc_ptr", "segm_max_ptr", "segm_sum_ptr")}
    pointers |= {name: "i32" for name in ("query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr")}
    ints = {
        "short_query_len": plan.short_query_len, "num_requests": num_requests, "num_heads": num_heads,
        "stride_qt": (num_heads + 2 * num_kv_heads) * head_dim, "stride_qh": head_dim,
        "stride_ot": num_heads * head_dim, "stride_oh": head_dim,
        "stride_c_kv": 4096 * block_size * num_kv_heads * head_dim, "stride_c_block": block_size * num_kv_heads * head_dim,
        "stride_c_slot": num_kv_heads * head_dim, "stride_c_head": head_dim,
        "stride_bt_req": max_blocks, "stride_bt_block": 1,
    }
    compile_kernel(label + "_decode", ta._decode_attention_kernel, pointers, ints,
                   plan.decode_constexprs(), capability,
                   num_warps=plan.decode.num_warps, num_stages=plan.decode.num_stages)
    if plan.prefill is not None:
        compile_kernel(label + "_prefill", ta._prefill_attention_kernel, pointers, ints,
                       plan.constexprs(plan.prefill), capability, num_warps=plan.prefill.num_warps,
                       num_stages=plan.prefill.num_stages)
    if plan.segments > 1:
        compile_kernel(label + "_merge", ta._merge_segments_kernel, pointers, ints,
                       plan.merge_constexprs(), capability, num_warps=ta.MERGE_NUM_WARPS)


attention("decode", "bf16", 32, 8, 128, 1, 1, split_kv=False)
attention("split", "bf16", 64, 8, 128, 1, 32)
attention("mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False)
attention("mixed_split", "bf16", 32, 8, 128, 512, 40, split_kv=4)  # partials by request
attention("speculative_hd80", "fp16", 8, 8, 80, 4, 8, split_kv=False)
attention("mixed_hd256", "bf16", 16, 8, 256, 64, 4, split_kv=False)
attention("ampere_mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False, capability=80)
attention("window_split", "bf16", 64, 8, 128, 1, 32, span=ta.AttentionSpan(4096))
attention("window_mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False, span=ta.AttentionSpan(4096))
attention("window_mixed_hd256", "bf16", 16, 8, 256, 64, 4, split_kv=False, span=ta.AttentionSpan(4096))
attention("softcap_mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False, softcap=50.0)
attention("softcap_window_split", "bf16", 64, 8, 128, 1, 32, span=ta.AttentionSpan(4096), softcap=50.0)
# gpt-oss: 64 query heads over 8 KV heads of 64 dimensions, windows of 128, sinks
attention("sinks_split", "bf16", 64, 8, 64, 1, 32, has_sinks=True)
attention("sinks_window_mixed", "bf16", 64, 8, 64, 512, 40, split_kv=False, span=ta.AttentionSpan(128),
          has_sinks=True)
# Llama 4's chunks of 8192 (its rotated layers), in the windows' shapes above
attention("chunk_split", "bf16", 64, 8, 128, 1, 32, span=ta.AttentionSpan(8192, chunked=True))
attention("chunk_mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False,
          span=ta.AttentionSpan(8192, chunked=True))
# DeepSeek-V2-Lite's latent attention: 16 query heads over one KV head of 576 channels
attention("latent_mixed", "bf16", 16, 1, 576, 256, 8, split_kv=False)
# --kv-cache-dtype fp8: e4m3 and e5m2 caches read by bf16 queries
attention("fp8_split", "bf16", 64, 8, 128, 1, 32, cache="fp8e4nv")
attention("fp8_mixed", "bf16", 32, 8, 128, 512, 40, split_kv=False, cache="fp8e5")
# Gemma 4's full-attention layers: heads of 512 channels, 2 to 8 query heads over a KV head
attention("mixed_hd512_g2", "bf16", 8, 4, 512, 512, 40, split_kv=False)
attention("mixed_hd512_g4", "bf16", 16, 4, 512, 512, 40, split_kv=False)
attention("mixed_hd512_g8", "bf16", 32, 4, 512, 512, 40, split_kv=False)
attention("speculative_hd512_g8", "bf16", 32, 4, 512, 4, 8, split_kv=False)  # 32-row decode tiles
attention("split_hd512_g8", "bf16", 16, 2, 512, 1, 32)
attention("fp8_mixed_hd512_g8", "bf16", 32, 4, 512, 512, 40, split_kv=False, cache="fp8e4nv")
attention("ampere_mixed_hd512_g8", "bf16", 32, 4, 512, 512, 40, split_kv=False, capability=80)
for label, cache, fp8_max in (("", "bf16", 0.0), ("_fp8", "fp8e4nv", 448.0)):
    compile_kernel("reshape_and_cache" + label, tc._reshape_and_cache_kernel,
                   {"key_ptr": "bf16", "value_ptr": "bf16", "cache_ptr": cache, "slot_mapping_ptr": "i64"},
                   {"stride_kt": 6144, "stride_kh": 128, "stride_vt": 6144, "stride_vh": 128, "stride_c_kv": 2**26,
                    "stride_c_block": 16384, "stride_c_slot": 1024, "stride_c_head": 128, "num_kv_heads": 8,
                    "head_dim": 128, "block_size": 16},
                   {"BLOCK_H": 8, "BLOCK_D": 128, "FP8_MAX": fp8_max}, num_warps=4)
for hidden, warps in ((2048, 4), (8192, 8), (16384, 16)):
    compile_kernel(f"rms_norm_{hidden}", tly._rms_norm_kernel,
                   {"x_ptr": "bf16", "weight_ptr": "bf16", "out_ptr": "bf16"},
                   {"stride_x": hidden, "stride_out": hidden, "dim": hidden}, {"BLOCK": hidden}, num_warps=warps)
compile_kernel("rope", tly._rope_kernel, {"x_ptr": "bf16", "cos_ptr": "bf16", "sin_ptr": "bf16"},
               {"stride_xt": 6144, "stride_xh": 128, "stride_ct": 64, "num_heads": 40, "half": 64},
               {"BLOCK_H": 64, "BLOCK_HALF": 64}, num_warps=4)
compile_kernel("silu_mul", tly._silu_mul_kernel, {"gate_up_ptr": "bf16"}, {"stride_row": 16384, "dim": 8192},
               {"BLOCK": tly.SILU_BLOCK}, num_warps=4)
# Qwen 3.5's Gated DeltaNet decode step: 32 value heads over 16 key heads of 128 x 128
compile_kernel("gated_delta_step", tgd._decode_kernel,
               {**dict.fromkeys(("state_ptr", "q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "out_ptr"), "fp32"),
                **dict.fromkeys(("rows_ptr", "slots_ptr", "fresh_ptr"), "i64")},
               {"num_v_heads": 32, "group": 2, "k_dim": 128, "v_dim": 128}, {"BLOCK_K": 128, "BLOCK_V": 32},
               num_warps=4)
"""


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    shards = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(shard), str(SHARDS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in range(SHARDS)
    ]
    outputs = []
    try:
        for shard in shards:
            stdout, stderr = shard.communicate(timeout=500)
            assert shard.returncode == 0, stderr[-4000:]
            outputs += stdout.splitlines()
    finally:
        for shard in shards:
            shard.kill()
    kernels = {entry["kernel"]: entry for entry in map(json.loads, outputs)}
    assert len(kernels) == len(outputs)  # each kernel compiled once
    assert set(kernels) == {
        "gated_delta_step",
        "decode_decode",
        "split_decode",
        "split_merge",
        "mixed_decode",
        "mixed_prefill",
        "mixed_split_decode",
        "mixed_split_prefill",
        "mixed_split_merge",
        "speculative_hd80_decode",
        "mixed_hd256_decode",
        "mixed_hd256_prefill",
        "ampere_mixed_decode",
        "ampere_mixed_prefill",
        "window_split_decode",
        "window_split_merge",
        "window_mixed_decode",
        "window_mixed_prefill",
        "window_mixed_hd256_decode",
        "window_mixed_hd256_prefill",
        "softcap_mixed_decode",
        "softcap_mixed_prefill",
        "softcap_window_split_decode",
        "softcap_window_split_merge",
        "sinks_split_decode",
        "sinks_split_merge",
        "sinks_window_mixed_decode",
        "sinks_window_mixed_prefill",
        "chunk_split_decode",
        "chunk_split_merge",
        "chunk_mixed_decode",
        "chunk_mixed_prefill",
        "latent_mixed_decode",
        "fp8_split_decode",
        "fp8_split_merge",
        "fp8_mixed_decode",
        "fp8_mixed_prefill",
        "mixed_hd512_g2_decode",
        "mixed_hd512_g2_prefill",
        "mixed_hd512_g4_decode",
        "mixed_hd512_g4_prefill",
        "mixed_hd512_g8_decode",
        "mixed_hd512_g8_prefill",
        "speculative_hd512_g8_decode",
        "split_hd512_g8_decode",
        "split_hd512_g8_merge",
        "fp8_mixed_hd512_g8_decode",
        "fp8_mixed_hd512_g8_prefill",
        "ampere_mixed_hd512_g8_decode",
        "ampere_mixed_hd512_g8_prefill",
        "reshape_and_cache",
        "reshape_and_cache_fp8",
        "rms_norm_2048",
        "rms_norm_8192",
        "rms_norm_16384",
        "rope",
        "silu_mul",
    }
    spilled = {name: entry for name, entry in kernels.items() if entry["stack"] != 0}
    assert not spilled, f"register spills: {spilled}"
    # Three decode programs of 128 threads share a Hopper SM: <= 168 registers (65,536 / 384,
    # allocated 8 at a time) and a third of its 227 KB of shared memory.
    crowded = {
        n: e
        for n, e in kernels.items()
        if n.endswith("_decode") and not any(wide in n for wide in ("hd256", "hd512", "latent"))
    }
    assert max(e["registers"] for e in crowded.values()) <= 168, crowded
    assert max(e["shared"] for e in crowded.values()) * 3 <= 227 * 1024, crowded
    # Hopper tiles keep their next K/V copies in flight across the loop's wait (a load whose
    # address comes from the block table needs 5 stages for that: LaunchPlan).
    hopper = {
        n: e["in_flight"]
        for n, e in kernels.items()
        if n.endswith(("_decode", "_prefill")) and "ampere" not in n and "latent" not in n
    }
    assert min(hopper.values()) > 0, hopper
    # Prefill tiles are 64-128 rows: tl.dot must become Hopper's warpgroup MMA, not mma.sync.
    prefill = (
        "mixed_prefill",
        "mixed_hd256_prefill",
        "window_mixed_prefill",
        "window_mixed_hd256_prefill",
        "softcap_mixed_prefill",
        "sinks_window_mixed_prefill",
        "chunk_mixed_prefill",
        "fp8_mixed_prefill",
        "mixed_hd512_g2_prefill",
        "mixed_hd512_g4_prefill",
        "mixed_hd512_g8_prefill",
        "fp8_mixed_hd512_g8_prefill",
    )
    assert all(kernels[name]["wgmma"] for name in prefill), kernels
    # The fallback's tiles fit the 100 KB of shared memory an Ada SM has; Hopper's its 227 KB.
    assert all(e["shared"] <= 100 * 1024 for n, e in kernels.items() if "ampere" in n), kernels
    assert all(e["shared"] <= 227 * 1024 for e in kernels.values()), kernels
