"""Beam search, as vLLM runs it: `LLM.beam_search`, the SDK's `beam_search` and the HTTP
API's `use_beam_search` (completions and chat, whole and streamed) on the default model.
Without an end-of-sequence token in play, the beams, their order and their cumulative
logprobs are transformers' `generate(num_beams=...)`'s; with one, a beam that ends on it is
complete and ranked by vLLM's length-normalized score, its logprob transformers'."""

import json

import httpx
import pytest
import torch
from serving_helpers import small_server

from weir.services import LLM
from weir.shared.beam_search import BeamSearchParams
from weir.shared.client import InvalidRequestError, WeirClient

transformers = pytest.importorskip("transformers")

PROMPT = "The capital of France is"
WIDTH, TOKENS = 4, 8


@pytest.fixture(scope="module")
def reference(default_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    return tokenizer, model


def hf_beams(reference, prompt_ids: list[int], width: int, tokens: int):
    """transformers' beams of a search that no end-of-sequence token cuts: (their tokens,
    cumulative logprobs), best first."""
    _, model = reference
    config = transformers.GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=tokens,
        length_penalty=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = [row[len(prompt_ids) :].tolist() for row in out.sequences]
    # transformers scores a beam by its cumulative logprob over its generated length.
    return beams, [float(score) * tokens for score in out.sequences_scores]


def logprob_of(reference, prompt_ids: list[int], output_ids: list[int]) -> float:
    _, model = reference
    ids = prompt_ids + output_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return sum(float(logprobs[len(prompt_ids) + i - 1, t]) for i, t in enumerate(output_ids))


def test_llm_beam_search_finds_transformers_beams(reference, default_model_dir):
    tokenizer, _ = reference
    prompt_ids = tokenizer(PROMPT).input_ids
    other = tokenizer("Once upon a time").input_ids
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=TOKENS, ignore_eos=True)
    with LLM(str(default_model_dir), max_model_len=256, device="cpu") as llm:
        searched = llm.beam_search([PROMPT, other], params)
        [with_eos] = llm.beam_search(PROMPT, BeamSearchParams(beam_width=WIDTH, max_tokens=TOKENS))
    for ids, found in zip([prompt_ids, other], searched):
        want, cum = hf_beams(reference, ids, WIDTH, TOKENS)
        assert found.prompt_token_ids == ids
        assert [s.output_token_ids for s in found.sequences] == want
        assert all(s.tokens == ids + s.output_token_ids for s in found.sequences)
        for seq, logprob in zip(found.sequences, cum):
            assert seq.cum_logprob == pytest.approx(logprob, abs=1e-3)
            assert seq.finish_reason == "length"
            assert seq.text == tokenizer.decode(seq.output_token_ids)
    # The end-of-sequence token completes a beam: " Paris." then <|im_end|> outranks the
    # live beams by vLLM's score (the prompt counts in its length, the EOS does not).
    best = with_eos.sequences[0]
    assert best.finish_reason == "stop" and best.output_token_ids[-1] == tokenizer.eos_token_id
    assert best.text == tokenizer.decode(best.output_token_ids[:-1])
    assert best.cum_logprob == pytest.approx(
        logprob_of(reference, prompt_ids, best.output_token_ids), abs=1e-3
    )
    scores = [
        s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop")) for s in with_eos.sequences
    ]
    assert scores == sorted(scores, reverse=True)


@pytest.fixture(scope="module")
def server(default_model_dir):
    with small_server(default_model_dir, "smol") as processes:
        yield processes


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.info["http_address"] + route, json=body, timeout=120)


def test_use_beam_search_over_http_returns_the_best_beams(server, reference):
    tokenizer, _ = reference
    want, _ = hf_beams(reference, tokenizer(PROMPT).input_ids, 3, 6)
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 6, "ignore_eos": True, "use_beam_search": True}
    reply = _post(server, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["text"] for c in choices] == [tokenizer.decode(w) for w in want]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert reply.json()["usage"]["completion_tokens"] == 18
    # A search's requests hit the prompt's cache as they go: no one count to tell (vLLM's).
    assert "prompt_tokens_details" not in reply.json()["usage"]

    streamed = ["", "", ""]
    with httpx.stream(
        "POST",
        server.info["http_address"] + "/v1/completions",
        json={**body, "stream": True},
        timeout=120,
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    streamed[choice["index"]] += choice["text"]
    assert streamed == [tokenizer.decode(w) for w in want]

    chat = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "n": 2,
        "max_tokens": 5,
        "use_beam_search": True,
    }
    reply = _post(server, "/v1/chat/completions", chat)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 2
    with WeirClient(server.client_address) as client:
        messages = chat["messages"]
        found = client.beam_search(messages, BeamSearchParams(beam_width=2, max_tokens=5))
        assert [c["message"]["content"] for c in reply.json()["choices"]] == [
            s.text for s in found.sequences
        ]
        with pytest.raises(InvalidRequestError, match="more than max_model_len"):
            client.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=600))

    # The prompt's last 3 tokens, as a generate request's; any length_penalty ranks.
    cut = {"prompt": PROMPT, "n": 2, "max_tokens": 3, "ignore_eos": True, "use_beam_search": True}
    reply = _post(server, "/v1/completions", {**cut, "truncate_prompt_tokens": 3})
    assert reply.json()["usage"]["prompt_tokens"] == 3
    want, _ = hf_beams(reference, tokenizer(PROMPT).input_ids[-3:], 2, 3)
    assert [c["text"] for c in reply.json()["choices"]] == [tokenizer.decode(w) for w in want]
    for penalty in (1000, -1e300):
        reply = _post(server, "/v1/completions", {**cut, "length_penalty": penalty})
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"stop": ["."]}, "stop: is not taken with use_beam_search"),
        ({"logprobs": 2}, "logprobs: is not taken with use_beam_search"),
        ({"n": 11}, "keeps at most 10 beams"),
        ({"length_penalty": "x"}, "length_penalty"),
    ],
)
def test_what_beam_search_does_not_take_is_refused_by_name(server, change, words):
    body = {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": True, **change}
    reply = _post(server, "/v1/completions", body)
    assert reply.status_code == 400
    assert words in reply.json()["error"]["message"]
