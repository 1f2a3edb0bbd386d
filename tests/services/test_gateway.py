"""The HTTP gateway, through the official `openai` client, in front of a real `weir serve`.

The engine is the tiny random Llama with a 32-token step budget and a small KV cache,
as in test_serving.py; the gateway is the one `weir serve` starts (`--http-port 0`).
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest
import torch
import transformers
from serving_helpers import hf_greedy, metric, read_metrics, stop_the_replacement
from transformers.convert_slow_tokenizer import bytes_to_unicode

from weir.services.cli import main
from weir.services.launcher import GatewayProcess, ServerProcesses
from weir.shared.client import WeirClient
from weir.shared.config import EngineArgs
from weir.shared.sampling import SamplingParams
from weir.shared.tokenizer import Tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 48
MAX_MODEL_LEN = 64
KV_BYTES = NUM_BLOCKS * 2 * 2 * BLOCK_SIZE * 2 * 8 * 4
# The name the API answers to (--served-model-name), not the directory's, tiny-llama.
MODEL = "tiny-served"
# Another name it answers to (vLLM's --served-model-name takes several).
ALIAS = "org/tiny-alias"
# A web page allowed to call the API (--allowed-origins, passed on by `weir serve`).
ORIGIN = "https://app.example"


def _engine(model_dir) -> EngineArgs:
    return EngineArgs(
        model=str(model_dir),
        max_num_batched_tokens=32,
        block_size=BLOCK_SIZE,
        kv_cache_memory=KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        device="cpu",
        served_model_name=(MODEL, ALIAS),
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcesses(
        _engine(tiny_model_dir),
        port=0,
        metrics_port=0,
        executor_metrics_port=0,
        http_port=0,
        allowed_origins=[ORIGIN, "https://other.example"],
    ) as processes:
        yield processes
        with WeirClient(processes.client_address) as client:
            health = client.health()
        assert health["num_free_blocks"] == health["num_blocks"] and health["num_streams"] == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")


def _sdk_greedy(server, prompt, max_tokens: int) -> tuple[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with WeirClient(server.client_address) as sdk:
        outs = list(sdk.generate(prompt, params))
    return "".join(o.text for o in outs), [t for o in outs for t in o.new_token_ids]


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    base = server.info["http_address"]
    with urllib.request.urlopen(base + "/v1/models/", timeout=10) as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == [MODEL, ALIAS]
    for path, key in (("/version", "version"), ("/health", "status")):
        with urllib.request.urlopen(base + path, timeout=10) as resp:
            assert resp.status == 200 and key in resp.read().decode()
    # FastAPI's pages and schema (test_vllm_serve_flags.py: --disable-fastapi-docs), and no
    # X-Request-Id header unasked (--enable-request-id-headers).
    for path in ("/docs", "/redoc", "/openapi.json"):
        with urllib.request.urlopen(base + path, timeout=10) as resp:
            assert resp.status == 200 and "x-request-id" not in resp.headers


def test_completion_greedy_equals_the_sdk_path_token_for_token(server, client):
    text, ids = _sdk_greedy(server, "The quick brown fox", 10)
    whole = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
        logprobs=0,
    )
    choice = whole.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == len(ids) == 10
    with WeirClient(server.client_address) as sdk:
        tokens = [
            t
            for o in sdk.generate(
                "The quick brown fox",
                SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0),
            )
            for t in o.logprobs["tokens"]
        ]
    assert [row[0] for row in tokens] == choice.logprobs.tokens
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, client, chat):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk of text
    carries its choice's tokens so far, which add up to the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=MODEL, max_tokens=10, temperature=0, stream=True, stream_options=options)
    if chat:
        messages = [{"role": "user", "content": "Count."}]
        chunks = list(client.chat.completions.create(messages=messages, n=2, **common))
        roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
        assert [c.choices[0].index for c in roles] == [0, 1]  # each choice's role chunk
        assert all(c.usage.completion_tokens == 0 for c in roles)
        chunks = [c for c in chunks if c.choices and c.choices[0].index == 0 or not c.choices]
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    else:
        chunks = list(client.completions.create(prompt="The quick brown fox", **common))
        texts = [c.choices[0].text for c in chunks if c.choices]
    final = chunks[-1].usage
    with_choices = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_choices]
    choices = 2 if chat else 1  # the final usage counts every choice's tokens
    assert counts == sorted(counts) and counts[-1] * choices == final.completion_tokens
    assert all(c.usage.prompt_tokens == final.prompt_tokens for c in with_choices)
    assert all(
        c.usage.total_tokens == final.prompt_tokens + n for c, n in zip(with_choices, counts)
    )
    assert len([t for t in texts if t]) > 1  # several chunks, each with its own count


def test_token_id_prompts_and_batches(server, client):
    text, _ = _sdk_greedy(server, [5, 6, 7, 8], 4)
    batch = client.completions.create(
        model=MODEL,
        prompt=[[5, 6, 7, 8], [9, 10]],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text
    assert batch.usage.prompt_tokens == 6 and batch.usage.completion_tokens == 8


def test_chat_whole_and_streamed(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text, _ = _sdk_greedy(server, messages, 6)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_with_seeds_reproduce_share_the_prompt_blocks_and_report_them(server, client):
    prompt = list(range(100, 140))  # 10 full blocks
    before = read_metrics(server.info["metrics_address"])
    kwargs = dict(
        model=MODEL,
        prompt=[prompt],
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        n=3,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    after = read_metrics(server.info["metrics_address"])
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1, "each sample draws from its own seed"
    # Up to OpenAI's 128 choices of one prompt (n was held to 16).
    many = client.completions.create(**{**kwargs, "n": 128, "max_tokens": 1})
    assert [c.index for c in many.choices] == list(range(128))
    assert first.usage.prompt_tokens == 40 and first.usage.completion_tokens == 24
    # The prompt's tokens found in the prefix cache (of the first sample of each prompt):
    # none the first time; the second time, all but the last block (one token is computed).
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 36
    # Samples 2 and 3 of each call (and all of the second call) hit the prompt's cached blocks.
    hits = metric(after, "weir_prefix_cache_hit_tokens_total") - metric(
        before, "weir_prefix_cache_hit_tokens_total"
    )
    assert hits >= 5 * 36


def test_n_samples_queue_together_before_later_requests(tiny_model_dir):
    """One request runs at a time: a request of n=3, then another, queued while the engine
    is paused: all three choices start before the later request (vLLM queues a request's n
    choices at its arrival), although choices 1 and 2 are sent only once choice 0 began
    (so that they find its prompt cached)."""
    engine = dataclasses.replace(_engine(tiny_model_dir), max_num_seqs=1)
    started: list[str] = []

    async def stream(client, name: str, n: int = 1) -> None:
        chunks = await client.completions.create(
            model=MODEL,
            prompt=[list(range(100, 108))],
            max_tokens=50,  # choice 0 runs long enough for 1 and 2 to be sent meanwhile
            temperature=0,
            n=n,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                label = f"{name}{choice.index}"
                if label not in started:
                    started.append(label)

    async def order(http: str, metrics: str) -> list[str]:
        waiting = f'weir_num_requests_waiting{{model_name="{MODEL}"}}'
        async with openai.AsyncOpenAI(base_url=http + "/v1", api_key="unused") as client:
            assert httpx.post(http + "/pause", params={"mode": "keep"}).status_code == 200
            asked = asyncio.create_task(stream(client, "X", n=3))
            while read_metrics(metrics).get(waiting) != 1:
                await asyncio.sleep(0.01)
            later = asyncio.create_task(stream(client, "Z"))
            while read_metrics(metrics).get(waiting) != 2:
                await asyncio.sleep(0.01)
            assert httpx.post(http + "/resume").status_code == 200
            await asyncio.gather(asked, later)
        return started

    with ServerProcesses(
        engine, port=0, metrics_port=0, executor_metrics_port=0, http_port=0
    ) as processes:
        info = processes.info
        first = asyncio.run(order(info["http_address"], info["metrics_address"]))
    assert first[0] == "X0" and sorted(first[1:3]) == ["X1", "X2"] and first[3] == "Z0", first


def test_stop_strings_end_the_text(server, client):
    text, _ = _sdk_greedy(server, "Once upon a time", 12)
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    out = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stop=[stop, "zzzz"],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].stop_reason == stop  # vLLM's field: which stop ended it


def test_logprobs_in_both_apis(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 and x <= 0 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    for asked in (0, 1):  # the sampled token is in its row, even outside the top `asked`
        hot = (
            client.completions.create(
                model=MODEL,
                prompt="Hello",
                max_tokens=8,
                logprobs=asked,
                temperature=2.0,
                seed=7,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .logprobs
        )
        for token, x, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs):
            assert top[token] == x and len(top) <= asked + 1 and next(iter(top)) == token
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"priority": 1}}, "--policy priority"),  # this engine is FCFS
        ({"extra_body": {"priority": 2**31}}, "priority"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"100000000": 1}}, "vocabulary"),
        ({"logit_bias": {"5": 1, "05": 2}}, "token id 5 is given twice"),
        ({"temperature": -1}, "temperature"),
        ({"seed": 2**64}, "seed"),  # vLLM's int64 (was wrapped: the seed of 0)
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": "word " * 80}, "too long"),
        ({"prompt": [[5, 10**9]]}, "vocabulary"),
        ({"prompt": [[5, 6], [7, 10**9]]}, "prompt[1]: prompt[1]: token id 1000000000"),
        ({"extra_body": {"min_tokens": 5}, "max_tokens": 2}, "min_tokens"),
        ({"prompt": ["Hi"] * 65, "n": 2}, "choices"),
        ({"n": 129}, "1 prompt(s) x n=129 is more than 128 choices"),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": ["  "]}}, "bad_words"),
        ({"extra_body": {"bad_words": [" ".join(map(str, range(60)))]}}, "at most 32"),
        ({"extra_body": {"allowed_token_ids": [5, 10**8]}}, "vocabulary"),
        # More than the engine's protocol carries: a 400 at once (was a 500 after 15 s). The
        # flat list's twin is sent by test_valid_json_the_engine_cannot_take_is_a_4xx_not_a_500:
        # the openai client spends 15 s walking a million ids before it sends them.
        ({"prompt": [[1] * (2**20 + 1)]}, "1048577 items"),
    ],
)
def test_bad_requests_are_400_naming_the_problem(client, kwargs, fragment):
    call = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**call)
    assert error.value.status_code == 400 and fragment in str(error.value)


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("completions", '{"prompt": "hi \\ud800"}', 400, "surrogate"),
        ("completions", '{"prompt": "hi", "stop": "\\udfff"}', 400, "surrogate"),
        ("chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surr"),
        # A token id past int32 is refused at its place (the SDK would refuse one past 64
        # bits as msgpack cannot carry it).
        (
            "completions",
            '{"prompt": [18446744073709551616]}',
            400,
            "prompt.0: Input should be less",
        ),
        (
            "completions",
            '{"prompt": [[1' + "0" * 30 + "]]}",
            400,
            "prompt.0.0: Input should be less",
        ),
        ("completions", '{"prompt": "hi", "model": "\\ud800"}', 404, "does not exist"),
        ("completions", '{"prompt": [' + "1," * 2**20 + "1]}", 400, "1048577 items"),
    ],
)
def test_valid_json_the_engine_cannot_take_is_a_4xx_not_a_500(server, path, body, status, fragment):
    """JSON may hold lone surrogates (not Unicode) and integers of any size (msgpack's are
    64-bit): the caller gets OpenAI's error body, the server serves on."""
    body = body[:-1] + f', "model": "{MODEL}", "max_tokens": 2}}' if "model" not in body else body
    reply = httpx.post(
        f"{server.info['http_address']}/v1/{path}",
        content=body.encode(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert fragment in error["message"] and error["type"].endswith("_error")
    again = httpx.post(
        f"{server.info['http_address']}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert again.status_code == 200


def test_bodies_and_routes_http_refuses_get_openai_error_bodies(server):
    base = server.info["http_address"]
    headers = {"Content-Type": "application/json"}
    not_utf8 = httpx.post(base + "/v1/completions", content=b'{"prompt": "\xe9"}', headers=headers)
    unknown = httpx.get(base + "/v1/nowhere")
    wrong_method = httpx.get(base + "/v1/completions")
    for reply, status in ((not_utf8, 400), (unknown, 404), (wrong_method, 405)):
        assert reply.status_code == status
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}, reply.text
    assert wrong_method.headers["allow"] == "POST"  # RFC 9110's, which the 405 had lost
    # JSON sent as another type (curl -d's default) is told so; /invocations as the others.
    for route in ("/v1/completions", "/invocations"):
        for sent in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
            reply = httpx.post(base + route, content=b'{"prompt": "hi"}', headers=sent)
            message = reply.json()["error"]["message"]
            assert reply.status_code == 400 and "Content-Type: application/json" in message
    # Arrays nested past Python's recursion limit (json.loads raises RecursionError).
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    for route in ("/v1/completions", "/invocations"):
        reply = httpx.post(base + route, content=deep, headers=headers)
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_request_error", reply.text
    not_json = httpx.post(base + "/v1/completions", content=b'{"prompt": ', headers=headers)
    assert not_json.json()["error"]["message"].startswith("the body is not valid JSON: ")
    # As OpenAI's: `param` names the field at fault.
    bad_field = httpx.post(
        base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": "x"}
    )
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "max_tokens"


def test_the_largest_seed_with_n_samples_is_taken(client):
    call = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "seed": 2**63 - 1}
    first, second = client.completions.create(**call), client.completions.create(**call)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_the_end_token_in_stop_token_ids_under_ignore_eos_is_the_stop_reason(server, client):
    """As in vLLM: under ignore_eos only stop_token_ids stop a request, so the end token
    listed there stops it as a stop id (after min_tokens), and stop_reason names it (the
    end token's own stop has none)."""
    with WeirClient(server.client_address) as sdk:
        eos = sdk.model_info()["eos_token_id"]
    call = {
        "model": MODEL,
        "prompt": [7, 8, 9],
        "max_tokens": 12,
        "temperature": 0,
        "logit_bias": {str(eos): 100},  # the end token, whenever it may be sampled
        "extra_body": {
            "stop_token_ids": [eos],
            "ignore_eos": True,
            "min_tokens": 3,
            "return_token_ids": True,
        },
    }
    choice = client.completions.create(**call).choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == eos
    tokens = choice.model_extra["token_ids"]
    assert len(tokens) == 4 and eos not in tokens[:3] and tokens[3] == eos


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_ends_the_text_without_its_own_text(server, client, stream):
    """As in vLLM: the token in stop_token_ids that ended the request is counted but its text
    is not returned. The reference is the SDK's greedy tokens with the stop left out."""
    prompt = [7, 8, 9]
    text, tokens = _sdk_greedy(server, prompt, 12)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    reference, _ = _sdk_greedy(server, prompt, k)
    call = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"stop_token_ids": [tokens[k]], "ignore_eos": True},
    }
    if stream:
        chunks = list(
            client.completions.create(**call, stream=True, stream_options={"include_usage": True})
        )
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c.choices[0] for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        reply = client.completions.create(**call)
        got, last, usage = reply.choices[0].text, reply.choices[0], reply.usage
    assert last.finish_reason == "stop" and usage.completion_tokens == k + 1
    assert last.stop_reason == tokens[k]  # vLLM's field: the stop token's id
    assert got == reference and text.startswith(reference)


