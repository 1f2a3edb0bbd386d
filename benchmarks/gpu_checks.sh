#!/usr/bin/env bash
# The GPU checks of the step path (issue 10) and the attention kernel (issue 11) in one run of
# at most ~10 minutes on one H200 (the default sections' limits add up to 590 s; on
# 2026-12-04 they took 120+ (cut short: the tests need more), 46, 19 + the profiled rerun,
# 14, 15 and 92 s):
#   1. the CUDA tests: graphs on/off give the same greedy tokens (tests/test_cuda_graphs.py),
#      the model runner's steps (pooling, a draft model's cache and waking from sleep on
#      CUDA too) against transformers and a fresh draft (tests/test_model_runner.py), a MoE model and Qwen 3.5's Gated DeltaNet in bf16 (tests/test_moe.py, test_qwen3_5.py), SmolVLM's vision tower in bf16 (tests/test_vision.py), and the Triton
#      kernel tests, natively; then benchmarks/attention.py --quick --sweep-segments (issue 11)
#      and benchmarks/layer_ops.py (the layer kernels against PyTorch's operators), and the
#      attention benchmark's decodes over an fp8 cache;
#   2. benchmarks/step_profile.py in process: a steady 256-request decode step's kernels, graphs
#      and eager, and the host's side of a step, lockstep and overlapped: its phases and the
#      runner's parts (where the host's time per step goes, which the GPU waits for when the
#      host is slower than it);
#   3. benchmarks/step_breakdown.py, steady decode at 256 running requests, with CUDA graphs
#      (then again under the executor's torch.profiler: its table; phases unsynchronized: the
#      executor's idle time is real); it prints the Triton kernels
#      compiled while measured (0 expected: the executor's start-up compiles every attention
#      variant, ~16 for this shape, which the first start on a fresh machine pays for) and
#      how many steps fell in each bucket of the executor step and forward histograms; the
#      workload runs twice on one server (the second measured, both walls printed); then
#      the same workload, scheduler and runner in one process (--in-process), the runner's
#      phases per step beside the served executor's;
#   4. `weir bench throughput` (512 prompts, bf16, dummy weights) with CUDA graphs beside the
#      hf-cb baseline (SECTIONS naming "limits" adds the step limits before vLLM's defaults,
#      2048 tokens and 256 requests);
# all on a Llama-3.2-1B-like shape (16 layers, hidden 2048, 32/8 heads, intermediate 8192,
# vocab 128256) with random weights: a config.json written here plus the default model's
# tokenizer files (the default model itself cannot travel). Results land in $OUT.
#
# On this machine, once (fills the git-ignored .device/ with the wheels and the tokenizer):
#   ../shared/device/prepare.sh && benchmarks/gpu_checks.sh --prepare
# On the device (run tool, carry [".device"], timeout_s 600):
#   source .device/setup.sh && bash benchmarks/gpu_checks.sh
# SECTIONS="tests profile breakdown throughput" (the default) picks sections;
# BREAKDOWN_MODES="graphs" (the default; also: eager, --enforce-eager as served, measured on
# 2026-12-04; lockstep, graphs without async scheduling) the breakdowns; SHAPE=tiny swaps the
# 1B shape for a 2-layer one, to dry-run the script on a CPU (DEVICE=cpu).
set -uo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    mkdir -p .device/tokenizer
    src=$(python3 -c "from weir.shared.model_store import resolve_model; print(resolve_model(None))" 2>/dev/null ||
        "${PYTHON:-.venv/bin/python}" -c "from weir.shared.model_store import resolve_model; print(resolve_model(None))")
    cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/generation_config.json .device/tokenizer/
    du -sh .device/tokenizer
    exit 0
fi

OUT=${OUT:-$root/out/gpu-checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-"tests profile breakdown throughput"}
SHAPE=${SHAPE:-1b}
DEVICE=${DEVICE:-cuda}
TOKENIZER_DIR=${TOKENIZER_DIR:-$root/.device/tokenizer}
export WEIR_TEST_TOKENIZER_DIR=$TOKENIZER_DIR
start=$SECONDS
log() { echo "[gpu_checks +$((SECONDS - start))s] $*" | tee -a "$OUT/summary.txt"; }

