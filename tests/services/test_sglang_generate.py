"""SGLang's native POST /generate, as its clients (and RL frameworks rolling out with SGLang)
send it, over httpx: tokens and logprobs against transformers on the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
import torch
from serving_helpers import hf_greedy, metric, read_metrics, small_server

from weir.shared.tokenizer import Tokenizer

PROMPT = [5, 17, 99, 123, 456, 789, 1011]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with small_server(tiny_model_dir, "tiny") as processes:
        yield processes


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.info["http_address"] + "/generate", json=body, timeout=60)


def _hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each position of ``token_ids``."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_greedy_tokens_and_logprobs_are_transformers(server, tiny_hf_model, tiny_model_dir):
    """input_ids in, SGLang's result out: the greedy ids transformers writes, the text they
    decode to, a length finish, and with return_logprob each output and prompt token's
    logprob (and the top 3) as transformers computes them."""
    reply = _post(
        server,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 3,
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
            "rid": "roll-1",
        },
    )
    assert reply.status_code == 200, reply.text
    result = reply.json()
    expected = hf_greedy(tiny_hf_model, PROMPT, 8)
    assert result["output_ids"] == expected
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    assert result["text"] == tokenizer.decode(expected)
    meta = result["meta_info"]
    assert meta["id"] == "roll-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 8)
    reference = _hf_logprobs(tiny_hf_model, PROMPT + expected)
    outputs = meta["output_token_logprobs"]
    assert [token for _, token, _ in outputs] == expected
    for position, ((logprob, token, text), top) in enumerate(
        zip(outputs, meta["output_top_logprobs"], strict=True)
    ):
        row = reference[len(PROMPT) - 1 + position]
        assert logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert text == tokenizer.decode([token])
        best = torch.topk(row, 3)
        assert [t for _, t, _ in top] == best.indices.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(best.values.tolist(), abs=1e-3)
    inputs = meta["input_token_logprobs"]
    assert [token for _, token, _ in inputs] == PROMPT
    assert inputs[0][0] is None  # nothing predicts the first token
    for position, (logprob, token, _) in enumerate(inputs[1:], 1):
        assert logprob == pytest.approx(reference[position - 1][token].item(), abs=1e-3)


def test_a_batch_of_texts_with_their_own_parameters_and_samples(server):
    """A batch: a result per prompt (n of them for n samples), in order, each with its rid
    and its own sampling parameters; a stop string ends one with SGLang's matched."""
    reply = _post(
        server,
        {
            "text": ["The capital of France is", "Once upon a time"],
            "sampling_params": [
                {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                {"max_new_tokens": 4, "temperature": 1.0, "n": 2, "sampling_seed": 7},
            ],
            "rid": ["a", "b"],
        },
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()
    assert [r["meta_info"]["id"] for r in results] == ["a", "b-0", "b-1"]
    assert [r["meta_info"]["completion_tokens"] for r in results][0] == 5
    assert all(len(r["output_ids"]) == r["meta_info"]["completion_tokens"] for r in results)
    first = results[0]["text"]
    stopped = _post(
        server,
        {
            "text": "The capital of France is",
            "sampling_params": {
                "max_new_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [first[2:4]],
            },
        },
    ).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2:4]}
    assert stopped["text"] == first[: first.index(first[2:4])]