def test_bad_chat_parameters_are_400(client):
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"min_tokens": 5},
        )


def test_images_for_a_model_of_text_only_are_400(client):
    """A PNG of one pixel, as a data URL, to a model that reads no images."""
    pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + pixel}}
    with pytest.raises(openai.BadRequestError, match="this model takes no images"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "x"}]}],
            max_tokens=2,
        )


@pytest.mark.parametrize("role", ["hacker", ""])
def test_unknown_chat_roles_are_400(client, role):
    with pytest.raises(openai.BadRequestError, match="role") as error:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "x"}], max_tokens=2
        )
    assert error.value.status_code == 400


def test_max_tokens_beyond_the_context_is_400_naming_the_numbers(client):
    # "Hello" is 1 token: 1 + 64 > max_model_len 64, as vLLM refuses.
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=MAX_MODEL_LEN)
    message = str(error.value)
    assert "maximum context length is 64" in message and "at most 63" in message
    with pytest.raises(openai.BadRequestError, match="max_tokens is too large"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10_000
        )


def test_without_max_tokens_a_request_runs_to_the_context_length(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN
    text = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=None, extra_body={"ignore_eos": True}
    )
    assert text.usage.completion_tokens == MAX_MODEL_LEN - text.usage.prompt_tokens


def test_a_denormal_temperature_samples_greedily(client):
    call = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(temperature=0, **call)
    tiny = client.completions.create(temperature=1e-45, **call)
    assert tiny.choices[0].text == greedy.choices[0].text


