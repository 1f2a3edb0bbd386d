"""The attention benchmark script: its refusal without a GPU and its docs/benchmarks.md update."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_refuses_without_gpu_with_one_line_and_status_2():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "GPU" in result.stderr


def test_write_section_creates_then_replaces_only_its_own_section(tmp_path):
    bench = load_benchmark()
    doc = tmp_path / "docs" / "benchmarks.md"
    bench.write_section("first table", doc)
    assert "first table" in doc.read_text()

    doc.write_text(
        "# Benchmarks\n\nintro\n\n"
        + doc.read_text().split("\n\n", 2)[-1]
        + "\n## Scheduler\n\nother\n"
    )
    bench.write_section("second table", doc)
    text = doc.read_text()
    assert "first table" not in text
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    assert "second table" in text
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("## Scheduler\n\nother\n")


def decode_32_x_4096(bench):
    """The issue's shape (bf16, 32/8 heads of 128): its arguments, a 32 x 4096 decode and the
    bytes it moves."""
    args = bench.argparse.Namespace(
        dtype="bfloat16", num_heads=32, num_kv_heads=8, head_dim=128, kv_cache_dtype="auto"
    )
    decode = bench.Batch("decode 32 x 4096", [(4095, 1)] * 32)
    return args, decode, bench.bytes_moved(decode, args)


def test_floor_lines_judge_the_issue_floors():
    bench = load_benchmark()
    args, decode, nbytes = decode_32_x_4096(bench)
    # K/V of 32 x 4096 keys x 8 heads x 128 channels, and Q and O of 32 tokens x 32 heads.
    kv, qo = 32 * 4096 * 8 * 128 * 2, 32 * 32 * 128 * 2
    assert nbytes == (kv + qo) * 2
    fp8 = bench.argparse.Namespace(**{**vars(args), "kv_cache_dtype": "fp8"})
    assert bench.bytes_moved(decode, fp8) == kv + qo * 2
    at_86_percent = nbytes / (0.86 * 4800e9) * 1e3  # ms
    prefill = bench.Batch("prefill 4k, no context", [(0, 4096)])
    mixed = bench.Batch("4 prefills 1k + 60 decodes @2k", [(0, 1024)] * 4 + [(2048, 1)] * 60)
    results = [
        bench.Result(decode, at_86_percent, None, at_86_percent, 4, None, None, nbytes, None),
        bench.Result(prefill, 0.4, None, 0.4, 1, 0.41, 0.266, 0, 0.0),
        bench.Result(mixed, 0.2, None, 0.185, 1, 0.25, None, 0, None),
    ]
    lines = bench.floor_lines(results, 4800.0)
    assert lines[0].startswith(
        "Floor (decode, >= 32 sequences, >= 4k context, >= 85% of peak): met"
    )
    assert "86.0%" in lines[0]
    assert lines[1] == "Floor (prefill 4k, no context within 1.25x SDPA): NOT met; 1.50x."
    assert lines[2] == "Floor (4 prefills 1k + 60 decodes @2k <= 190 µs): met; 185.0 µs."
    table = bench.format_table(results, 4800.0)
    assert "| – | split 4 " in table[2] and "| 410.0 | single 400.0 |" in table[3]


def test_sweep_table_names_the_fastest_segment_count_beside_the_rules():
    bench = load_benchmark()
    spec = bench.Batch("64 speculative (1+3) @4k", [(4093, 4)] * 64)
    decode = bench.Batch("decode 1 x 4096", [(4095, 1)])
    results = [
        bench.Result(spec, 0.27, 0.36, 0.31, 2, None, None, 0, None, {1: 268.8, 2: 305.0}),
        bench.Result(decode, 0.12, 0.07, 0.07, 8, None, None, 0, None, {1: 123.5, 2: 80.1}),
        bench.Result(spec, 0.27, None, 0.27, 1, None, None, 0, None),  # not swept: no row
    ]
    assert bench.sweep_table(results)[2:] == [
        "| 64 speculative (1+3) @4k | 268.8 | 305.0 | 1 | 2 |",
        "| decode 1 x 4096 | 123.5 | 80.1 | 2 | 8 |",
    ]
    assert bench.sweep_table(results[2:]) == []


def test_floors_are_judged_on_calls_launched_and_replayed_from_graphs():
    bench = load_benchmark()
    _, decode, nbytes = decode_32_x_4096(bench)
    at = {pct: nbytes / (pct / 100 * 4800e9) * 1e3 for pct in (70, 90)}  # ms at that share
    small = bench.Batch("decode 1 x 4096", [(4095, 1)])
    mixed = bench.Batch("chunk 512 @ctx 2k + 63 decodes @4k", [(2048, 512)] + [(4096, 1)] * 63)
    results = [
        bench.Result(decode, at[70], None, at[70], 4, None, None, nbytes, None, None, at[90]),
        # Launched from Python the host's launch sets the small decode's time; in graphs not.
        bench.Result(small, 0.07, 0.07, 0.07, 8, None, 0.017, 0, 0.0, None, 0.02, 0.016),
        bench.Result(mixed, 0.3, None, 0.3, 1, 0.33, None, 0, None, None, 0.24),
    ]
    lines = bench.floor_lines(results, 4800.0)
    assert lines[0] == (
        "Floor (decode, >= 32 sequences, >= 4k context, >= 85% of peak): NOT met; lowest 70.0%"
        " (decode 32 x 4096); in CUDA graphs: met; lowest 90.0% (decode 32 x 4096)."
    )
    assert lines[1] == (
        "Floor (decode 1 x 4096 within 1.3x SDPA): NOT met; 4.12x; in CUDA graphs: met; 1.25x."
    )
    assert lines[2] == (
        "Floor (chunk 512 @ctx 2k + 63 decodes @4k <= 244 µs): NOT met; 300.0 µs; "
        "in CUDA graphs: met; 240.0 µs."
    )
    table = bench.format_table(results, 4800.0)
    assert table[2].endswith("| 124.4 | 90.0 | – |")  # graph µs, its % of peak, no SDPA
    assert table[3].endswith("| 20.0 | 0.0 | 16.0 |")


def test_tile_sweep_times_the_stages_before_and_other_tiles():
    bench = load_benchmark()
    from weir.kernels import triton_attention as ta

    def hopper_plan(num_tokens, num_requests, max_query_len, fp8=False):
        return ta.plan_launches(
            num_tokens, num_requests, 32, 8, 128, 16, torch.bfloat16, 9, 132, max_query_len,
            4096, None, None, None, False, fp8,
        )  # fmt: skip

    mixed = hopper_plan(575, 64, 512)
    assert mixed.prefill is not None and mixed.decode.num_stages == ta.HOPPER_STAGES == 5
    before = bench.stages_before(mixed)
    assert (before.decode.num_stages, before.prefill.num_stages) == (3, 3)
    assert before.decode.tile_n == mixed.decode.tile_n and before.decode_grid == mixed.decode_grid
    assert bench.decode_keys_32(mixed).decode.tile_n == 32
    assert bench.decode_keys_32(hopper_plan(32, 32, 1, fp8=True)) is None  # already 32 keys
    wide = bench.prefill_keys_128(mixed)
    assert (wide.prefill.tile_n, wide.prefill.block_m, wide.decode) == (128, 128, mixed.decode)
    narrow = bench.prefill_rows_64(mixed)
    assert (narrow.prefill.block_m, narrow.prefill.num_warps, narrow.prefill.tile_n) == (64, 4, 64)
    decodes = hopper_plan(32, 32, 1)
    assert decodes.prefill is None
    assert bench.prefill_keys_128(decodes) is None and bench.prefill_rows_64(decodes) is None
    decode = bench.Batch("decode 32 x 4096", [(4095, 1)] * 32)
    swept = bench.Result(decode, 0.2, None, 0.2, 4, None, None, 0, None, None, 0.15, None,
                         {"3 stages (before)": 161.0, "decode 32 keys": None})  # fmt: skip
    assert bench.tiles_table([swept])[2] == "| decode 32 x 4096 | 150.0 | 161.0 | – | – | – |"
    assert bench.tiles_table([bench.Result(decode, 0.2, None, 0.2, 4, None, None, 0, None)]) == []


def test_a_tile_alternative_that_fails_or_computes_otherwise_is_not_timed(capsys):
    bench = load_benchmark()
    from triton.runtime.errors import OutOfResources

    default_out = torch.ones(4, 2)
    out = default_out.clone()

    def out_of_shared_memory(call):
        raise OutOfResources(232448, 227328, "shared memory")

    args = ("prefill 4k, prefill 128 keys", lambda: None)
    assert bench.alternative_us(*args, out_of_shared_memory, out, default_out) is None
    assert bench.alternative_us(*args, lambda call: 0.25, out, default_out) == 250.0
    out[1, 1] = 1.5
    assert bench.alternative_us(*args, lambda call: 0.25, out, default_out) is None
    said = capsys.readouterr().out
    assert "prefill 128 keys: not timed (OutOfResources" in said
    assert "differs from the default's by 0.5" in said
