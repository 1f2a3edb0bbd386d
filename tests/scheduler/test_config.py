"""Config and sampling-parameter validation: every bad value names its field."""

import argparse
import re

import pytest

from weir.shared.config import (
    MAX_NUM_SEQS,
    MIN_MAX_MESSAGE_BYTES,
    CacheConfig,
    EngineArgs,
    SchedulerConfig,
    check_connect_address,
    human_readable_int,
    make_profiler_dir,
)
from weir.shared.sampling import SamplingParams, sample_seed


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 1.5}, "max_num_seqs"),
        ({"max_model_len": True}, "max_model_len"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
        ({"watermark": 1.0}, "watermark"),
        ({"watermark": "0.1"}, "watermark"),
        ({"policy": "lifo"}, "policy"),
        ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
        (  # the message names the flags that fix it
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
            "512 < 8192: a step holds a whole prompt then; give --max-num-batched-tokens 8192",
        ),
        (
            {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": 8192,
                "long_prefill_token_threshold": 64,
            },
            "long_prefill_token_threshold",
        ),
    ],
)
def test_scheduler_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_scheduler_config_defaults():
    config = SchedulerConfig()
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len) == (
        2048,
        256,
        8192,
    )
    assert config.enable_chunked_prefill and config.policy == "fcfs"
    custom = SchedulerConfig(max_num_batched_tokens=512, policy="priority", watermark=0)
    assert custom.policy == "priority" and custom.watermark == 0.0
    assert type(custom.watermark) is float


def test_engine_args_take_a_kv_cache_size_as_text_or_bytes():
    assert EngineArgs(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20
    assert EngineArgs(kv_cache_memory=4096).kv_cache_memory == 4096
    with pytest.raises(ValueError, match="kv_cache_memory: not a size"):
        EngineArgs(kv_cache_memory="lots")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_message_size": 1}, "max_message_size must be at least 2MiB, got 1"),
        ({"max_message_size": MIN_MAX_MESSAGE_BYTES - 1}, "max_message_size must be at least"),
        ({"max_num_seqs": MAX_NUM_SEQS + 1}, f"max_num_seqs must be <= {MAX_NUM_SEQS}"),
        ({"seed": 2**63}, "seed must be < 2**63"),
        ({"seed": -(2**63) - 1}, "seed must be >= -9223372036854775808"),
    ],
)
def test_engine_args_refuse_what_no_process_can_start_with(kwargs, message):
    """LLM(...) too: the limits are the engine's, not the command line's."""
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**kwargs)


def test_engine_args_take_their_bounds():
    EngineArgs(max_message_size=MIN_MAX_MESSAGE_BYTES, max_num_seqs=MAX_NUM_SEQS, seed=2**63 - 1)
    EngineArgs(seed=-(2**63))


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("1k", 1000), ("1K", 1024), ("1m", 10**6), ("1M", 2**20), ("25.6k", 25600)]
    + [("1.001k", 1001), ("2g", 2 * 10**9), ("2G", 2 * 2**30), ("1t", 10**12), ("1T", 2**40)],
)
def test_human_readable_ints_are_vllms(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "1.5", "k", "1x", "", "1kk", "-1"])
def test_human_readable_ints_refuse_what_vllm_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number"):
        human_readable_int(text)


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:8100", "tcp://[::1]:1", "tcp://scheduler.ns.svc:65535", "ipc:///tmp/s"]
    + ["ipc://@weir-1-ab", f"ipc://@{'x' * 106}"],
)
def test_a_connectable_address_is_taken(address):
    check_connect_address(address)


@pytest.mark.parametrize(
    "address, why",
    [
        ("bogus", "no tcp:// or ipc:// in front"),
        ("udp://h:1", "no tcp:// or ipc:// in front"),
        ("tcp://127.0.0.1:99999", "port '99999' is not in 1-65535"),
        ("tcp://127.0.0.1:0", "port '0' is not in 1-65535"),
        ("tcp://127.0.0.1", "no :PORT"),
        ("tcp://*:8100", "no host"),
        ("ipc://", "no path"),
        (f"ipc://@{'x' * 107}", "the path is longer than 107 bytes"),
    ],
)
def test_an_address_no_socket_connects_to_is_refused(address, why):
    with pytest.raises(ValueError) as refused:
        check_connect_address(address)
    assert str(refused.value) == (
        f"cannot connect to {address!r}: {why} (an address is tcp://HOST:PORT or ipc://PATH)"
    )