def test_an_oversized_body_is_413_and_the_gateway_serves_on(server, client):
    url = server.info["http_address"] + "/v1/completions"
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (64 << 20) + b'"}'
    declared = httpx.post(url, content=big, timeout=60)

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    streamed = httpx.post(url, content=chunks(), timeout=60)
    # Small in bytes, but a million lists for Python to build (20M held the loop 6.8 s).
    nested = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "metadata": {"k": []}}
    lists = json.dumps(nested).replace("[]", "[" + ",".join(["[]"] * 1_000_001) + "]")
    many = httpx.post(url, content=lists, headers={"Content-Type": "application/json"})
    for reply in (declared, streamed, many):
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large"
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_a_clients_request_id_names_the_response_as_vllms(client):
    """vLLM's: the X-Request-Id header, else the body's request_id, after the response id's
    prefix; two requests of one id at once both run."""
    call = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    by_header = client.completions.create(**call, extra_headers={"X-Request-Id": "job-7"})
    assert by_header.id == "cmpl-job-7"
    both = client.completions.create(
        **call, extra_headers={"X-Request-Id": "job-8"}, extra_body={"request_id": "body-8"}
    )
    assert both.id == "cmpl-job-8"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        stream=True,
        extra_body={"request_id": "chat-9"},
    )
    assert {chunk.id for chunk in chat} == {"chatcmpl-chat-9"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = [
            pool.submit(client.completions.create, **call, extra_body={"request_id": "twice"})
            for _ in range(2)
        ]
        assert [f.result().id for f in same] == ["cmpl-twice"] * 2
    for bad in ("with space", "x" * 201):
        with pytest.raises(openai.BadRequestError, match="must be 1-200 printable"):
            client.completions.create(**call, extra_body={"request_id": bad})


def test_a_fault_of_the_gateways_own_is_a_500_with_its_traceback_logged(caplog):
    """A bug (not a client's error, nor the engine's) tells the operator where it is."""
    from weir.services.gateway.app import _api_error

    try:
        {}["missing"]
    except KeyError as exc:
        error = _api_error(exc)
    assert error.status == 500
    assert "request failed in the gateway: KeyError('missing')" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text and '{}["missing"]' in caplog.text


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_the_served_model_name_is_the_one_answered_to_and_reported(server, client):
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert reply.model == MODEL
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
    )
    assert {chunk.model for chunk in chat} == {MODEL}
    # vLLM's: every name answers, and a reply names the model as it was asked for.
    assert client.completions.create(model=ALIAS, prompt="Hi", max_tokens=2).model == ALIAS
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError, match=f"`{MODEL}`, `{ALIAS}`"):
        client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2)
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.models.retrieve("tiny-llama")
    # The dashboard selects both processes' series by this one label.
    for address in (server.info["metrics_address"], server.info["executors"][0]["metrics_address"]):
        samples = read_metrics(address)
        assert any(f'model_name="{MODEL}"' in key for key in samples)
        assert not any('model_name="tiny-llama"' in key or ALIAS in key for key in samples)


def test_null_is_the_default_and_neutral_values_of_unsupported_fields_are_ignored(client):
    """As vLLM: clients and frameworks send null for "unset", and the neutral values of
    fields Weir does not implement; the output is the one without them."""
    call = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    reference = client.completions.create(**call).choices[0].text
    neutral = client.completions.create(
        **call,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=0,
        echo=False,
        best_of=1,
        logit_bias={},
        suffix=None,
        stream=None,
        user=None,
        extra_body={
            "top_k": None,
            "min_p": None,
            "min_tokens": None,
            "ignore_eos": None,
            "priority": None,
            "repetition_penalty": 1.0,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False,
            "store": True,
            "metadata": {"run": "7"},
            "service_tier": "auto",
            "prompt_cache_key": "session-7",
            "prompt_cache_retention": "24h",
            "safety_identifier": "user-7",
        },
    )
    assert neutral.choices[0].text == reference
    messages = [{"role": "user", "content": "Hi"}]
    reference = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        top_p=None,
        logprobs=None,
        response_format={"type": "text"},
        tool_choice="none",
        tools=[],
        parallel_tool_calls=False,
        stream=True,
        stream_options={
            "include_usage": None,
            "continuous_usage_stats": False,
            "include_obfuscation": True,
        },
        extra_body={"add_generation_prompt": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == reference.choices[0].message.content


def test_penalties_and_logit_bias_over_http_match_transformers(
    client, tiny_model_dir, tiny_hf_model
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [17, 900, 3, 44, 5021, 8]
    bias = dict.fromkeys(range(7, 11), 5.0)
    want = hf_greedy(
        tiny_hf_model, prompt, 10, presence=0.5, frequency=0.7, repetition=1.3, logit_bias=bias
    )
    assert want != hf_greedy(tiny_hf_model, prompt, 10, logit_bias=bias)
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert completion.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_allowed_token_ids_hold_the_output_to_them_and_logprobs_stay_the_models(
    client, tiny_hf_model
):
    """vLLM's allowed_token_ids: greedy picks the likeliest allowed token (transformers'
    logits with the others masked), a sampled output holds allowed tokens only, and the
    logprobs returned are the model's own over the whole vocabulary."""
    prompt = [17, 900, 3, 44, 5021, 8]
    allowed = [7, 8, 9, 10, 300, 301, 5021]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = tiny_hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(logits[allowed].argmax())])
        raw = torch.log_softmax(tiny_hf_model(torch.tensor([ids])).logits[0].double(), -1)
    want = ids[len(prompt) :]
    assert want != hf_greedy(tiny_hf_model, prompt, 8), "the mask must matter"
    body = {"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True}
    call = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "extra_body": body}
    greedy = client.completions.create(**call, temperature=0, logprobs=1).choices[0]
    assert greedy.model_dump()["token_ids"] == want
    expected = [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(want)]
    assert greedy.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    sampled = client.completions.create(**call, temperature=1.5, seed=3, n=4)
    for choice in sampled.choices:
        assert set(choice.model_dump()["token_ids"]) <= set(allowed)


def test_bad_words_are_never_written_as_vllm_tokenizes_them(client, tiny_model_dir, tiny_hf_model):
    """vLLM's bad_words: each text tokenized alone and after a space (where that gives as
    many tokens, starting otherwise), its last token banned after the rest."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [17, 900, 3, 44, 5021, 8]
    plain = hf_greedy(tiny_hf_model, prompt, 12)
    words = [tokenizer.decode(plain[2:4]), tokenizer.decode(plain[7:8]).strip()]
    sequences = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    want = hf_greedy(tiny_hf_model, prompt, 12, bad_words=sequences)
    assert want != plain, "the bad words must matter"
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"bad_words": words, "ignore_eos": True, "return_token_ids": True},
    )
    assert completion.choices[0].model_dump()["token_ids"] == want


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(
    client, tiny_hf_model, tiny_model_dir
):
    """lm-eval's loglikelihood over the completions API: echo, logprobs and one new token;
    it sums ``token_logprobs`` over the continuation and checks each is the top one."""
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    # An emoji's bytes split across tokens: the echo is the prompt's text decoded whole
    # (vLLM's), where the tokens' own texts have only replacement characters for it.
    prompt = [17, 900, 3, 44, 5021, 8, 8, *hf_tokenizer.encode(" 😀 日本語")]
    call = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    plain = client.completions.create(**call, extra_body={"ignore_eos": True})
    echoed = client.completions.create(
        **call, echo=True, logprobs=1, extra_body={"ignore_eos": True}
    )
    [choice] = echoed.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([prompt])).logits[0].double(), -1)
    want = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(prompt)):
        top = ref[i - 1].argmax().item() == prompt[i]
        assert (lp.token_logprobs[i] == max(lp.top_logprobs[i].values())) == top
    # vLLM's texts of the tokens: a part of a character has none, the token that completes
    # it has the whole character.
    assert "".join(lp.tokens[: len(prompt)]) == hf_tokenizer.decode(prompt)
    assert choice.text == hf_tokenizer.decode(prompt) + plain.choices[0].text
    assert lp.text_offset[len(prompt)] == len("".join(lp.tokens[: len(prompt)]))
    assert echoed.usage.prompt_tokens == len(prompt)
    streamed = client.completions.create(
        **call, echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == (
        lp.tokens
    )
    # max_tokens 0 with echo (OpenAI's, vLLM's): the prompt and its logprobs alone.
    for stream in (False, True):
        reply = client.completions.create(
            **{**call, "max_tokens": 0}, echo=True, logprobs=1, stream=stream
        )
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == hf_tokenizer.decode(prompt)
        assert [
            t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
        ] == lp.tokens[: len(prompt)]
        assert chunks[-1].choices[0].finish_reason == "length"
    only = client.completions.create(**{**call, "max_tokens": 0}, echo=True, logprobs=1)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (len(prompt), 0)


def test_prompt_logprobs_are_vllms_with_each_tokens_rank(client, tiny_hf_model):
    """vLLM's ``prompt_logprobs`` (completions: each choice's; chat: the response's): per
    prompt token after the first, its logprob and its rank in the distribution that
    predicts it, then the n likeliest; transformers' log-softmax is the reference."""
    prompt = [17, 900, 3, 44, 5021, 8, 8]
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    rows = reply.choices[0].prompt_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([prompt])).logits[0].double(), -1)
    assert rows[0] is None and len(rows) == len(prompt)
    for i in range(1, len(prompt)):
        entry, row = rows[i], ref[i - 1]
        mine = entry[str(prompt[i])]
        assert mine["logprob"] == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
        assert set(entry) == {str(prompt[i]), *map(str, top)}
    assert any(row["rank"] > 2 for entry in rows[1:] for row in entry.values())
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    ranked = chat.model_extra["prompt_logprobs"]
    assert ranked[0] is None and all(len(entry) == 1 for entry in ranked[1:])
    for bad in ({"stream": True}, {"echo": True}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs: comes in a whole"):
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1, **bad}
            )


