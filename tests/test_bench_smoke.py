"""Smoke tests of `weir bench throughput` and `weir bench serve` on a tiny random Llama.

Expected token counts are computed here from the workload the test writes, not
taken from the harness; string prompts are counted with transformers' tokenizer.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from weir.services.launcher import free_port

BENCH = [sys.executable, "-m", "weir.services.cli", "bench"]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SERVER_START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """2-layer, hidden-32 random Llama with the default model's vocabulary and tokenizer."""
    base = json.loads((default_model_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    return path


def test_bench_throughput_against_both_baselines(tiny_model_dir: Path, tmp_path: Path) -> None:
    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog."
    records = [
        {"prompt": [101, 202, 303, 404, 505, 606], "output_len": 2},
        {"prompt": text, "output_len": 5},
        {"prompt": list(range(1000, 1012)), "output_len": 3},
        {"prompt": [4000, 4001, 4002], "output_len": 4},
    ]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompt_tokens = 6 + len(hf_tokenizer(text)["input_ids"]) + 12 + 3
    output_tokens = 2 + 5 + 3 + 4
    # Batches of 3 in request order: [2, 5, 3] decodes 5 per row, [4] decodes 4.
    static_generated = 3 * 5 + 4

    result_path = tmp_path / "throughput.json"
    markdown_path = tmp_path / "bench.md"
    proc = subprocess.run(
        [
            *BENCH,
            "throughput",
            "--model",
            str(tiny_model_dir),
            "--dataset",
            str(dataset),
            "--baseline",
            "hf-static,hf-cb",
            "--hf-batch-size",
            "3",
            "--threads",
            "1",
            "--max-num-seqs",
            "4",
            # Engine options reach Weir's LLM (its tokens counted as without them).
            "--kv-cache-dtype",
            "fp8",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
            "--disable-detokenize",
            "--output-json",
            str(result_path),
            "--markdown",
            str(markdown_path),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    result = json.loads(result_path.read_text())
    engines = {e["engine"]: e for e in result["engines"]}
    assert list(engines) == ["weir", "hf-static", "hf-cb"]
    for e in engines.values():
        assert e["num_requests"] == 4
        assert e["prompt_tokens"] == prompt_tokens
        assert e["output_tokens"] == output_tokens
        assert e["wall_s"] > 0
        assert e["requests_per_s"] > 0 and e["output_tokens_per_s"] > 0
        assert e["total_tokens_per_s"] > e["output_tokens_per_s"]
    assert "kv_cache_dtype=fp8" in engines["weir"]["notes"]
    assert "no detokenization" in engines["weir"]["notes"]
    # Read from the executor's metrics (a CPU has no Triton kernels to compile).
    assert any("compiled during the timed run: 0 " in note for note in result["notes"])
    assert '"method": "ngram"' in engines["weir"]["notes"]
    assert engines["hf-static"]["generated_tokens"] == static_generated
    assert engines["hf-cb"]["generated_tokens"] == output_tokens
    assert set(result["ratios_output_tokens_per_s"]) == {"weir/hf-static", "weir/hf-cb"}
    assert all(r > 0 for r in result["ratios_output_tokens_per_s"].values())
    table = markdown_path.read_text()
    assert "| hf-static |" in table and "| hf-cb |" in table and "| weir |" in table


def _llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _bench_llama_cpp_only(tmp_path: Path, default_model_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            *BENCH,
            "throughput",
            "--no-weir",
            "--baseline",
            "llama-cpp",
            "--num-prompts",
            "4",
            "--input-len-min",
            "4",
            "--input-len-max",
            "12",
            "--output-len-min",
            "2",
            "--output-len-max",
            "5",
            "--threads",
            "1",
            "--output-json",
            str(tmp_path / "llama.json"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(not _llama_cpp_installed(), reason="llama-cpp-python is not installed")
def test_bench_throughput_llama_cpp_baseline_on_the_default_gguf(
    tmp_path: Path, default_model_dir: Path
) -> None:
    proc = _bench_llama_cpp_only(tmp_path, default_model_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "llama.json").read_text())
    [run] = result["engines"]
    assert run["engine"] == "llama-cpp" and run["num_requests"] == 4
    assert run["output_tokens"] == run["generated_tokens"] == result["output_tokens"]
    assert run["prompt_tokens"] == result["prompt_tokens"] and run["output_tokens_per_s"] > 0
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in run["notes"]


@pytest.mark.skipif(_llama_cpp_installed(), reason="llama-cpp-python is installed")
def test_bench_throughput_says_how_to_install_llama_cpp(
    tmp_path: Path, default_model_dir: Path
) -> None:
    proc = _bench_llama_cpp_only(tmp_path, default_model_dir)
    assert proc.returncode == 2  # nothing else was asked for, so nothing ran
    assert "skipping the llama-cpp baseline: llama_cpp is not installed" in proc.stderr
    assert "pip install llama-cpp-python" in proc.stderr


@pytest.mark.parametrize(
    "flags, error",
    [
        (["throughput", "--model", "/no/such/model"], "error: model '/no/such/model': no such"),
        (["throughput", "--kv-cache-memory", "12XB"], "--kv-cache-memory: not a size: '12XB'"),
        (
            ["serve", "--backend", "openai", "--address", "tcp://127.0.0.1:1"],
            "error: --address is not read by --backend openai, which takes --base-url",
        ),
        # Each of these was a traceback, or (nan) a run of every request at once.
        (["throughput", "--speculative-config", "{bad"], "error: speculative_config is not JSON"),
        (["throughput", "--max-mixed-graph-tokens", "-5"], "must be >= 0, got -5"),
        (["serve", "--request-rate", "nan"], "error: --request-rate must be > 0"),
        # Results that could not be written are refused before the run, not after it.
        (["serve", "--output-json", "/"], "error: /: is a directory"),
        (["serve", "--plot-dir", "/etc/passwd"], "error: /etc/passwd: is not a directory"),
        (["throughput", "--output-json", "/etc/passwd/x.json"], "/etc/passwd is not a writable"),
    ],
)
def test_bench_refuses_bad_options_in_one_line(flags, error, capsys) -> None:
    """Before anything runs, and without a traceback."""
    from weir.services.bench import run_cli

    try:
        code = run_cli(flags)
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err, err


def test_output_paths_that_can_be_written_pass_the_check_before_a_run(tmp_path: Path) -> None:
    """A results file replaced or a markdown file appended to, a new one in a new folder, a
    plot folder that exists or not: none is refused (the refusals are above)."""
    from weir.services.bench.report import check_output_paths

    existing = tmp_path / "benchmarks.md"
    existing.write_text("| table |\n")
    check_output_paths((existing, tmp_path / "new" / "deeper" / "run.json"), (tmp_path,))
    check_output_paths((), (tmp_path / "plots",))
    with pytest.raises(OSError, match="is a directory"):
        check_output_paths((tmp_path,))


def test_a_bad_dataset_record_is_named_by_its_line(tmp_path: Path, capsys) -> None:
    from weir.services.bench import run_cli

    for record in ('{"prompt": 5, "output_len": 2}', '{"prompt": "hi", "output_len": 2.7}', "{"):
        dataset = tmp_path / "data.jsonl"
        dataset.write_text('{"prompt": "ok", "output_len": 2}\n' + record + "\n")
        assert run_cli(["throughput", "--dataset", str(dataset)]) == 2
        err = capsys.readouterr().err
        assert f"error: {dataset}:2: need 'prompt' (text or token ids) and an integer" in err


def test_the_reported_command_repeats_a_negated_option() -> None:
    """--no-async-scheduling (a BooleanOptionalAction's False) is part of the run's
    command; an unset plain flag is not."""
    from weir.services.bench import add_bench_subcommands
    from weir.services.bench.report import command_line

    parser = argparse.ArgumentParser(prog="weir")
    add_bench_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "throughput", "--no-async-scheduling"])
    words = command_line("weir bench throughput", args).split()
    assert "--no-async-scheduling" in words
    assert not {"--no-weir", "--no-no-weir", "--disable-detokenize", "--no-enforce-eager"} & set(
        words
    )
    assert parser.parse_args(words[1:]) == args


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """``weir serve`` on the tiny model, shared by the backends' runs: (ZeroMQ address,
    OpenAI base URL)."""
    from weir.shared.client import WeirClient, WeirError

    port, http_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weir.services.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--executor-metrics-port",
            "0",
            "--http-port",
            str(http_port),
            # Lockstep: every step's outputs are sent alone (async scheduling sends the tiny
            # model's steps several at once whenever publishing falls behind), so each token
            # is one streamed chunk, which the ITL count below relies on.
            "--no-async-scheduling",
        ],
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        with WeirClient(address, timeout=1.0) as client:
            while True:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "server did not answer health() in time"
                try:
                    if client.health().get("status") == "ok":
                        break
                except WeirError:
                    pass
                time.sleep(0.1)
        yield address, f"http://127.0.0.1:{http_port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("backend", ["weir", "openai"])
def test_bench_serve_writes_results_and_plots(
    server: tuple[str, str], backend: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    result_path = tmp_path / "serve.json"
    plot_dir = tmp_path / "plots"
    address, base_url = server
    # A base URL without /v1, run alongside (its start is seconds of imports): the gateway's
    # 404, in one line.
    unversioned = None
    if backend == "openai":
        unversioned = subprocess.Popen(
            [*BENCH, "serve", "--backend", "openai", "--base-url", base_url.removesuffix("/v1")]
            + ["--model", str(tiny_model_dir), "--num-prompts", "1", "--no-progress"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    proc = subprocess.run(
        [
            *BENCH,
            "serve",
            "--backend",
            backend,
            *(["--base-url", base_url] if backend == "openai" else ["--address", address]),
            "--model",
            str(tiny_model_dir),
            "--num-prompts",
            "6",
            "--input-len-min",
            "4",
            "--input-len-max",
            "4",
            "--output-len-min",
            "5",
            "--output-len-max",
            "5",
            "--request-rate",
            "50",
            "--max-concurrency",
            "4",
            "--slo-ttft",
            "60000",
            "--slo-tpot",
            "60000",
            "--no-progress",
            "--output-json",
            str(result_path),
            "--plot-dir",
            str(plot_dir),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    result = json.loads(result_path.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 4
    assert result["total_output_tokens"] == 6 * 5
    assert [r["output_tokens"] for r in result["requests"]] == [5] * 6
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    # Generous SLOs: every request meets them, so goodput equals request throughput.
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[metric]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], metric
    assert result["ttft_ms"]["p99"] <= result["e2el_ms"]["p99"]
    # One inter-token gap per token after the first, even where a token's text is empty
    # (the gateway streams a chunk per token; skipping empty ones merged two gaps).
    assert result["itl_ms"]["count"] == 6 * 4, result["itl_ms"]
    # The command names the address this backend used, not the other's default.
    assert ("--base-url" in result["command"]) == (backend == "openai"), result["command"]
    for name in ("latency_cdf.png", "throughput_over_time.png"):
        assert (plot_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if unversioned is not None:
        _, stderr = unversioned.communicate(timeout=120)
        assert unversioned.returncode == 1 and "Traceback" not in stderr, stderr
        assert "does --base-url end in /v1?" in stderr


def test_bench_serve_gives_up_after_its_ready_timeout(tiny_model_dir: Path) -> None:
    """Not after the SDK's 30 s request timeout: --ready-timeout bounds the wait."""
    nobody = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    proc = subprocess.run(
        [*BENCH, "serve", "--address", nobody, "--model", str(tiny_model_dir)]
        + ["--num-prompts", "1", "--ready-timeout", "0.5", "--no-progress"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not ready after 0.5 s" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 25


def test_bench_serve_reads_weir_address(tiny_model_dir: Path) -> None:
    """Without --address it benchmarks $WEIR_ADDRESS, as the other `weir` commands read it
    (it went to 127.0.0.1:8100, whatever answered there)."""
    nobody = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [*BENCH, "serve", "--model", str(tiny_model_dir)]
        + ["--num-prompts", "1", "--ready-timeout", "0.5", "--no-progress"],
        env=ENV | {"WEIR_ADDRESS": nobody},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and f"error: {nobody}: server not ready" in proc.stderr, proc.stderr


def test_serve_metrics_from_hand_made_traces() -> None:
    from weir.services.bench.serve import RequestTrace, summarize_run

    fast = RequestTrace(
        prompt_len=8,
        output_len=4,
        send_s=0.0,
        chunk_s=[0.1, 0.15, 0.3],
        chunk_tokens=[1, 1, 2],
        end_s=0.3,
    )
    slow = RequestTrace(
        prompt_len=6, output_len=2, send_s=1.0, chunk_s=[1.5, 1.6], chunk_tokens=[1, 1], end_s=1.6
    )
    failed = RequestTrace(prompt_len=5, output_len=3, send_s=0.5, error="EngineError: boom")
    result = summarize_run(
        [fast, slow, failed], duration_s=2.0, slo_ttft_ms=200.0, slo_tpot_ms=None
    )

    assert (result["completed"], result["failed"]) == (2, 1)
    assert result["errors"] == ["EngineError: boom"]
    assert result["total_input_tokens"] == 14 and result["total_output_tokens"] == 6
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(3.0)
    # Only `fast` meets the 200 ms TTFT SLO (slow's TTFT is 500 ms).
    assert result["goodput"] == pytest.approx(0.5)
    assert result["ttft_ms"]["mean"] == pytest.approx((100 + 500) / 2)
    assert result["tpot_ms"]["mean"] == pytest.approx((200 / 3 + 100) / 2)
    assert result["itl_ms"]["mean"] == pytest.approx((50 + 150 + 100) / 3)
    assert result["e2el_ms"]["p50"] == pytest.approx((300 + 600) / 2)