# The model directory: config.json of the shape + tokenizer files, no weights.
model=$(mktemp -d)/llama-$SHAPE-dummy
mkdir -p "$model"
cp "$TOKENIZER_DIR"/* "$model"/ || { log "no tokenizer files in $TOKENIZER_DIR: run --prepare here first"; exit 1; }
"$PY" - "$model" "$SHAPE" <<'EOF'
import json, sys
path, shape = sys.argv[1], sys.argv[2]
config = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
}
if shape == "tiny":
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=49152)
json.dump(config, open(f"{path}/config.json", "w"), indent=1)
EOF
log "model $model ($SHAPE shape), device $DEVICE"
# At most 8 files come back from $OUT: the summary, 6 logs, 1 JSON result.
{
    # The kernel names the runtime (4.4.0: gVisor, whose system calls cost far more; -fc-:
    # Firecracker): the host-side numbers depend on it.
    echo "kernel $(uname -r), $(nproc) CPUs"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$OUT/summary.txt"

# section NAME SECONDS COMMAND...: runs with a time limit, keeps its log, notes the outcome.
section() {
    local name=$1 limit=$2
    shift 2
    log "$name: start (limit ${limit}s)"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    log "$name: exit $rc"
    tail -n 25 "$OUT/$name.log" >>"$OUT/summary.txt"
}

if [[ " $SECTIONS " == *" tests "* ]]; then
    # Only the CUDA cases: the CPU ones run in CI and some need the default model, which is
    # not there. No -x: one failure must not hide the others.
    section tests 160 "$PY" -m pytest -q -rfE -p no:cacheprovider --maxfail=20 --timeout=90 -n 8 \
        -k "(cuda or kernels) and not on_cpu" \
        tests/test_cuda_graphs.py tests/test_model_runner.py tests/kernels tests/test_gpu_info.py \
        tests/test_architectures.py::test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16 \
        tests/test_qwen3_5.py::test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16 \
        tests/test_vision.py::test_bfloat16_within_transformers_own_rounding
    # The kernel's floors (issue 11): decodes, mixed batches, prefill against SDPA; then the
    # layer kernels against the operators they replace (one log: at most 8 files come back).
    # Last, so that a section cut short loses it first: the fp8 cache's decode tiles.
    # --sweep-segments: each batch with decodes (mixed ones too) at 1-16 split-KV segments, the
    # data the split rule is set from.
    # Every batch is also timed replayed from a CUDA graph (as served), beside SDPA's;
    # --sweep-tiles: the default tiles against the 3 pipelining stages they had until 2026-12-04.
    section attention 100 bash -c '"$0" benchmarks/attention.py --quick --no-write --sweep-segments --sweep-tiles; "$0" benchmarks/layer_ops.py;
        "$0" benchmarks/attention.py --quick --no-sdpa --kv-cache-dtype fp8' "$PY"
fi

if [[ " $SECTIONS " == *" profile "* ]]; then
    # The kernels of a steady decode step, graphs and eager, and the host's parts of a step.
    section profile 60 "$PY" benchmarks/step_profile.py --model "$model" --load-format dummy \
        --dtype "$([[ $DEVICE == cuda ]] && echo bfloat16 || echo float32)" --device "$DEVICE" \
        $([[ $SHAPE == tiny ]] && echo --batch 8 --kv-cache-gib 0.05 || echo --kv-cache-gib 4)
fi

if [[ " $SECTIONS " == *" breakdown "* ]]; then
    # lockstep: graphs without async scheduling (not a default mode).
    for mode in ${BREAKDOWN_MODES:-graphs}; do
        # Twice on one server, the second measured: the first run's wall against the second's
        # tells costs a server pays once (compilations, first launches) from every step's.
        flags=(--device "$DEVICE" --dtype bfloat16 --load-format dummy --model "$model"
            --steady --num-prompts 256 --no-sync-phases --repeat 2)
        [[ $SHAPE == tiny ]] && flags=(--device "$DEVICE" --load-format dummy --model "$model"
            --steady --num-prompts 8 --no-sync-phases)
        [[ $mode == eager ]] && flags+=(--enforce-eager)
        [[ $mode == lockstep ]] && flags+=(--no-async-scheduling)
        # Then the workload again under the executor's torch.profiler: its table in the log.
        [[ $mode == graphs ]] && flags+=(--profiler-dir "$(mktemp -d)")
        section "breakdown-$mode" "$([[ $mode == graphs ]] && echo 100 || echo 45)" \
            "$PY" benchmarks/step_breakdown.py "${flags[@]}"
    done
    # The same workload, scheduler and runner in one process (no executor process, no
    # sockets), each runner phase's median and largest per step: a served forward phase far
    # above this one's comes from the processes around the runner, not from the workload.
    flags=(--device "$DEVICE" --dtype bfloat16 --load-format dummy --model "$model" --steady
        --num-prompts 256 --no-sync-phases --repeat 2 --in-process)
    [[ $SHAPE == tiny ]] && flags=(--device "$DEVICE" --load-format dummy --model "$model"
        --steady --num-prompts 8 --no-sync-phases --in-process)
    section breakdown-in-process 60 "$PY" benchmarks/step_breakdown.py "${flags[@]}"
fi

# `weir bench throughput`, 512 prompts: the defaults (on an H200 vLLM's offline step limits,
# 16384 tokens and 1024 requests, since 2026-12-05's thirty-fifth session) beside hf-cb (the
# same budget); with SECTIONS naming "limits", also the limits before (2048 tokens, 256
# requests): the same-run baseline of the new defaults.
common=(--model "$model" --load-format dummy --dtype bfloat16 --num-prompts 512)
[[ $SHAPE == tiny ]] && common=(--model "$model" --load-format dummy --num-prompts 8 --threads 1)
if [[ " $SECTIONS " == *" throughput "* ]]; then
    section throughput-graphs-hf-cb 110 "$PY" -m weir.services.cli bench throughput "${common[@]}" \
        --baseline hf-cb --output-json "$OUT/throughput-graphs-hf-cb.json"
fi
if [[ " $SECTIONS " == *" limits "* ]]; then
    section throughput-2048-256 60 "$PY" -m weir.services.cli bench throughput "${common[@]}" \
        --max-num-batched-tokens 2048 --max-num-seqs 256
fi
log "done in $((SECONDS - start))s; results in $OUT"