def test_logprobs_of_the_parts_of_a_character_rebuild_its_text(client, tiny_model_dir):
    """Katakana, two byte-level tokens a character: as vLLM corrects a token's text (with
    the sampled or prompt tokens before it), a part of a character has none and the token
    that completes it has the whole character. A chat's ``bytes`` are each token's own, as
    OpenAI's: transformers' vocabulary entry read through GPT-2's byte table, laid end to end
    the text's UTF-8. A completion's top_logprobs keep the sampled token's own logprob (an
    alternative of the same text does not replace it), and its streamed text offsets are
    the whole response's, while a stop string holds the text back."""
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    word = "ケッ"
    ids = hf_tokenizer.encode(word)
    assert len(ids) == 4 and all(hf_tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    added = [
        hf_tokenizer.decode(ids[: i + 1]).rstrip("\ufffd")[
            len(hf_tokenizer.decode(ids[:i]).rstrip("\ufffd")) :
        ]
        for i in range(len(ids))
    ]
    assert added == ["", "ケ", "", "ッ"]
    own_bytes = [[byte_of[c] for c in entry] for entry in hf_tokenizer.convert_ids_to_tokens(ids)]
    ends = hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    # The grammar spells the word; the allowed ids spell it only in parts of characters.
    extra = {"guided_choice": [word], "allowed_token_ids": [*ids, *ends], "return_token_ids": True}
    call = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": extra}
    chat = {**call, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    whole = client.chat.completions.create(**chat, top_logprobs=2).choices[0]
    assert whole.message.content == word and whole.model_dump()["token_ids"][:4] == ids
    content = [entry.model_dump() for entry in whole.logprobs.content[:4]]
    assert [entry["token"] for entry in content] == added
    assert [entry["bytes"] for entry in content] == own_bytes
    assert b"".join(bytes(entry["bytes"]) for entry in content) == word.encode()
    streamed = client.chat.completions.create(**chat, top_logprobs=2, stream=True)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [entry.model_dump() for lp in chunks for entry in lp.content][:4] == content
    completion = {**call, "prompt": "Hi", "logprobs": 2, "stop": ["ッッ"]}
    lp = client.completions.create(**completion).choices[0].logprobs
    assert lp.tokens[:4] == added
    assert all(
        top[token] == x for token, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    )
    streamed = [c.choices[0].logprobs for c in client.completions.create(**completion, stream=True)]
    rows = [row for part in streamed if part for row in zip(part.tokens, part.text_offset)]
    assert rows == list(zip(lp.tokens, lp.text_offset))
    assert lp.text_offset[:4] == [0, 0, 1, 1]
    # vLLM's prompt_logprobs: each prompt token's decoded_token, corrected the same way.
    prompt = [*hf_tokenizer.encode("Hi "), *ids]
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    decoded = [
        entry[str(t)]["decoded_token"]
        for entry, t in zip(reply.choices[0].prompt_logprobs[1:], prompt[1:])
    ]
    assert "".join(decoded) == hf_tokenizer.decode(prompt)[len(hf_tokenizer.decode(prompt[:1])) :]
    assert decoded[-4:] == added


def test_echo_of_text_prompts_prepends_each_prompt_to_each_choice(client):
    prompts = ["The quick brown fox", "One, two,"]
    call = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0, "n": 2}
    plain = client.completions.create(**call)
    echoed = client.completions.create(**call, echo=True)
    assert [c.text for c in echoed.choices] == [
        prompts[c.index // 2] + c.text for c in plain.choices
    ]
    assert echoed.usage == plain.usage
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert client.chat.completions.create(**chat, extra_body={"echo": False}).choices
    with pytest.raises(openai.BadRequestError, match="echo: only false is supported"):
        client.chat.completions.create(**chat, extra_body={"echo": True})


def test_stop_text_and_special_tokens_are_returned_when_asked(
    client, tiny_model_dir, tiny_hf_model
):
    """vLLM's include_stop_str_in_output and skip_special_tokens, against the reference's
    tokens decoded by transformers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [17, 900, 3, 44, 5021, 8]
    ref = hf_greedy(tiny_hf_model, prompt, 12)
    assert ref[6] not in ref[:6]
    text = tokenizer.decode(ref)
    stop = tokenizer.decode(ref[8:10])
    assert stop.strip() and text.count(stop) == 1
    call = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    for include in (False, True):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        by_token = client.completions.create(
            **call, extra_body={**extra, "stop_token_ids": [ref[6]]}
        )
        assert by_token.choices[0].text == tokenizer.decode(ref[: 7 if include else 6])
        by_text = client.completions.create(**call, stop=[stop], extra_body=extra)
        end = text.index(stop) + (len(stop) if include else 0)
        assert by_text.choices[0].text == text[:end]
    special = {**call, "max_tokens": 3, "logit_bias": {"1": 100}}  # <|im_start|>
    assert client.completions.create(**special).choices[0].text == ""
    shown = client.completions.create(**special, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3


def test_structured_outputs_in_each_of_their_api_forms(client, server, tiny_model_dir, capsys):
    """OpenAI's response_format, vLLM's structured_outputs and its guided_* fields (the
    tiny model's random weights would write anything: only the constraint shapes it)."""
    call = {"model": MODEL, "prompt": "Answer:", "max_tokens": 20, "temperature": 0}
    colours = ["red apple", "green pear"]
    usages = []
    for extra in (
        {"guided_choice": colours},
        {"structured_outputs": {"choice": colours}},
        # min_tokens does not outlast the format: the request ends on its end token.
        {"guided_choice": colours, "min_tokens": 15},
        # Nor ignore_eos (its end token, complete, is the last the format allows).
        {"guided_choice": colours, "ignore_eos": True},
        # vLLM's StructuredOutputsParams sent whole: its unset fields null, its options.
        {
            "structured_outputs": {
                "choice": colours,
                "regex": None,
                "json": None,
                "disable_any_whitespace": None,
                "disable_fallback": False,
                "disable_additional_properties": True,
                "whitespace_pattern": None,
            }
        },
    ):
        completion = client.completions.create(**call, extra_body=extra)
        [choice] = completion.choices
        assert choice.text in colours and choice.finish_reason == "stop"
        usages.append(completion.usage.completion_tokens)
    assert len(set(usages)) == 1
    # Logprobs are taken after the format's mask, as vLLM's: the likeliest first tokens are
    # ones that begin a choice, the rest ruled out (-9999.0, vLLM's stand-in for -inf).
    scored = client.completions.create(**call, logprobs=5, extra_body={"guided_choice": colours})
    first = scored.choices[0].logprobs.top_logprobs[0]
    assert any(lp > -9999.0 for lp in first.values())
    assert all(lp == -9999.0 or any(c.startswith(t) for c in colours) for t, lp in first.items())
    # allowed_token_ids hold with the choice's mask: only "green pear"'s tokens (and the
    # special ones, the end among them) are allowed, so every sample is that choice whole.
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    allowed = [*tokenizer.encode("green pear"), *range(17)]
    sampled = client.completions.create(
        **{**call, "temperature": 1.0},
        n=6,
        seed=4,
        extra_body={"guided_choice": colours, "allowed_token_ids": allowed},
    )
    assert [c.text for c in sampled.choices] == ["green pear"] * 6
    # Where the two leave no token: refused if none can begin the choice; cut short (abort,
    # not stop: the output is not one the format accepts) where none can go on with it.
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids: none of them can"):
        client.completions.create(
            **call, extra_body={"guided_choice": colours, "allowed_token_ids": [100, 101]}
        )
    red, *_ = tokenizer.encode("red apple")
    [cut] = client.completions.create(
        **call, extra_body={"guided_choice": colours, "allowed_token_ids": [red]}
    ).choices
    assert cut.finish_reason == "abort" and "red apple".startswith(cut.text), cut
    regex = r"(yes|no), [0-9]{3}"
    [choice] = client.completions.create(**call, extra_body={"guided_regex": regex}).choices
    assert re.fullmatch(regex, choice.text), choice.text
    schema = {"enum": ["alpha", "beta"]}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick one."}],
        max_tokens=20,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
    )
    assert json.loads(chat.choices[0].message.content) in schema["enum"]
    compact = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    [choice] = client.completions.create(**call, extra_body=compact).choices
    assert json.loads(choice.text) in schema["enum"] and choice.text == choice.text.strip()
    for extra, fragment in (
        ({"guided_regex": "(", "guided_choice": colours}, "not guided_regex and guided_choice"),
        ({"guided_regex": "("}, "structured_output.regex: cannot compile it"),
        ({"structured_outputs": {"xml": "<a/>"}}, "unknown key 'xml'"),
        (
            {"structured_outputs": {"json": schema, "whitespace_pattern": " "}},
            "structured_output.whitespace_pattern is not supported",
        ),
        # A schema whose keyword xgrammar would drop (the output then breaking it).
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "s",
                        "schema": {"type": "string", "pattern": "[a-z]+", "maxLength": 3},
                    },
                }
            },
            "'minLength'/'maxLength' beside 'pattern' (at /) is not supported",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "got regex and choice"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ):
        with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
            client.completions.create(**call, extra_body=extra)
    assert client.completions.create(**call).choices  # still serving
    # And from the command line, over the SDK.
    assert (
        main(
            ["generate", "--address", server.client_address, "Pick:", "--max-tokens", "20"]
            + ["--choice", "red apple", "--choice", "green pear"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() in colours


_FORECAST = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _is_forecast(text: str) -> bool:
    value = json.loads(text)
    return (
        value.keys() == {"city", "days"}
        and value["city"] in ("Paris", "Rome")
        and type(value["days"]) is int
        and 1 <= value["days"] <= 7
    )


def test_structural_tags_in_both_forms(client, server, tiny_model_dir):
    """vLLM's structural_tag (xgrammar's): xgrammar's format, here a tag around JSON of a
    schema, is the whole output; the first form leaves text free until a trigger, after
    which the structure it begins is written whole (a logit bias makes the random model
    write the trigger, a single token, whenever the text is free)."""
    call = {"model": MODEL, "prompt": "Forecast:", "max_tokens": 60, "temperature": 0}
    tagged = {
        "type": "tag",
        "begin": "<forecast>",
        "content": {"type": "json_schema", "json_schema": _FORECAST},
        "end": "</forecast>",
    }
    # Without free whitespace in the JSON: the random model would write it to max_tokens.
    compact = {"disable_any_whitespace": True}
    for extra in (
        {
            "response_format": {"type": "structural_tag", "format": tagged},
            "structured_outputs": compact,
        },
        {
            "structured_outputs": {
                "structural_tag": {"type": "structural_tag", "format": tagged},
                **compact,
            }
        },
        {"structured_outputs": {"structural_tag": json.dumps({"format": tagged}), **compact}},
    ):
        [choice] = client.completions.create(**call, extra_body=extra).choices
        match = re.fullmatch(r"<forecast>(.*)</forecast>", choice.text, re.DOTALL)
        assert match and _is_forecast(match.group(1)), choice.text
        assert choice.finish_reason == "stop"
    [trigger] = Tokenizer.from_model_dir(tiny_model_dir).encode(" the")
    structures = [{"begin": " the forecast:", "schema": _FORECAST, "end": ";"}]
    bias = {"logit_bias": {str(trigger): 100}}
    first_form = {"structures": structures, "triggers": [" the"]}
    for extra in (
        {
            "response_format": {"type": "structural_tag", **first_form},
            "structured_outputs": compact,
        },
        {"structured_outputs": {"structural_tag": first_form, **compact}},
    ):
        [choice] = client.completions.create(**call, **bias, extra_body=extra).choices
        written = re.findall(r" the forecast:(.*?);", choice.text, re.DOTALL)
        assert written and all(map(_is_forecast, written)), choice.text
        assert choice.text.startswith(" the forecast:{")  # the trigger, then the structure
    for extra, fragment in (
        ({"response_format": {"type": "structural_tag"}}, "structures"),
        (
            {"response_format": {"type": "json_object", "format": tagged}},
            'given with type "structural_tag"',
        ),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
            "Format type not recognized: nope",
        ),
        (
            {
                "structured_outputs": {
                    "structural_tag": {"structures": structures, "triggers": ["<"]}
                }
            },
            "no trigger begins the structure ' the forecast:'",
        ),
        (
            {
                "structured_outputs": {
                    "structural_tag": {
                        "format": {
                            **tagged,
                            "content": {
                                "type": "json_schema",
                                "json_schema": {"type": "number", "multipleOf": 0.5},
                            },
                        }
                    }
                }
            },
            "'multipleOf'",
        ),
        ({"structured_outputs": {"structural_tag": "{"}}, "structural_tag is not JSON"),
    ):
        with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
            client.completions.create(**call, extra_body=extra)
    assert client.completions.create(**call).choices  # still serving


def test_structured_outputs_options_shape_a_response_format(server):
    """The body the openai SDK's parse (and langchain's with_structured_output) sends with
    extra_body={"structured_outputs": {"disable_any_whitespace": true}}, vLLM's way to keep a
    weak model from writing whitespace until max_tokens: the options shape the response
    format's JSON (as vLLM sets it into them), whole or sent as vLLM's object with nulls."""
    schema = {
        "type": "object",
        "properties": {"pick": {"enum": ["alpha", "beta"]}},
        "required": ["pick"],
        "additionalProperties": False,
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_completion_tokens": 20,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Pick", "schema": schema, "strict": True},
        },
    }
    url = server.info["http_address"] + "/v1/chat/completions"
    for options in (
        {"disable_any_whitespace": True},
        {"json": None, "disable_any_whitespace": True},
    ):
        reply = httpx.post(url, json={**body, "structured_outputs": options}, timeout=60)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"]
        # xgrammar's JSON without free whitespace: json.dumps' separators, nothing else.
        assert text == json.dumps(json.loads(text)), text
    both = {**body, "structured_outputs": {"regex": "a", "disable_any_whitespace": True}}
    refused = httpx.post(url, json=both, timeout=60)
    assert refused.status_code == 400
    assert "not response_format and structured_outputs" in refused.json()["error"]["message"]


