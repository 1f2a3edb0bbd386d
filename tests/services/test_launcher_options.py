"""`weir serve` and `LLM` forward engine options to the roles' command lines unchanged."""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from weir.services.cli import _api_key, _engine_args, build_parser, main
from weir.services.launcher import ChildFailedError, ServerProcesses, free_port
from weir.services.llm import LLM
from weir.shared.config import (
    SCHEDULER,
    CacheConfig,
    EngineArgs,
    SchedulerConfig,
    default_step_limits,
    parse_size,
    resolve_max_model_len,
)
from weir.shared.gpu_info import GpuInfo, probe_gpu
from weir.shared.model_store import resolve_model


@pytest.mark.parametrize(
    "text, size",
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1048576", 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("64k", 64_000),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "5i", "12 parsecs", "-3MB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_serve_options_reach_each_role_unchanged():
    serve = vars(
        build_parser().parse_args(
            [
                "serve",
                "--model",
                "/m",
                "--block-size",
                "8",
                "--max-num-batched-tokens",
                "32",
                "--max-model-len",
                "100",
                "--no-enable-prefix-caching",
                "--policy",
                "priority",
                "--kv-cache-memory",
                "4MiB",
                "--threads",
                "2",
                "--seed",
                "7",
                "--executor-timeout",
                "9",
                "--keys-dir",
                "/etc/weir/keys",
            ]
        )
    )
    engine = EngineArgs.from_cli(argparse.Namespace(**serve))
    scheduler = vars(build_parser().parse_args(["scheduler", *engine.to_argv("scheduler")]))
    executor = vars(
        build_parser().parse_args(
            ["executor", "--scheduler", "ipc://x", *engine.to_argv("executor")]
        )
    )
    for f in fields(EngineArgs):
        role = scheduler if SCHEDULER in f.metadata["roles"] else executor
        assert role[f.name] == serve[f.name], f.name
    assert scheduler["enable_prefix_caching"] is False and executor["kv_cache_memory"] == 4 * 2**20
    assert scheduler["keys_dir"] == executor["keys_dir"] == "/etc/weir/keys"


def test_serve_takes_the_model_and_the_key_as_vllm_serve_does(monkeypatch, capsys):
    """`vllm serve MODEL` (or --model, not both, unless they agree); $VLLM_API_KEY too."""
    assert (
        _engine_args(build_parser().parse_args(["serve", "/m", "--block-size", "8"])).model == "/m"
    )
    assert _engine_args(build_parser().parse_args(["serve", "/m", "--model", "/m"])).model == "/m"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/m", "--model", "/n"])
    assert exit_info.value.code == 2 and "'/m' or --model '/n', not both" in capsys.readouterr().err
    named = _engine_args(
        build_parser().parse_args(["serve", "/m", "--served-model-name", "a", "b"])
    )
    assert named.served_model_name == ("a", "b")
    model = str(resolve_model(None))
    with pytest.raises(SystemExit) as exit_info:  # argparse hands the model to the names
        main(["serve", "--served-model-name", "a", model])
    assert exit_info.value.code == 2 and "give the model first" in capsys.readouterr().err
    # A name that is merely a directory here is a name.
    beside = _engine_args(build_parser().parse_args(["serve", "--served-model-name", "a", "/"]))
    assert beside.served_model_name == ("a", "/")
    monkeypatch.delenv("WEIR_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _api_key(build_parser().parse_args(["serve"])) == "from-vllm"
    monkeypatch.setenv("WEIR_API_KEY", "from-weir")
    assert _api_key(build_parser().parse_args(["serve"])) == "from-weir"


def test_engine_defaults_are_the_configs_defaults():
    args = build_parser().parse_args(["serve"])
    assert EngineArgs.from_cli(args) == EngineArgs()
    # The engine overlaps steps by default; a bare Scheduler (tests, benchmarks) runs lockstep.
    assert EngineArgs().scheduler_config(8192) == SchedulerConfig(
        max_model_len=8192, async_scheduling=True
    )
    assert not EngineArgs(speculative_method="ngram").scheduler_config(8192).async_scheduling
    assert EngineArgs().cache_config(7, None) == CacheConfig(num_blocks=7)


H200 = GpuInfo("NVIDIA H200", 143_771 * 2**20)
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", 81_920 * 2**20)
L4 = GpuInfo("NVIDIA L4", 23_034 * 2**20)


@pytest.mark.parametrize(
    "device, gpu, server, offline",
    [
        (None, None, (2048, 256), (2048, 256)),  # no GPU found: a CPU's
        ("cpu", None, (2048, 256), (2048, 256)),
        (None, H200, (8192, 1024), (16384, 1024)),  # vLLM's for a GPU of >= 70 GiB
        ("cuda:0", H200, (8192, 1024), (16384, 1024)),
        (None, A100, (2048, 256), (8192, 256)),  # but an A100 (vLLM #17885)
        (None, L4, (2048, 256), (8192, 256)),
        ("cuda", None, (2048, 256), (8192, 256)),  # CUDA asked for, NVML silent
    ],
)
def test_step_limits_left_out_are_vllms_for_the_device(device, gpu, server, offline):
    assert default_step_limits(device, gpu, offline=False) == server
    assert default_step_limits(device, gpu, offline=True) == offline
    args = EngineArgs(device=device).with_step_limits(gpu, offline=True)
    assert (args.max_num_batched_tokens, args.max_num_seqs) == args.step_limits == offline


def test_step_limits_given_are_kept_and_processes_started_apart_agree():
    given = EngineArgs(max_num_seqs=64).with_step_limits(H200, offline=True)
    assert given.step_limits == (16384, 64)
    assert EngineArgs(max_num_batched_tokens=512).with_step_limits(H200).step_limits == (512, 1024)
    # A scheduler and executors started apart (Kubernetes) know no GPU: both take a CPU's.
    assert EngineArgs().step_limits == (2048, 256)
    assert EngineArgs().max_num_seqs is None
    # A launcher gives every process the limits it resolved, as flags.
    argv = EngineArgs(device="cpu").with_step_limits(None).to_argv(SCHEDULER)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
    assert argv[argv.index("--max-num-seqs") + 1] == "256"


def test_a_launcher_on_a_cpu_resolves_the_step_limits_it_was_not_given():
    assert probe_gpu("cpu") is None
    server = ServerProcesses(EngineArgs(device="cpu", max_num_seqs=8), port=0, metrics_port=0)
    assert (server.engine_args.max_num_batched_tokens, server.engine_args.max_num_seqs) == (
        2048,
        8,
    )


def test_vllms_speculative_config_is_the_four_options_it_stands_for():
    """vLLM's --speculative-config (a dict for LLM): the roles get the options it stands for."""
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    args = build_parser().parse_args(["serve", "--speculative-config", config])
    engine = EngineArgs.from_cli(args)
    # One bound given is the other too (vLLM's).
    want = EngineArgs(
        speculative_method="ngram", num_speculative_tokens=3, ngram_min=5, ngram_max=5
    )
    assert engine == want == EngineArgs(speculative_config=json.loads(config))
    assert want == EngineArgs(speculative_config=config.replace("max", "min"))
    scheduler = build_parser().parse_args(["scheduler", *engine.to_argv("scheduler")])
    assert EngineArgs.from_cli(scheduler).scheduler_config(100).num_speculative_tokens == 3
    for bad, words in [
        ('{"method": "medusa"}', "one of ('ngram', 'draft_model', 'eagle', 'eagle3')"),
        ('{"method": "eagle"}', "eagle needs speculative_model"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "not supported"),
        ('{"method": "ngram", "model": "x"}', "not of 'ngram'"),
        ('{"method": "draft_model"}', "needs speculative_model"),
        ('{"model": ""}', "model must be a non-empty string"),
        ('{"model": "x", "quantization": 8}', "quantization must be a non-empty string"),
        ('{"model": "x", "quantization": "fp8"}', "speculative_model_quantization must be one"),
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
        (
            '{"method": "ngram", "num_speculative_tokens": "3"}',
            "num_speculative_tokens must be an int",
        ),
        ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min must be >= 1"),
        (
            '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4}',
            "ngram_max (prompt_lookup_max) 4 is less than ngram_min (prompt_lookup_min) 5",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            EngineArgs(speculative_config=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(speculative_config=config, speculative_method="ngram")
    # An option given on its own too must agree with the config (it was overridden silently).
    for option, value in [("num_speculative_tokens", 5), ("ngram_min", 3)]:
        with pytest.raises(ValueError, match=rf"{option} {value}: give it in one place"):
            EngineArgs(speculative_config=config, **{option: value})
    assert EngineArgs(speculative_config=config, num_speculative_tokens=3) == want


def test_a_draft_model_names_its_method_and_gives_the_scheduler_lookahead():
    """vLLM's {"model": ...} is draft_model speculative decoding; the scheduler allocates
    slots ahead for the draft's proposals, and the roles get what they need."""
    config = '{"model": "/models/draft", "num_speculative_tokens": 4, "quantization": "int8"}'
    engine = EngineArgs.from_cli(
        build_parser().parse_args(["serve", "--speculative-config", config])
    )
    assert engine == EngineArgs(
        speculative_model="/models/draft",
        num_speculative_tokens=4,
        speculative_model_quantization="int8",
    )
    assert engine.speculative_method == "draft_model"
    scheduler_config = engine.scheduler_config(100)
    assert scheduler_config.num_lookahead_tokens == scheduler_config.num_speculative_tokens == 4
    assert not scheduler_config.async_scheduling
    assert (
        EngineArgs(speculative_method="ngram", num_speculative_tokens=4)
        .scheduler_config(100)
        .num_lookahead_tokens
        == 0
    )  # the scheduler's own drafts are never written ahead
    executor = build_parser().parse_args(
        ["executor", "--scheduler", "tcp://h:1", *engine.to_argv("executor")]
    )
    assert EngineArgs.from_cli(executor).speculative_model_quantization == "int8"
    with pytest.raises(ValueError, match="needs a speculative_model"):
        EngineArgs(speculative_model_quantization="int8")


def test_unknown_engine_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_batch_tokens"):
        LLM(max_num_batch_tokens=3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--executor-timeout", "-1"], "--executor-timeout must be > 0 seconds, got -1.0"),
        (["--recovery-timeout", "0"], "--recovery-timeout must be > 0 seconds, got 0.0"),
        (["--drain-timeout", "-5"], "--drain-timeout must be >= 0 seconds, got -5.0"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
        (["--max-model-len", "1"], "--max-model-len must be >= 2, got 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        (["--max-num-batched-tokens", "-8"], "--max-num-batched-tokens must be >= 1, got -8"),
        (["--max-mixed-graph-tokens", "-1"], "--max-mixed-graph-tokens must be >= 0, got -1"),
        (["--max-mixed-graph-tokens", "9000"], "--max-mixed-graph-tokens must be <= 8192"),
        (["--block-size", "0"], "--block-size must be >= 1, got 0"),
        # vLLM's --host binds its API alone; here the engine's client port too, which the
        # API key does not guard.
        (["--host", "0.0.0.0", "--api-key", "k"], "--host 0.0.0.0 opens the engine's client"),
    ],
)
def test_impossible_options_end_serve_with_one_line_naming_the_flag(flags, message, capsys):
    """Before any process starts: no traceback, no executor restarted in a loop."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weir serve: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "flags, message",
    [
        # The SDK's own health checks did not fit: every request was "no replica is ready".
        (["--max-message-size", "200"], "--max-message-size must be at least 2MiB, got 200"),
        # The executor failed to start: "Overflow when unpacking long long".
        (["--seed", str(10**20)], f"--seed must be < 2**63 (a 64-bit integer), got {10**20}"),
        # The executor's slot arrays failed to allocate: an OSError traceback.
        (["--max-num-seqs", "100000000"], "--max-num-seqs must be <= 16384, got 100000000"),
        (["-tp", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    ],
)
def test_engine_options_no_process_can_start_with_end_serve_first(flags, message, capsys):
    """The options `weir serve` checks before it starts a process (a server, were they taken)."""
    with pytest.raises(SystemExit) as exit_info:
        _engine_args(build_parser().parse_args(["serve", *flags]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weir serve: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "command, flags, choice",
    [
        ("serve", ["--attention-backend", "flash"], "'flash'"),
        ("serve", ["--dtype", "fp8"], "'fp8'"),
        ("serve", ["--kv-cache-dtype", "fp8_inc"], "'fp8_inc'"),
        ("serve", ["--log-level", "loud"], "'LOUD'"),
        ("gateway", ["--log-level", "loud"], "'LOUD'"),
    ],
)
def test_a_named_choice_outside_the_list_is_refused_by_the_parser(command, flags, choice, capsys):
    """Not a traceback from a child process (or, for the log level, from each of them)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"{flags[0]}: invalid choice: {choice}" in err, err


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("serve", "--port", "70000"),  # int() took it, and the socket bound 70000 - 65536
        ("serve", "--port", "-1"),
        ("serve", "--http-port", "65536"),
        ("serve", "--metrics-port", "x"),
        ("gateway", "--port", "70000"),
        ("scheduler", "--metrics-port", "99999"),
        ("executor", "--metrics-port", "-2"),
    ],
)
def test_a_port_outside_0_to_65535_is_refused_by_the_parser(command, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"{flag}: not a port: '{value}' (0-65535; 0 = any free)" in err, err


@pytest.mark.parametrize(
    "option", [{"attention_backend": "flash"}, {"dtype": "fp8"}, {"log_level": "loud"}]
)
def test_llm_refuses_a_named_choice_outside_the_list(option):
    with pytest.raises(ValueError, match=f"{next(iter(option))} must be one of"):
        EngineArgs(**option)


def test_vllms_spellings_of_tensor_parallelism_and_the_context_length_are_taken(capsys):
    """vLLM's -tp N, and its --max-model-len suffixes: k = 1000, K = 1024."""
    for given, want in [("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("4096", 4096)]:
        args = build_parser().parse_args(["serve", "-tp", "2", "--max-model-len", given])
        assert (args.tensor_parallel_size, args.max_model_len) == (2, want), given
        engine = EngineArgs.from_cli(args)
        scheduler = build_parser().parse_args(["scheduler", *engine.to_argv("scheduler")])
        assert scheduler.max_model_len == want
    for bad in ("1.5K", "1x", "k"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-model-len", bad])
        assert f"--max-model-len: not a whole number: '{bad}'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # other unknown flags are still refused
        build_parser().parse_args(["serve", "--worker-cls", "auto"])
    assert "unrecognized arguments: --worker-cls" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, flag, value, message",
    [
        # Every POST was a 413.
        ("gateway", "--max-request-size", "0", "'0' is below 1KiB: no request fits"),
        # The scheduler's bind error named --port.
        ("serve", "--host", "999.1.1.1", "cannot bind '999.1.1.1': Name or service not known"),
        ("scheduler", "--host", "not_a_host", "cannot bind 'not_a_host': Name or service"),
        ("gateway", "--host", "not_a_host", "cannot bind 'not_a_host': Name or service"),
        ("serve", "--http-host", "not_a_host", "cannot bind 'not_a_host': Name or service"),
        ("serve", "--host", "192.0.2.1", "cannot bind '192.0.2.1': Cannot assign requested"),
    ],
)
def test_a_value_no_server_can_start_with_is_refused_by_the_parser(
    command, flag, value, message, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, f"{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"argument {flag}: {message}" in err, err


def test_the_hosts_of_this_machine_are_taken():
    args = build_parser().parse_args(["serve", "--host", "localhost", "--http-host", "0.0.0.0"])
    assert (args.host, args.http_host) == ("localhost", "0.0.0.0")


def run_weir(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weir.services.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=60,  # a refusal takes seconds; a role that took the value serves on
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        # Accepted, and never ready.
        (["scheduler", "--num-executors", "0"], "--num-executors must be >= 1, got 0"),
        (["scheduler", "--num-executors", "-2"], "--num-executors must be >= 1, got -2"),
        (["scheduler", "--max-message-size", "1"], "--max-message-size must be at least 2MiB"),
        # A 20-line ZeroMQ traceback, once the model had loaded.
        (
            ["executor", "--scheduler", "bogus"],
            "--scheduler: cannot connect to 'bogus': no tcp:// or ipc:// in front (an address "
            "is tcp://HOST:PORT or ipc://PATH)",
        ),
        (
            ["executor", "--scheduler", f"ipc://@{'x' * 107}"],
            "--scheduler: cannot connect to 'ipc://@xxx",
        ),
        # Accepted, then 503 forever.
        (
            ["gateway", "--scheduler", "tcp://127.0.0.1:99999"],
            "--scheduler: cannot connect to 'tcp://127.0.0.1:99999': port '99999' is not in "
            "1-65535",
        ),
        (
            ["gateway", "--scheduler", "tcp://:8100"],
            "--scheduler: cannot connect to 'tcp://:8100': no host",
        ),
        # Triton's 57-line traceback at the first forward pass.
        (
            ["executor", "--scheduler", "ipc://@x", "--device", "cpu", "--attention-backend"]
            + ["triton"],
            "--attention-backend triton needs a CUDA GPU; use native or torch",
        ),
    ],
)
def test_a_role_refuses_a_value_it_cannot_start_with_in_one_line(argv, message):
    out = run_weir(*argv)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"weir {argv[0]}: {message}"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def test_the_triton_backend_is_refused_where_no_gpu_is_the_default(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the executor runs on the GPU here")
    out = run_weir("executor", "--scheduler", "ipc://@x", "--attention-backend", "triton")
    assert out.returncode == 2
    assert out.stderr == (
        "weir executor: --attention-backend triton needs a CUDA GPU; use native or torch\n"
    )


def test_a_profiler_dir_that_cannot_be_a_directory_is_refused_at_start(tiny_model_dir, tmp_path):
    """Not at /stop_profile, with the trace lost (FileExistsError)."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    argv = ["scheduler", "--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "0"]
    out = run_weir(*argv, "--profiler-dir", str(taken))
    assert out.returncode == 2
    assert out.stderr == (
        f"weir scheduler: --profiler-dir {str(taken)!r} is not a directory and cannot be made "
        "one (File exists): name a directory, which is created if missing\n"
    )


def test_max_model_len_past_the_models_context_is_refused():
    assert resolve_max_model_len(None, 8192) == 8192
    assert resolve_max_model_len(4096, 8192) == 4096
    with pytest.raises(ValueError, match="longer than this model's context of 8192 tokens"):
        resolve_max_model_len(100_000_000, 8192)


def test_client_commands_refuse_bad_input_with_one_line(capsys):
    assert main(["generate", "1 2 x", "--token-ids"]) == 2
    assert capsys.readouterr().err == (
        "weir generate: --token-ids: '1 2 x' is not a list of integers\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x", "--presence-penalty", "3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("weir generate: presence_penalty must be in")
    with pytest.raises(SystemExit):
        main(["generate", "x", "--json-schema", "/no/such/schema.json"])
    assert capsys.readouterr().err.startswith("weir generate: --json-schema: [Errno 2]")
    with pytest.raises(SystemExit):
        main(["generate", "x", "--json", "--regex", "a+"])
    assert "not allowed with argument" in capsys.readouterr().err
    # A timeout the client would refuse is argparse's one line (was a traceback).
    for command in (["generate", "x"], ["chat"], ["health"], ["gateway"]):
        for timeout in ("0", "-1", "nan", "inf"):
            with pytest.raises(SystemExit) as exit_info:
                main([*command, "--timeout", timeout])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert err.endswith(f"--timeout: not a positive number of seconds: '{timeout}'\n")
    assert main(["health", "--address", "bogus"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("weir health: WeirError: cannot connect to 'bogus'") and err.count("\n") == 1
    )


def test_overlapping_ports_end_serve_before_any_process_starts(capsys):
    with pytest.raises(SystemExit):
        main(
            ["serve", "--tensor-parallel-size", "3", "--executor-metrics-port", "9000"]
            + ["--http-port", "9002"]
        )
    assert capsys.readouterr().err.startswith(
        "weir serve: ports overlap: --executor-metrics-port and --http-port both take port 9002"
    )


def test_any_free_port_never_overlaps():
    """0 asks for any free port, for every executor rank too (not 0 + r)."""
    ServerProcesses(
        EngineArgs(tensor_parallel_size=3), port=1, metrics_port=2, executor_metrics_port=0
    )


def test_prepare_model_failing_is_one_line_not_a_traceback(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["prepare-model", "--model", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("weir prepare-model: ") and err.count("\n") == 1, err


def test_the_startup_timeout_is_positive_and_its_expiry_names_who_was_still_starting(
    tiny_model_dir, capsys
):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--startup-timeout", "-1"])
    assert "not a positive number of seconds: '-1'" in capsys.readouterr().err
    engine = EngineArgs(model=str(tiny_model_dir), device="cpu", threads=1)
    server = ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, startup_timeout=0.5
    )
    with pytest.raises(ChildFailedError) as expired:
        server.start()
    assert str(expired.value).startswith("server not ready within 0.5s (still starting: ")
    assert "executor" in str(expired.value) and "--startup-timeout" in str(expired.value)


def test_free_ports_lie_below_the_ports_connections_take():
    """A listener's port comes from below the kernel's range for outgoing connections'
    local ports (a port picked by binding 0 comes from that range, and a connection took one
    before its listener bound it); each can be listened on."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert max(ports) < low and len(set(ports)) > 40
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()
