"""The sampling defaults of a model's generation_config.json (vLLM's ``--generation-config
auto``): requests over HTTP and ``LLM`` calls that leave a parameter out take the file's,
one that sets it keeps its own, max_new_tokens caps every request; ``vllm`` turns them off."""

import json
import shutil

import openai
import pytest
from serving_helpers import hf_greedy, small_server

from weir.services import LLM
from weir.shared.sampling import SamplingParams
from weir.shared.sampling_defaults import read_sampling_defaults, with_defaults

PROMPT = [17, 900, 3, 44, 5021, 8]


@pytest.fixture
def recommending_dir(tmp_path, tiny_model_dir):
    """The tiny model, its creator recommending greedy decoding and at most 5 new tokens."""
    path = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_p=0.9, max_new_tokens=5, top_k=None)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_files_defaults_are_read_and_checked(recommending_dir, tmp_path):
    defaults = read_sampling_defaults("auto", recommending_dir)
    assert defaults == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert read_sampling_defaults("vllm", recommending_dir) == {}
    assert read_sampling_defaults(str(recommending_dir), tmp_path) == defaults
    assert read_sampling_defaults("auto", tmp_path) == {}  # no file: Weir's defaults
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_sampling_defaults(str(tmp_path), recommending_dir)
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        read_sampling_defaults("auto", tmp_path)
    override = '{"max_new_tokens": 3, "top_k": 7}'
    assert read_sampling_defaults("auto", recommending_dir, override) == {
        **defaults,
        "max_tokens": 3,
        "top_k": 7,
    }
    assert read_sampling_defaults("vllm", recommending_dir, '{"min_p": 0.1}') == {"min_p": 0.1}
    with pytest.raises(ValueError, match="--override-generation-config must be a JSON object"):
        read_sampling_defaults("auto", recommending_dir, "[1]")
    with pytest.raises(ValueError, match="with --override-generation-config: temperature"):
        read_sampling_defaults("auto", recommending_dir, '{"temperature": -1}')
    assert with_defaults(defaults, max_tokens=3, temperature=None) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 3,
    }
    assert with_defaults(defaults, max_tokens=9, temperature=0.5)["max_tokens"] == 5
    assert with_defaults({}, max_tokens=None, top_k=None) == {"max_tokens": None}


def test_requests_leaving_them_out_sample_as_the_file_says(recommending_dir, tiny_hf_model):
    want = hf_greedy(tiny_hf_model, PROMPT, 5)
    with small_server(recommending_dir, "tiny") as processes:
        client = openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="x")
        body = {"return_token_ids": True, "ignore_eos": True}
        call = {"model": "tiny", "prompt": PROMPT, "extra_body": body}
        # Greedy by the file, and five tokens at most: its max_new_tokens.
        left_out = client.completions.create(**call, n=3, seed=1)
        assert [c.model_dump()["token_ids"] for c in left_out.choices] == [want] * 3
        assert (
            client.completions.create(**call, max_tokens=3).choices[0].model_dump()["token_ids"]
            == want[:3]
        )
        capped = client.completions.create(**call, max_tokens=50).choices[0]
        assert capped.model_dump()["token_ids"] == want and capped.finish_reason == "length"
        # A temperature given is the request's own: seeded samples differ from greedy.
        sampled = client.completions.create(**call, temperature=2.0, seed=1, n=3)
        assert [c.model_dump()["token_ids"] for c in sampled.choices] != [want] * 3
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3, seed=2
        )
        assert len({c.message.content for c in chat.choices}) == 1
        assert chat.usage.completion_tokens <= 15


def test_vllm_turns_them_off_and_llm_takes_them(recommending_dir, tiny_hf_model):
    with small_server(recommending_dir, "tiny", generation_config="vllm") as processes:
        client = openai.OpenAI(base_url=processes.info["http_address"] + "/v1", api_key="x")
        reply = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=40, seed=1, n=3, extra_body={"ignore_eos": True}
        )
        assert len({c.text for c in reply.choices}) > 1  # temperature 1: samples
    overridden = '{"max_new_tokens": 3}'  # merged with the file's greedy temperature
    with LLM(
        str(recommending_dir), max_model_len=512, override_generation_config=overridden
    ) as llm:
        [left_out] = llm.generate([PROMPT])
        [given] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))
    assert left_out.token_ids == hf_greedy(tiny_hf_model, PROMPT, 3)
    assert given.token_ids == hf_greedy(tiny_hf_model, PROMPT, 8)