# JSON schemas with a keyword xgrammar drops, a JSON text each breaks (by JSON Schema 2020-12;
# each checked with the jsonschema library), and what the refusal names.
_DROPPED_KEYWORDS = [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"', "'minLength'/'max"),
    (
        {
            "type": "object",
            "properties": {"d": {"type": "string", "format": "date", "maxLength": 4}},
        },
        '{"d": "2024-01-01"}',
        "'minLength'/'maxLength' beside 'format' (at /properties/d)",
    ),
    ({"type": "string", "format": "date", "pattern": "^x"}, '"2024-01-01"', "'pattern' beside"),
    ({"type": "string", "format": "idn-email"}, '"nope"', "format 'idn-email'"),
    ({"type": "number", "multipleOf": 0.5}, "1.3", "'multipleOf'"),
    ({"type": "integer", "multipleOf": 2.5}, "4", "'multipleOf'"),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "[1, 1]",
        "'uniqueItems'",
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}},
        "[1]",
        "'contains'",
    ),
    (
        {
            "$defs": {
                "p": {
                    "type": "object",
                    "properties": {"a": {}, "b": {}},
                    "dependentRequired": {"a": ["b"]},
                }
            },
            "$ref": "#/$defs/p",
        },
        '{"a": 1}',
        "'dependentRequired' (at /$defs/p)",
    ),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "9", "'if' with"),
    (
        {"type": "object", "properties": {"a/b": {"type": "integer", "not": {"const": 3}}}},
        '{"a/b": 3}',
        "'not' (at /properties/a~1b)",
    ),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "9", "'allOf' of more than one schema"),
    ({"type": "integer", "maximum": 5, "allOf": [{"minimum": 3}]}, "1", "beside 'allOf'"),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 1}]}, "3", "'type' beside 'anyOf'"),
    (
        {"$defs": {"i": {"minimum": 2}}, "$ref": "#/$defs/i", "type": "integer"},
        '"a"',
        "beside '$ref'",
    ),
    ({"type": "string", "enum": ["a", 1]}, "1", "'type' beside 'enum'"),
    (
        {
            "type": "object",
            "properties": {"a": {}},
            "required": ["a", "b"],
            "additionalProperties": True,
        },
        '{"a": 1}',
        "'required' naming 'b'",
    ),
    (
        {"type": "array", "items": {"maxLength": 2}},
        '["abc"]',
        "'maxLength' in a schema of no 'type'",
    ),
    ({"anyOf": []}, "", "an empty 'anyOf'"),  # its output: "", not JSON at all
    (  # held as anyOf: 4 meets both
        {
            "type": "object",
            "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        },
        '{"n": 4}',
        "'oneOf' of schemas a value may meet more than one of",
    ),
    (  # a $ref's target outside the keywords that hold schemas (OpenAPI's components)
        {
            "$ref": "#/components/schemas/P",
            "components": {"schemas": {"P": {"type": "integer", "not": {"const": 4}}}},
        },
        "4",
        "'not' (at /components/schemas/P)",
    ),
    (
        {
            "type": "object",
            "properties": {"abcdef": {"type": "integer"}},
            "propertyNames": {"maxLength": 3},
        },
        '{"abcdef": 1}',
        "'propertyNames' that listed property 'abcdef' does not meet",
    ),
    (
        {
            "type": "object",
            "properties": {"a1": {"type": "string"}},
            "patternProperties": {"^a": {"type": "string", "maxLength": 1}},
        },
        '{"a1": "xyz"}',
        "'patternProperties' beside listed properties",
    ),
    (
        {"type": "object", "properties": {"b": {}}, "propertyNames": {"pattern": "^a"}},
        '{"b": 1}',
        "'propertyNames' with a pattern beside listed properties",
    ),
]


