"""vLLM's `--config FILE`: a YAML file of a command's long flags, under the command line's."""

import subprocess
import sys

import pytest

from weir.services.cli import parse_args


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_the_file_gives_flags_and_the_command_line_wins(tmp_path):
    path = _config(
        tmp_path,
        """
model: /models/file-model
max_num_seqs: 64               # underscores or dashes, as vLLM's
max-model-len: 32k             # converted by the flag's own type
enable-prefix-caching: false   # --no-enable-prefix-caching
enforce-eager: true
enable-log-requests: true      # a store_true flag
served-model-name: [a, b]      # nargs +
speculative-config: {method: ngram, num_speculative_tokens: 3}
hf-overrides: {released: 2024-01-31}  # a YAML date: its text in the JSON
allowed-origins: http://x
lora-modules: []               # left at its default, as vLLM's
tool-call-parser: null         # null too
port: 9000
api-key: -k3y                  # a value that begins with a dash is still the value
""",
    )
    args = parse_args(["serve", "--config", path])
    assert (args.model, args.model_tag, args.max_num_seqs, args.max_model_len) == (
        "/models/file-model",
        None,
        64,
        32000,
    )
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.enable_log_requests is True
    assert args.served_model_name == ["a", "b"]
    assert args.speculative_config == '{"method": "ngram", "num_speculative_tokens": 3}'
    assert args.hf_overrides == '{"released": "2024-01-31"}'
    assert args.allowed_origins == ["http://x"] and args.port == 9000
    assert args.api_key == "-k3y"
    assert args.lora_modules == () and args.tool_call_parser is None  # their defaults

    args = parse_args(
        ["serve", "/models/cli-model", "--config", path, "--max-num-seqs", "8", "--port", "0",
         "--enable-prefix-caching"]
    )  # fmt: skip
    assert (args.model_tag, args.model) == ("/models/cli-model", None)  # the file's is left out
    assert (args.max_num_seqs, args.port, args.enable_prefix_caching) == (8, 0, True)
    assert args.max_model_len == 32000  # what the command line leaves out, the file gives


def test_a_flag_the_command_requires_may_come_from_the_file(tmp_path):
    path = _config(tmp_path, "input-file: in.jsonl\noutput-file: out.jsonl\n")
    args = parse_args(["run-batch", "--config", path])
    assert (args.input_file, args.output_file) == ("in.jsonl", "out.jsonl")
    args = parse_args(["run-batch", "--config", path, "-o", "other.jsonl"])
    assert args.output_file == "other.jsonl"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seqs: 64\nno-such-flag: 1\n", "'no-such-flag' is no option of this command"),
        ("config: other.yaml\n", "'config' is no option of this command"),
        ("- max-num-seqs\n- 64\n", "a mapping of flags to values is needed"),
        ("enforce-eager: yes please\n", "enforce-eager must be true or false"),
        ("max-model-len: [1, 2]\n", "max-model-len takes one value, not a list"),
        ("max-num-seqs: [64\n", "--config"),  # not YAML
        ("max-num-seqs: lots\n", "argument --max-num-seqs: invalid"),  # the flag's own check
    ],
)
def test_a_bad_file_ends_the_command_with_a_message(tmp_path, text, message):
    path = _config(tmp_path, text)
    done = subprocess.run(
        [sys.executable, "-m", "weir.services.cli", "serve", "--config", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(SystemExit) as exited:
        parse_args(["scheduler", "--config", str(tmp_path / "absent.yaml")])
    assert exited.value.code == 2


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("served-model-name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--config", str(path)])
    assert exited.value.code == 2
    assert f"--config {path}: 'utf-8' codec can't decode" in capsys.readouterr().err


def test_a_second_file_is_refused_rather_than_one_of_them_dropped(tmp_path, capsys):
    first, second = _config(tmp_path, "max-num-seqs: 8\n"), str(tmp_path / "second.yaml")
    (tmp_path / "second.yaml").write_text("max-model-len: 256\n")
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--config", first, "--config", second])
    assert exited.value.code == 2
    assert "--config is given 2 times; give one file" in capsys.readouterr().err
