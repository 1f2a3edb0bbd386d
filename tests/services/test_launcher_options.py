"""`weir serve` and `LLM` forward engine options to the roles' command lines unchanged."""

import argparse

import pytest

from weir.services.cli import build_parser
from weir.services.launcher import ENGINE_OPTIONS, check_engine_options, engine_argv, parse_size


@pytest.mark.parametrize("text, size", [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1048576", 2**20),
                                        ("1.5 GiB", 3 * 2**29), ("64k", 64_000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "5i", "12 parsecs", "-3MB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_serve_options_reach_each_role_unchanged():
    serve = vars(build_parser().parse_args([
        "serve", "--model", "/m", "--block-size", "8", "--max-num-batched-tokens", "32",
        "--max-model-len", "100", "--no-enable-prefix-caching", "--policy", "priority",
        "--kv-cache-memory", "4MiB", "--threads", "2", "--seed", "7", "--executor-timeout", "9"]))
    engine = {opt.dest: serve[opt.dest] for opt in ENGINE_OPTIONS}
    scheduler = vars(build_parser().parse_args(["scheduler", *engine_argv(engine, "scheduler")]))
    executor = vars(build_parser().parse_args(
        ["executor", "--scheduler", "ipc://x", *engine_argv(engine, "executor")]))
    for opt in ENGINE_OPTIONS:
        role = scheduler if "scheduler" in opt.roles else executor
        assert role[opt.dest] == serve[opt.dest], opt.flag
    assert scheduler["enable_prefix_caching"] is False and executor["kv_cache_memory"] == 4 * 2**20


def test_unknown_engine_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_batch_tokens"):
        check_engine_options({"max_num_batch_tokens": 3})