@pytest.mark.parametrize("schema, breaking, named", _DROPPED_KEYWORDS)
def test_json_schema_keywords_xgrammar_drops_are_refused(schema, breaking, named):
    """As vLLM's xgrammar backend refuses what xgrammar does not support, rather than
    answer with output the schema does not accept."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from weir.services.engine.json_schema_check import check_json_schema

    text = json.dumps(schema)
    # The reference: xgrammar's own matcher takes the text that breaks the schema.
    assert _is_grammar_accept_string(Grammar.from_json_schema(text), breaking)
    with pytest.raises(ValueError, match=re.escape(named)):
        check_json_schema(text)


def test_a_schemas_patterns_are_never_run_by_the_check():
    """A client's pattern is not searched in Python (its backtracking would hold the
    tokenizer thread for hours on this one: 26 characters took 3.9 s, each one more twice
    as long): a pattern beside listed properties is refused unread. Odd values of any
    keyword are a refusal or the compiler's business, never an internal error."""
    from weir.services.engine.json_schema_check import check_json_schema

    name = "a" * 60 + "!"
    for names in (
        {"patternProperties": {"(a+)+$": {"type": "integer"}}},
        {"propertyNames": {"pattern": "(a+)+$"}},
    ):
        with pytest.raises(ValueError, match="pattern"):
            check_json_schema(json.dumps({"type": "object", "properties": {name: {}}, **names}))
    odd = {"format": {"a": 1}, "oneOf": [{"type": ["string", "null"]}, {"type": "integer"}]}
    with pytest.raises(ValueError, match="'oneOf' of schemas a value may meet"):
        check_json_schema(json.dumps(odd))
    check_json_schema(json.dumps({"type": "string", "minLength": "1", "format": {"x": 1}}))


# Schemas xgrammar holds, and a JSON text each breaks: taken.
_HELD_KEYWORDS = [
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": "string", "pattern": "^[a-z]+$"}, '"ABC"'),
    ({"type": "string", "maxLength": 3}, '"abcd"'),
    ({"type": "string", "format": "date"}, '"x"'),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, '{"a": "x"}'),
    (
        {
            "type": "object",
            "propertyNames": {"pattern": "^a"},
            "additionalProperties": {"type": "integer"},
        },
        '{"b": 1}',
    ),
    ({"type": "string", "enum": ["a", "b"], "title": "E"}, '"c"'),
    ({"const": 1.0, "type": "integer"}, "2"),
    ({"$defs": {"x": {"type": "integer", "maximum": 2}}, "$ref": "#/$defs/x", "title": "X"}, "9"),
    ({"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None}, "-1"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"], "maxProperties": 1}, "{}"),
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 1},
        "[1, 1]",
    ),
    # Data, not schemas: an enum's or a default's objects are not walked.
    ({"enum": [{"not": 1}], "default": {"not": 1}}, '{"not": 2}'),
    # pydantic's: a Literal (2.7-2.9), SecretStr and bytes with lengths (formats the standard
    # does not define assert nothing), AnyUrl (no URI is empty), a discriminated union.
    ({"const": "cat", "enum": ["cat"], "type": "string"}, '"dog"'),
    ({"type": "string", "format": "password", "minLength": 8, "maxLength": 64}, '"short"'),
    ({"type": "string", "format": "uri", "minLength": 1}, '""'),
    ({"type": "integer", "multipleOf": 2.0}, "3"),
    ({"type": ["integer", "null"], "multipleOf": 3}, "4"),
    (
        {
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "$defs": {
                name: {
                    "type": "object",
                    "properties": {"kind": {"const": name.lower(), "type": "string"}},
                    "required": ["kind"],
                }
                for name in ("Cat", "Dog")
            },
        },
        '{"kind": "cow"}',
    ),
]


def test_an_ambiguous_grammar_ends_its_own_request_not_the_servers_pace(server, client):
    """An EBNF rule that matches one text in many ways makes xgrammar's Earley matcher cost
    about the cube of the output's length a token, paid between every two steps of every
    request: its request ends with an error once its tokens cost over 50 ms (minutes of
    every client's steps otherwise), and the others' go on."""
    ambiguous = 'root ::= s\ns ::= s s s | s s | "a" | "b" | ""'
    aaaa = Tokenizer.from_model_dir(server.engine_args.model).encode("aaaa")
    assert len(aaaa) == 1  # the longest token the grammar allows: its cost grows fastest
    call = {"model": MODEL, "prompt": "Hi", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0}
    extra = {"guided_grammar": ambiguous, "allowed_token_ids": aaaa, "ignore_eos": True}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    start = time.monotonic()
    attack = pool.submit(client.completions.create, **call, extra_body=extra)
    time.sleep(1)
    other = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert time.monotonic() - start < 30 and other.choices[0].finish_reason == "length"
    with pytest.raises(openai.APIError, match="ambiguous grammar") as ended:
        attack.result(timeout=120)
    assert time.monotonic() - start < 60, ended.value
    pool.shutdown()


@pytest.mark.parametrize("schema, breaking", _HELD_KEYWORDS)
def test_json_schema_keywords_xgrammar_holds_are_taken(schema, breaking):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from weir.services.engine.json_schema_check import check_json_schema

    text = json.dumps(schema)
    assert not _is_grammar_accept_string(Grammar.from_json_schema(text), breaking)
    check_json_schema(text)