def test_the_profiler_dir_is_made_or_refused(tmp_path):
    make_profiler_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()
    make_profiler_dir(str(tmp_path / "a"))  # there already
    (tmp_path / "file").write_text("")
    for taken in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ValueError, match=f"profiler_dir '{taken}' is not a directory"):
            make_profiler_dir(str(taken))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ],
)
def test_cache_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_cache_config_requires_num_blocks():
    assert CacheConfig(num_blocks=10).block_size == 16
    assert CacheConfig(8, 10) == CacheConfig(block_size=8, num_blocks=10)
    with pytest.raises(ValueError, match="num_blocks is required"):
        CacheConfig()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"logprobs": 2**31}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 2**31}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": 10**400}, "frequency_penalty"),  # past float: not OverflowError
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": [[5, 1.0], [5, 2.0]]}, "logit_bias: token id 5 is given twice"),
        ({"logit_bias": "5"}, "logit_bias"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"detokenize": None}, "detokenize"),
        ({"detokenize": False, "stop": ["x"]}, "stop strings .* need detokenize=True"),
        ({"structured_output": {"xml": "<a/>"}}, "structured_output"),
        ({"structured_output": {"choice": []}}, "structured_output.choice"),
        ({"structured_output": {"json_object": False}}, "structured_output.json_object"),
        ({"structured_output": {"regex": "a" * 65537}}, "structured_output.regex: 65537"),
        ({"structured_output": {"choice": ["ab"] * 40000}}, "structured_output.choice: 80000"),
        # 129 levels of arrays (xgrammar's compile time grows as about the nesting's cube).
        (
            {"structured_output": {"json": '{"items": ' * 128 + "{}" + "}" * 128}},
            "nests objects and arrays more than 128 levels",
        ),
        (
            {"structured_output": {"json": "[" * 5000 + "]" * 5000}},
            "nests objects and arrays more than 128 levels",
        ),
        (
            {"structured_output": {"regex": "a", "disable_any_whitespace": 1}},
            "structured_output.disable_any_whitespace",
        ),
        ({"structured_output": {"regex": "a", "reasoning_end": ""}}, "reasoning_end"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": "5"}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"bad_words": "rain"}, "bad_words"),
        ({"bad_words": ["rain", ""]}, "bad_words"),
        ({"bad_words": ["w"] * 65}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[5, -1]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [5]}, "bad_words_token_ids"),
        ({"bad_words": ["w" * 257]}, "at most 256 characters"),
        ({"bad_words_token_ids": [[5] * 33]}, "1 to 32 tokens"),
        ({"structured_output": {"regex": "a", "reasoning_end": 16}}, "reasoning_end"),
        ({"structured_output": {"xml": "<a/>"}}, "unknown key 'xml'"),
        ({"structured_output": {"regex": None}}, "one kind of output, got none"),
        ({"structured_output": {"regex": "a", "disable_fallback": 0}}, "disable_fallback"),
        (
            {"structured_output": {"regex": "a", "disable_additional_properties": "yes"}},
            "disable_additional_properties",
        ),
        ({"structured_output": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern"),
    ],
)
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(kwargs)


def test_a_json_schema_nested_as_deep_as_compiled_is_taken():
    schema = '{"items": ' * 127 + "{}" + "}" * 127  # 128 levels
    assert SamplingParams(structured_output={"json": schema}).structured_output == {"json": schema}


def test_structured_output_fields_left_null_are_unset():
    """vLLM's StructuredOutputsParams is a dataclass whose unset fields are None (a client
    that sends it whole sends them null); only a kind set counts, and its options
    disable_fallback and disable_additional_properties are bools either way."""
    asked = {
        "choice": ["yes", "no"],
        "json": None,
        "regex": None,
        "grammar": None,
        "json_object": None,
        "disable_any_whitespace": None,
        "disable_fallback": False,
        "disable_additional_properties": True,
        "whitespace_pattern": None,
    }
    spec = SamplingParams(structured_output=asked).structured_output
    assert spec is not None and spec["choice"] == ["yes", "no"]
    assert {k for k, v in asked.items() if v is None}.isdisjoint(spec)
    assert SamplingParams.from_dict({"structured_output": asked}).structured_output == spec


def test_sampling_params_normalises_and_round_trips():
    params = SamplingParams(
        temperature=0,
        stop="END",
        stop_token_ids=[2, 3],
        top_k=-1,
        seed=123,
        logprobs=5,
        min_tokens=2,
    )
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert params.stop == ("END",) and params.stop_token_ids == (2, 3) and params.top_k == 0
    as_dict = params.to_dict()
    assert as_dict["stop"] == ["END"] and as_dict["stop_token_ids"] == [2, 3]
    assert SamplingParams.from_dict(as_dict) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    quiet = SamplingParams(detokenize=False)
    assert SamplingParams.from_dict(quiet.to_dict()) == quiet != SamplingParams()
    # Each stop id once: the executor bans them on every step before min_tokens.
    assert SamplingParams(stop_token_ids=[7, 2, 7, 2, 9] * 1000).stop_token_ids == (7, 2, 9)
    # vLLM's None for none, as a caller passing its optional arguments on sends them.
    nones = dict.fromkeys(("stop", "stop_token_ids", "logit_bias", "bad_words"))
    assert SamplingParams(**nones) == SamplingParams()
    # vLLM's seed -1: unseeded, in every sample of n (web UIs send it for "random").
    assert SamplingParams(seed=-1).seed is None
    assert [sample_seed(-1, i) for i in range(3)] == [None] * 3
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"best_of": 2})
    assert SamplingParams.from_dict(SamplingParams(n=3).to_dict()).n == 3
    with pytest.raises(ValueError, match="dict"):
        SamplingParams.from_dict([1])