def test_a_stream_sends_each_result_so_far_then_done(server):
    """Streamed, each event holds the text and ids so far (SGLang's), the last its finish;
    they end as the whole answer does."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    whole = _post(server, body).json()
    events = []
    with httpx.stream(
        "POST",
        server.info["http_address"] + "/generate",
        json={**body, "stream": True},
        timeout=60,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"text": "a", "input_ids": [1]}, "give text or input_ids, one of them"),
        ({"text": "a", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
        ({"text": "a", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "give one, or one per prompt"),
        ({"text": "a", "lora_path": "nope"}, "The model `nope` does not exist"),
        # The bound of a completion's choices, over the batch.
        (
            {"text": ["a"] * 65, "sampling_params": {"n": 2, "max_new_tokens": 1}},
            "65 prompt(s) with their n make 130 results, more than 128",
        ),
    ],
)
def test_what_is_wrong_is_a_400_naming_it(server, body, fragment):
    reply = _post(server, body)
    assert reply.status_code in (400, 404), reply.text
    assert fragment in reply.json()["error"]["message"]
    assert _post(server, {"text": "a", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_sglangs_cache_pause_and_memory_calls(server):
    """What an RL framework calls between rollouts, by SGLang's names: /flush_cache (the
    prefix cache reset: a prompt computed before is computed again), /pause_generation and
    /continue_generation (a request sent meanwhile waits, then runs), and
    /release_memory_occupation and /resume_memory_occupation (vLLM's sleep and wake up)."""
    base = server.info["http_address"]
    body = {"input_ids": PROMPT * 6, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    _post(server, body)
    assert _post(server, body).json()["meta_info"]["cached_tokens"] > 0
    assert httpx.post(base + "/flush_cache", timeout=30).status_code == 200
    assert _post(server, body).json()["meta_info"]["cached_tokens"] == 0

    def waits_until(call: str, check: str, field: str) -> None:
        assert httpx.post(base + call, timeout=30).status_code == 200
        assert httpx.get(base + check, timeout=30).json()[field] is True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_post, server, body)
            time.sleep(0.5)
            assert not pending.done()  # held while paused or asleep
            again = (
                "/continue_generation"
                if call == "/pause_generation"
                else ("/resume_memory_occupation")
            )
            assert httpx.post(base + again, timeout=60).status_code == 200
            assert pending.result(timeout=60).status_code == 200
        assert httpx.get(base + check, timeout=30).json()[field] is False

    waits_until("/pause_generation", "/is_paused", "is_paused")
    waits_until("/release_memory_occupation", "/is_sleeping", "is_sleeping")
    refused = httpx.post(
        base + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30
    )
    assert refused.status_code == 400 and "together" in refused.json()["error"]["message"]


def test_get_model_info_is_sglangs(server):
    info = httpx.get(server.info["http_address"] + "/get_model_info", timeout=30).json()
    assert info["model_path"] == "tiny" and info["is_generation"] is True


def test_abort_request_ends_the_requests_of_a_rid_or_all(server):
    """SGLang's /abort_request: held by a pause, the requests of rid "a" (both of its n, the
    second not sent yet) end at once with finish reason abort while the others wait;
    abort_all ends every request in flight; a streamed request aborted mid-way ends with
    what it has."""
    base = server.info["http_address"]
    waiting = server.info["metrics_address"]

    def body(rid: str, n: int = 1, tokens: int = 4) -> dict:
        params = {"max_new_tokens": tokens, "ignore_eos": True, "n": n}
        return {"input_ids": PROMPT, "sampling_params": params, "rid": rid}

    def held(count: int) -> None:
        while metric(read_metrics(waiting), "weir_num_requests_waiting") != count:
            time.sleep(0.01)

    assert httpx.post(base + "/pause_generation", timeout=30).status_code == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            a, b = pool.submit(_post, server, body("a", n=2)), pool.submit(_post, server, body("b"))
            held(2)  # a's second sample waits for its first's prompt in the cache
            assert httpx.post(base + "/abort_request", json={"rid": "a"}).status_code == 200
            for result in a.result(timeout=30).json():
                assert result["meta_info"]["finish_reason"]["type"] == "abort"
                assert result["output_ids"] == []
            assert not b.done()
            c = pool.submit(_post, server, body("c"))
            held(2)
            assert httpx.post(base + "/abort_request", json={"abort_all": True}).status_code == 200
            for reply in (b, c):
                assert (
                    reply.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "abort"
                )
    finally:
        httpx.post(base + "/continue_generation", timeout=30)
    assert _post(server, body("a")).json()["meta_info"]["finish_reason"]["type"] == "length"
    with httpx.stream(
        "POST", base + "/generate", json={**body("s", tokens=480), "stream": True}, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["meta_info"]["finish_reason"] is None
        assert httpx.post(base + "/abort_request", json={"rid": "s"}).status_code == 200
        results = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
    last = results[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and 0 < last["completion_tokens"] < 480


def test_health_generate_generates_a_token(server):
    """SGLang's /health_generate: 200 once a replica generated a token. It needs no key, so
    callers at once share one check: five probes held by a pause are one request waiting
    at the engine, and all five answer 200 once it runs."""
    base, metrics = server.info["http_address"], server.info["metrics_address"]
    assert httpx.post(base + "/pause_generation", timeout=30).status_code == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            probes = [
                pool.submit(httpx.get, base + "/health_generate", timeout=60) for _ in range(5)
            ]
            while metric(read_metrics(metrics), "weir_num_requests_waiting") == 0:
                time.sleep(0.01)
            time.sleep(0.5)  # the other probes have arrived
            assert metric(read_metrics(metrics), "weir_num_requests_waiting") == 1
            assert httpx.post(base + "/continue_generation", timeout=30).status_code == 200
            assert [probe.result().status_code for probe in probes] == [200] * 5
    finally:
        httpx.post(base + "/continue_generation", timeout=30)