@pytest.mark.parametrize(
    "field, value, supported",
    [
        ("best_of", 2, "1"),
        ("suffix", "!", "null"),
        ("tool_choice", "auto", '"none"'),
    ],
)
def test_a_value_that_would_change_the_output_is_400_naming_the_supported_one(
    server, field, value, supported
):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True, field: value}
    reply = httpx.post(server.info["http_address"] + "/v1/completions", json=body, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == field
    assert error["message"] == f"{field}: only {supported} is supported"


def test_text_parts_are_joined_by_newlines_and_an_assistant_content_may_be_null(server, client):
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Be brief."}]
    conversation = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Go on"},
    ]
    text, _ = _sdk_greedy(
        server,
        [
            {"role": "user", "content": "Name a colour.\nBe brief."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Go on"},
        ],
        6,
    )
    reply = client.chat.completions.create(
        model=MODEL,
        messages=conversation,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == text


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": None}]},
            "messages.1.content",
            "a user message needs a string or text parts",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            "Input should be a string or a list of text and image_url parts",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
            "Field required",
        ),
        ("completions", {"prompt": "Hi", "stop": 5}, "stop", "Input should be a string or a list"),
        ("completions", {"prompt": [[1, "x"]]}, "prompt.0.1", "Input should be a valid integer"),
        (
            "completions",
            {"prompt": "Hi", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed with stream: true",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
            "top_logprobs",
            "requires logprobs: true",
        ),
    ],
)
def test_a_bad_union_field_is_one_problem_at_its_place_in_the_body(
    server, path, body, param, message
):
    """Not pydantic's branch tags ("messages.1.content.str: ...; messages.1.content.list[...]")."""
    url = f"{server.info['http_address']}/v1/{path}"
    reply = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param
    assert error["message"].startswith(f"{param}: {message}") and ";" not in error["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": [-1] * 100_000}, "prompt.0"),
        ("completions", {"prompt": [[1, -1]] * 50_000}, "prompt.0.1"),
        ("completions", {"prompt": "Hi", "stop_token_ids": [-1] * 100_000}, "stop_token_ids.0"),
        ("completions", {"prompt": "Hi", **{f"x{i}": 0 for i in range(100_000)}}, "x0"),
        ("chat/completions", {"messages": [{"role": "user"}] * 100_000}, "messages.0.content"),
    ],
)
def test_a_body_wrong_in_every_item_is_one_problem(server, path, body, param):
    """pydantic reports an error per bad item or unknown key: listing 10^6 of them held the
    gateway's event loop, every client's, for seconds. The first is named, once."""
    url = f"{server.info['http_address']}/v1/{path}"
    reply = httpx.post(url, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param
    assert ";" not in error["message"] and len(error["message"]) < 200, error["message"][:300]


def test_tokenize_and_detokenize_answer_as_transformers_tokenizes(server, tiny_model_dir):
    """vLLM's /tokenize and /detokenize (and the SDK's): a text as a completion's prompt, a
    chat as its template renders it, both checked against transformers' tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = server.info["http_address"]
    text = "Hello, world! café 中文"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    cases = [
        ({"prompt": text}, tokenizer(text).input_ids),
        ({"prompt": ""}, tokenizer("").input_ids),
        (
            {"prompt": text, "add_special_tokens": False},
            tokenizer(text, add_special_tokens=False).input_ids,
        ),
        (
            {"messages": chat},
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False),
        ),
        (
            {"messages": chat, "add_generation_prompt": False},
            tokenizer.apply_chat_template(chat, add_generation_prompt=False, return_dict=False),
        ),
    ]
    for body, want in cases:
        reply = httpx.post(base + "/tokenize", json={"model": MODEL, **body}, timeout=30).json()
        assert reply == {
            "count": len(want),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": want,
            "token_strs": None,
        }
    # vLLM's return_token_strs: each id's vocabulary entry, as convert_ids_to_tokens.
    body = {"prompt": text, "return_token_strs": True}
    reply = httpx.post(base + "/tokenize", json=body, timeout=30).json()
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(cases[0][1])
    ids = cases[3][1]
    reply = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
    assert reply.json() == {"prompt": tokenizer.decode(ids)}
    with WeirClient(server.client_address) as sdk:
        assert sdk.tokenize(text) == cases[0][1] and sdk.tokenize(chat) == ids
        assert sdk.detokenize(ids) == tokenizer.decode(ids)
    for path, body, status, fragment, param in (
        ("/tokenize", {"prompt": "a", "messages": chat}, 400, "not both", "prompt"),
        ("/tokenize", {"prompt": "x" * 10**6}, 400, "prompt is too long", None),
        ("/tokenize", {"messages": chat, "model": "no"}, 404, "no", None),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens: token id 49152 is outside", "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "tokens.0"),
        ("/detokenize", {"tokens": [2**64]}, 400, "tokens.0", "tokens.0"),
    ):
        reply = httpx.post(base + path, json=body, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == status and fragment in error["message"], error
        assert error["param"] == param
    assert httpx.post(base + "/tokenize", json={"prompt": "ok"}, timeout=30).json()["count"] > 0


def test_browsers_of_allowed_origins_may_call_the_api(server):
    url = server.info["http_address"] + "/v1/chat/completions"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    asked = {**preflight, "Access-Control-Request-Headers": "authorization, content-type"}
    reply = httpx.options(url, headers=asked)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    called = httpx.post(url, json=body, headers={"Origin": ORIGIN}, timeout=30)
    assert called.status_code == 200
    assert called.headers["access-control-allow-origin"] == ORIGIN
    elsewhere = httpx.options(url, headers={**preflight, "Origin": "https://evil.example"})
    assert elsewhere.status_code == 400
    assert "access-control-allow-origin" not in elsewhere.headers


def test_get_routes_answer_head_without_a_body(server):
    """Load balancers probe with HEAD."""
    base = server.info["http_address"]
    for path in ("/health", "/version", "/metrics", "/v1/models"):
        reply = httpx.head(base + path, timeout=30)
        assert reply.status_code == 200 and reply.content == b"", path


async def test_64_concurrent_streams(server):
    async with openai.AsyncOpenAI(
        base_url=server.info["http_address"] + "/v1", api_key="unused"
    ) as aclient:

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await aclient.completions.create(
                model=MODEL,
                prompt=[list(range(3 + i, 13 + i))],
                max_tokens=1 + i % 8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, reason, tokens = "", None, 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return text, reason, tokens

        results = await asyncio.gather(*(one(i) for i in range(64)))
    assert [r[1] for r in results] == ["length"] * 64
    assert [r[2] for r in results] == [1 + i % 8 for i in range(64)]


def _wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = read_metrics(server.info["metrics_address"])
        idle = (
            metric(samples, "weir_num_requests_running") == 0
            and metric(samples, "weir_kv_cache_usage_ratio") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def _wait_aborted(server, count: float, timeout: float = 1.5) -> None:
    """Until ``count`` requests were aborted (while the executor is held, briefly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _aborted(read_metrics(server.info["metrics_address"])) == count:
            return
        time.sleep(0.05)


def _aborted(samples: dict[str, float]) -> float:
    return samples.get(
        f'weir_requests_finished_total{{finished_reason="abort",model_name="{MODEL}"}}', 0
    )


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    body = {
        "model": MODEL,
        "prompt": [list(range(3, 13))],
        "max_tokens": 50,
        "stream": True,
        "ignore_eos": True,
    }
    before = _aborted(read_metrics(server.info["metrics_address"]))
    executor = next(c for c in server._children if c.name == "executor 0").proc.pid
    try:
        with httpx.Client(timeout=30) as http:
            url = server.info["http_address"] + "/v1/completions"
            with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                assert next(line for line in r.iter_lines() if line.startswith("data:"))
                # Held (well inside the executor timeout) so the request cannot run to its
                # end before the gateway notices the client leave (it did, on a loaded VM).
                os.kill(executor, signal.SIGSTOP)
                # vLLM's /load counts nothing without --enable-server-load-tracking
                # (test_vllm_serve_flags.py counts with it).
                load = http.get(server.info["http_address"] + "/load")
                assert load.json() == {"server_load": 0}
            # Leaving the block closes the connection after one event.
        _wait_aborted(server, before + 1)
    finally:
        os.kill(executor, signal.SIGCONT)
    samples = _wait_idle(server)
    assert metric(samples, "weir_kv_cache_usage_ratio") == 0
    assert metric(samples, "weir_num_requests_running") == 0
    assert _aborted(samples) == before + 1, "the request was aborted, not run to its end"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_its_response_aborts_its_request(server, stream):
    """Nothing has been sent yet (a whole body is being collected, or a stream waits for its
    first token): the client leaving must still abort the request, not let it run to its end.
    The executor is stopped for the moment (well inside the executor timeout) so the request
    is surely in flight when the client leaves."""
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 50, "ignore_eos": True}
    url = server.info["http_address"] + "/v1/completions"
    before = _aborted(read_metrics(server.info["metrics_address"]))
    executor = next(c for c in server._children if c.name == "executor 0").proc.pid
    os.kill(executor, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={**body, "stream": stream}, timeout=httpx.Timeout(30, read=0.5))
        _wait_aborted(server, before + 1)
    finally:
        os.kill(executor, signal.SIGCONT)
    samples = _wait_idle(server)
    assert _aborted(samples) == before + 1, "the request ran on after its client left"
    assert metric(samples, "weir_kv_cache_usage_ratio") == 0
    gateway = read_metrics(server.info["http_address"] + "/metrics")
    assert gateway['weir_gateway_requests_total{route="/v1/completions",status="499"}'] >= 1


def test_requests_wait_while_the_only_replica_replaces_its_executor(server, client):
    """A replica that is recovering queues requests (the SDK's wait there too): the gateway
    sends them to it rather than refusing with 503 when no replica is ok."""
    lost = next(c for c in server._children if c.name == "executor 0").proc.pid
    with WeirClient(server.client_address) as sdk:
        os.kill(lost, signal.SIGSTOP)  # silent: the scheduler declares it lost, serve kills it
        new = stop_the_replacement(server, lost)  # the replica stays recovering
        try:
            assert sdk.health()["status"] == "recovering"
            time.sleep(2.5)  # the gateway's health checks have seen it by now
            # Still ready (a Kubernetes readiness probe keeps the gateway in its Service).
            health = httpx.get(server.info["http_address"] + "/health")
            assert health.status_code == 200 and health.json()["status"] == "recovering"
            pending = concurrent.futures.ThreadPoolExecutor(1).submit(
                client.completions.create, model=MODEL, prompt=[5, 6], max_tokens=3
            )
            time.sleep(0.5)
        finally:
            os.kill(new, signal.SIGCONT)
        assert pending.result(timeout=120).choices[0].finish_reason == "length"
    deadline = time.monotonic() + 30
    while httpx.get(server.info["http_address"] + "/health").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the replica never came back into rotation"
        time.sleep(0.1)


def test_gateway_metrics_count_routes_and_statuses(server, client):
    client.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    samples = read_metrics(server.info["http_address"] + "/metrics")
    assert samples['weir_gateway_requests_total{route="/v1/models",status="200"}'] >= 1
    assert samples['weir_gateway_requests_total{route="/v1/completions",status="404"}'] >= 1
    assert samples[f'weir_gateway_replica_up{{replica="{server.client_address}"}}'] == 1
    assert not [k for k in samples if "_created" in k], "timestamps as series, unlike the others"


def test_gateway_metrics_speak_openmetrics_when_asked(server):
    """Prometheus asks for OpenMetrics first; the gateway answers it as the scheduler does."""
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    for url in (server.info["http_address"] + "/metrics", server.info["metrics_address"]):
        reply = httpx.get(url, headers={"Accept": accept})
        assert reply.headers["content-type"].startswith("application/openmetrics-text"), url
        assert reply.text.endswith("# EOF\n"), url


# ------------------------------------------------------------------ standalone gateways


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_api_key_is_required_when_set(server):
    with GatewayProcess([server.client_address], api_key="s3cret") as gateway:
        base = gateway.info["http_address"]
        status, body = _get(base + "/v1/models")
        assert status == 401 and "authentication_error" in body
        assert _get(base + "/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        assert _get(base + "/v1/models", {"Authorization": "Bearer s3cret"})[0] == 200
        keyed = openai.OpenAI(base_url=base + "/v1", api_key="s3cret")
        assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope").models.list()
        # HTTP's scheme names are case-insensitive.
        assert _get(base + "/v1/models", {"Authorization": "bearer s3cret"})[0] == 200
        # Refused before its body is read: a client without the key makes the gateway
        # parse nothing (an invalid body is a 401, not a 400).
        reply = httpx.post(base + "/v1/completions", content=b"{not json")
        assert reply.status_code == 401, reply.text
        # Tokenizing is engine work too.
        for path, body in (
            ("/tokenize", {"prompt": "Hi"}),
            ("/detokenize", {"tokens": [1]}),
            ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),  # SGLang's
        ):
            assert httpx.post(base + path, json=body).status_code == 401
            keyed = httpx.post(base + path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert keyed.status_code == 200


def test_a_browser_preflight_needs_no_api_key(server):
    """A preflight carries no key: the CORS answer comes before the key check, and the 401
    of a call without the key carries the CORS headers a page needs to read it."""
    with GatewayProcess([server.client_address], api_key="s3cret") as gateway:
        url = gateway.info["http_address"] + "/v1/chat/completions"
        origin = {"Origin": "https://any.example"}
        reply = httpx.options(url, headers={**origin, "Access-Control-Request-Method": "POST"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
        refused = httpx.post(url, json={}, headers=origin, timeout=30)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_no_ready_engine_is_503(tmp_path):
    with GatewayProcess([f"ipc://{tmp_path}/nobody.sock"], timeout=2) as gateway:
        base = gateway.info["http_address"]
        assert _get(base + "/health")[0] == 503
        offline = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as error:
            offline.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert error.value.status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_are_transformers_own(client, tiny_model_dir, tiny_hf_model, stream):
    """vLLM's return_token_ids: the prompt's ids are transformers' tokenization (a chat's,
    its template's), the output's its greedy tokens; return_tokens_as_token_ids writes the
    logprobs' tokens as "token_id:ID"."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "The quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    want = hf_greedy(tiny_hf_model, prompt_ids, 6)
    fields = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": fields}
    if stream:
        chunks = [
            c.choices[0].model_dump()
            for c in client.completions.create(prompt=prompt, stream=True, logprobs=1, **kwargs)
        ]
        got = [t for c in chunks for t in c["token_ids"]]
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        tokens = [t for c in chunks for t in (c["logprobs"] or {}).get("tokens", [])]
    else:
        [choice] = client.completions.create(prompt=prompt, logprobs=1, **kwargs).choices
        choice = choice.model_dump()
        assert choice["prompt_token_ids"] == prompt_ids
        got, tokens = choice["token_ids"], choice["logprobs"]["tokens"]
        assert all(
            key.startswith("token_id:") for row in choice["logprobs"]["top_logprobs"] for key in row
        )
    assert got == want
    assert tokens == [f"token_id:{t}" for t in want]
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat = client.chat.completions.create(messages=messages, stream=stream, **kwargs)
    if stream:
        chunks = [c.model_dump() for c in chat]
        # In the role's chunk, the first (vLLM's place), and no other.
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[0]["prompt_token_ids"] == chat_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        got = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]
    else:
        reply = chat.model_dump()
        assert reply["prompt_token_ids"] == chat_ids
        got = reply["choices"][0]["token_ids"]
    assert got == hf_greedy(tiny_hf_model, chat_ids, 6)


def test_cache_salt_keeps_cached_prompts_apart(server, client):
    """vLLM's cache_salt: a prompt's cached blocks serve a later request only under the same
    salt (no salt being a salt of its own)."""
    prompt = "Salted prefix caching keeps one tenant's prompts from another's timing."
    hits = "weir_prefix_cache_hit_tokens_total"

    def cached(salt):
        before = metric(read_metrics(server.info["metrics_address"]), hits)
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return metric(read_metrics(server.info["metrics_address"]), hits) - before

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= BLOCK_SIZE
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached(None) >= BLOCK_SIZE
    for salt in ("", "x" * 1025, 5):
        reply = httpx.post(
            server.info["http_address"] + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "cache_salt": salt},
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    server, client, tiny_model_dir, tiny_hf_model
):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context keeps its last k
    tokens (transformers' tokenization of it, cut), and the output is transformers' greedy
    continuation of those; -1 keeps as many as leave room for one output token."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "one two three four five six seven eight nine ten " * 10
    ids = tokenizer.encode(prompt)
    assert len(ids) > MAX_MODEL_LEN
    extra = {"ignore_eos": True, "truncate_prompt_tokens": 20}
    for form in (prompt, ids):
        reply = client.completions.create(
            model=MODEL,
            prompt=form,
            max_tokens=4,
            temperature=0,
            extra_body={**extra, "return_token_ids": True},
        )
        assert reply.usage.prompt_tokens == 20
        assert reply.choices[0].model_dump()["token_ids"] == hf_greedy(tiny_hf_model, ids[-20:], 4)
    # A text longer than any the context could hold unless truncated (the server's
    # characters limit, max_model_len x the longest token, was checked first).
    long = prompt * 40
    assert len(long) > MAX_MODEL_LEN * max(map(len, tokenizer.get_vocab()))
    reply = client.completions.create(
        model=MODEL, prompt=long, max_tokens=4, temperature=0, extra_body=extra
    )
    assert reply.choices[0].text == tokenizer.decode(hf_greedy(tiny_hf_model, ids[-20:], 4))
    # Bounded still: tokenizing it holds a thread other clients' long prompts wait for.
    with pytest.raises(openai.BadRequestError, match="to tokenize for truncate_prompt_tokens"):
        client.completions.create(
            model=MODEL, prompt="word " * 300_000, max_tokens=4, extra_body=extra
        )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert chat.usage.prompt_tokens == MAX_MODEL_LEN - 1
    for value in (0, -2, 2.5):
        reply = httpx.post(
            server.info["http_address"] + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "truncate_prompt_tokens": value},
        )
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "truncate_prompt_tokens"


def test_sagemakers_ping_and_invocations_route_by_the_body(server, client):
    """SageMaker's contract, as vLLM serves it: /ping is the health check; /invocations runs a
    chat, a completion or an input by the body's fields, as their own routes would."""
    base = server.info["http_address"]
    assert httpx.get(base + "/ping").json()["status"] == "ok"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    via = httpx.post(base + "/invocations", json=chat).json()
    direct = client.chat.completions.create(model=MODEL, **chat)
    assert via["choices"][0]["message"]["content"] == direct.choices[0].message.content
    completion = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    via = httpx.post(base + "/invocations", json=completion).json()
    assert (
        via["choices"][0]["text"]
        == client.completions.create(model=MODEL, **completion).choices[0].text
    )
    for body, status, words in (
        ({"foo": 1}, 400, "a chat (messages), a completion (prompt) or an input"),
        ({"messages": "Hi"}, 400, "messages"),
        ({"input": "Hi"}, 400, "serves no embeddings"),
    ):
        reply = httpx.post(base + "/invocations", json=body)
        assert reply.status_code == status and words in reply.json()["error"]["message"], reply.text
