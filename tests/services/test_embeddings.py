"""Embeddings, as vLLM's pooling runner serves them: `weir serve --runner pooling` on the
default model answers `/v1/embeddings` (the official openai client, floats and base64), the
SDK's `embed` and `LLM.embed`, and every vector equals what transformers computes from the
same weights (the last hidden state after the final norm, pooled, L2-normalized) however
the prompt was chunked, cached or preempted."""

import base64
import json
import os
import shutil
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from lora_adapters import peft_model, save_random_adapter
from serving_helpers import metric, read_metrics, small_server, wait_for_metric

from weir.services import LLM
from weir.shared.client import InvalidRequestError, WeirClient

transformers = pytest.importorskip("transformers")

MODEL = "smol-embed"
SHORT = "The capital of France is Paris."
LONG = "A lighthouse keeper finds a message in a bottle and sets out to answer it. " * 6
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def hidden_states(default_model_dir, tokenizer):
    """Each prompt's last hidden states (after the final norm), from transformers."""
    model = transformers.AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def states(prompt: str | list[int]) -> np.ndarray:
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0].numpy()

    return states


def pooled(states: np.ndarray, kind: str = "LAST", normalize: bool = True, dims=None):
    vector = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[kind][:dims]
    return vector / np.linalg.norm(vector) if normalize else vector


def close(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and np.abs(got - want).max() < TOLERANCE


@pytest.fixture(scope="module")
def server(default_model_dir):
    # A budget of 32 tokens a step: LONG's prefill takes several steps.
    with small_server(
        default_model_dir, MODEL, runner="pooling", max_num_batched_tokens=32
    ) as processes:
        yield processes


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="-")


def test_the_openai_client_gets_what_transformers_computes(server, hidden_states, tokenizer):
    client = _openai(server)
    texts = [SHORT, LONG]
    want = [pooled(hidden_states(p)) for p in texts]
    # The client asks for base64 unless told otherwise, and decodes it itself.
    for encoding in (openai.omit, "float"):
        reply = client.embeddings.create(model=MODEL, input=texts, encoding_format=encoding)
        assert [d.index for d in reply.data] == [0, 1]
        for data, expected in zip(reply.data, want):
            assert close(data.embedding, expected)
        assert reply.model == MODEL
        num_tokens = sum(len(tokenizer(p).input_ids) for p in texts)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens
    one = client.embeddings.create(model=MODEL, input=SHORT)
    assert len(one.data) == 1 and close(one.data[0].embedding, want[0])
    ids = [tokenizer("Token ids work too.").input_ids, tokenizer(SHORT).input_ids]
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    assert close(by_ids.data[0].embedding, pooled(hidden_states(ids[0])))
    assert close(by_ids.data[1].embedding, want[0])
    single = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert len(single.data) == 1 and close(single.data[0].embedding, by_ids.data[0].embedding)


def test_pooling_an_embedding_model_gives_its_embeddings(server, hidden_states):
    """vLLM's generic /pooling: an embedding model's task is embed, its data the vectors,
    with the embed task's dimensions and normalize."""
    want = [pooled(hidden_states(p)) for p in (SHORT, LONG)]
    reply = _post(server, "/pooling", {"model": MODEL, "input": [SHORT, LONG]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == MODEL
    for index, (item, expected) in enumerate(zip(body["data"], want)):
        assert (item["index"], item["object"]) == (index, "pooling")
        assert close(item["data"], expected)
    raw = _post(server, "/pooling", {"input": SHORT, "normalize": False, "task": "embed"}).json()
    assert close(raw["data"][0]["data"], pooled(hidden_states(SHORT), normalize=False))
    encoded = _post(server, "/pooling", {"input": SHORT, "encoding_format": "base64"}).json()
    assert close(np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), "<f4"), want[0])
    for fields, param in (({"activation": True}, "activation"), ({"task": "classify"}, None)):
        refused = _post(server, "/pooling", {"input": SHORT, **fields})
        assert refused.status_code == 400, refused.text
        assert param is None or refused.json()["error"]["param"] == param


def test_a_cached_prefix_gives_the_same_vector(server, hidden_states):
    """LAST pooling reads the last token only: a prompt whose blocks are cached computes its
    last token and is pooled as if computed whole."""
    url = server.info["metrics_address"]
    client = _openai(server)
    prompt = LONG + "Once more."
    client.embeddings.create(model=MODEL, input=prompt)
    hits = metric(read_metrics(url), "weir_prefix_cache_hit_tokens_total")
    again = client.embeddings.create(model=MODEL, input=prompt, encoding_format="float")
    wait_for_metric(url, "weir_prefix_cache_hit_tokens_total", hits + 64)
    assert close(again.data[0].embedding, pooled(hidden_states(prompt)))


def test_concurrent_clients_each_get_their_own(server, hidden_states):
    prompts = [f"Request number {i} asks about {LONG[: 20 + 9 * i]}" for i in range(12)]
    results: dict[int, list[float]] = {}

    def ask(i: int) -> None:
        reply = _openai(server).embeddings.create(model=MODEL, input=prompts[i])
        results[i] = reply.data[0].embedding

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert close(results[i], pooled(hidden_states(prompt))), i


def test_the_sdk_embeds_with_vllm_pooling_parameters(server, hidden_states, tokenizer):
    ids = tokenizer(LONG).input_ids
    with WeirClient(server.client_address) as client:
        out = client.embed(LONG)
        assert out.prompt_token_ids == ids
        assert close(out.embedding, pooled(hidden_states(LONG)))
        raw = client.embed(SHORT, normalize=False)
        assert close(raw.embedding, pooled(hidden_states(SHORT), normalize=False))
        last = client.embed(LONG, truncate_prompt_tokens=7)
        assert last.prompt_token_ids == ids[-7:]
        assert close(last.embedding, pooled(hidden_states(ids[-7:])))
        # An embedding generates nothing: its prompt may fill max_model_len (512 here).
        longer = (ids * 8)[:600]
        full = client.embed(longer[:512])
        assert close(full.embedding, pooled(hidden_states(longer[:512])))
        assert client.embed(longer, truncate_prompt_tokens=-1).prompt_token_ids == longer[-512:]
        with pytest.raises(InvalidRequestError, match="prompt is too long"):
            client.embed(longer[:513])
        with pytest.raises(InvalidRequestError, match="Matryoshka"):
            client.embed(SHORT, dimensions=64)
        with pytest.raises(InvalidRequestError, match="serves embeddings only"):
            list(client.generate("Hello"))


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.info["http_address"] + route, json=body, timeout=60)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"input": []}, 400, "must not be empty"),
        ({"input": ""}, 400, "must not be empty"),
        ({"input": SHORT, "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": SHORT, "dimensions": 0}, 400, "dimensions"),
        ({"input": SHORT, "dimensions": 2**70}, 400, "dimensions"),
        ({"input": SHORT, "truncate_prompt_tokens": 513}, 400, "more than max_model_len"),
        ({"input": SHORT, "dimensions": 64}, 400, "not a Matryoshka model"),
        ({"input": [SHORT, 7]}, 400, "input"),
        ({"input": [10**6]}, 400, "outside the vocabulary"),
        ({"input": "word " * 600}, 400, "max_model_len"),
        ({"input": [SHORT, "word " * 600]}, 400, "input[1]: prompt is too long"),
        ({"input": SHORT, "add_special_tokens": False}, 400, "add_special_tokens"),
        ({"input": SHORT, "temperature": 0}, 400, "temperature"),
        ({"input": ["x"] * 2049}, 400, "at most 2048"),
        ({"input": SHORT, "model": "other"}, 404, "does not exist"),
    ],
)
def test_bad_bodies_get_a_clear_error_and_the_server_serves_on(server, body, status, words):
    reply = _post(server, "/v1/embeddings", {"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]
    assert _post(server, "/v1/embeddings", {"input": SHORT}).status_code == 200


def test_a_pooling_server_refuses_generation_and_classification(server):
    for route, body in (
        ("/v1/completions", {"prompt": SHORT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        reply = _post(server, route, body)
        assert reply.status_code == 400
        assert "serves embeddings only" in reply.json()["error"]["message"]
    reply = _post(server, "/classify", {"input": SHORT})
    assert reply.status_code == 400
    assert "embedding model, not a sequence classifier" in reply.json()["error"]["message"]
    with WeirClient(server.client_address) as client:  # the SDK's score is a cross-encoder's
        with pytest.raises(InvalidRequestError, match="not a cross-encoder.*LLM.score"):
            client.score(SHORT, LONG)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_score_and_rerank_by_the_cosine_of_embeddings(server, hidden_states):
    """vLLM's /score and /rerank on an embedding model: the cosine similarity of the two
    texts' embeddings, one text against many or pair by pair; reranked best first."""
    query = "Where is the Eiffel Tower?"
    documents = ["The Eiffel Tower is in Paris.", "Bananas are yellow.", SHORT, LONG]
    vectors = {t: pooled(hidden_states(t)) for t in (query, *documents)}
    want = [cosine(vectors[query], vectors[d]) for d in documents]
    for route in ("/score", "/v1/score"):
        reply = _post(server, route, {"model": MODEL, "text_1": query, "text_2": documents})
        assert reply.status_code == 200, reply.text
        data = reply.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2, 3]
        assert np.allclose([d["score"] for d in data], want, atol=TOLERANCE)
    pairwise = _post(server, "/score", {"text_1": [query, SHORT], "text_2": documents[:2]})
    expected = [want[0], cosine(vectors[SHORT], vectors[documents[1]])]
    assert np.allclose([d["score"] for d in pairwise.json()["data"]], expected, atol=TOLERANCE)
    order = sorted(range(len(documents)), key=lambda i: -want[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": MODEL, "query": query, "documents": documents, "top_n": 3}
        reply = _post(server, route, body)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == order[:3]
        assert [r["document"]["text"] for r in results] == [documents[i] for i in order[:3]]
        assert np.allclose([r["relevance_score"] for r in results], sorted(want)[::-1][:3])
    everything = _post(server, "/rerank", {"query": query, "documents": documents})
    assert len(everything.json()["results"]) == len(documents)
    for route, body, words in (
        ("/score", {"text_1": [query, SHORT], "text_2": documents}, "send one text_1"),
        ("/score", {"text_1": query, "text_2": []}, "text_2"),
        ("/rerank", {"query": query, "documents": []}, "documents"),
        ("/rerank", {"query": query, "documents": documents, "top_n": -1}, "top_n"),
        ("/rerank", {"query": query, "documents": [SHORT, "word " * 600]}, "documents[1]: prompt"),
        ("/score", {"text_1": "word " * 600, "text_2": SHORT}, "text_1[0]: prompt is too long"),
        ("/score", {"text_1": query, "text_2": SHORT, "activation": False}, "no activation"),
    ):
        reply = _post(server, route, body)
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text


def test_rerank_takes_the_return_documents_litellm_sends(server):
    """litellm's hosted_vllm rerank posts Cohere's return_documents: true with every request;
    false, as Cohere's, ranks the same documents without their texts."""
    documents = ["a car", "a cat"]
    headers = {"Authorization": "Bearer fake-api-key", "accept": "application/json"}
    body = {"model": MODEL, "query": "cat", "documents": documents, "return_documents": True}
    reply = httpx.post(server.info["http_address"] + "/rerank", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert sorted(r["document"]["text"] for r in reply.json()["results"]) == documents
    bare = _post(server, "/rerank", {**body, "return_documents": False})
    assert bare.status_code == 200, bare.text
    assert [{k: r[k] for k in ("index", "relevance_score")} for r in reply.json()["results"]] == (
        bare.json()["results"]
    )


def test_an_embedding_in_flight_survives_its_executor_being_killed(server, hidden_states):
    prompts = [f"{i}: {LONG}" for i in range(6)]
    results: dict[int, list[float]] = {}

    def ask(i: int) -> None:
        with WeirClient(server.client_address, timeout=120) as client:
            results[i] = client.embed(prompts[i]).embedding

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    os.kill(server.info["executors"][0]["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert close(results[i], pooled(hidden_states(prompt))), i


def test_a_generating_server_refuses_embeddings(tiny_model_dir):
    # Any generating model: the tiny one starts faster than the default.
    with small_server(tiny_model_dir, "tiny") as processes:
        reply = _post(processes, "/v1/embeddings", {"input": SHORT})
        assert reply.status_code == 400
        assert "--runner pooling" in reply.json()["error"]["message"]
        with WeirClient(processes.client_address) as client:
            assert client.model_info()["runner"] == "generate"
            with pytest.raises(InvalidRequestError, match="serves no embeddings"):
                client.embed(SHORT)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pool_every_position_through_chunks_and_preemption(
    default_model_dir, hidden_states, kind
):
    """Pooling over the whole prompt computes all of it, in lockstep too: never from the
    prefix cache (a prompt after its prefix's twin), and again from its start after a
    preemption (a KV cache too small for the prompts together)."""
    prompts = [f"{i}: {LONG}" for i in range(5)] + [f"0: {LONG}and then some."]
    with LLM(
        str(default_model_dir),
        runner="pooling",
        pooler_config=f'{{"pooling_type": "{kind}"}}',
        # Four prompts advance at once, 16 tokens each a step, in 11 blocks of 16 tokens.
        max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
        max_model_len=256,
        kv_cache_memory="8MiB",
        async_scheduling=False,
        device="cpu",
    ) as llm:
        first = llm.embed(prompts[0])
        outputs = llm.embed(prompts)
        samples = read_metrics(llm.server_info["metrics_address"])
    assert metric(samples, "weir_preemptions_total") > 0
    assert close(first[0].embedding, pooled(hidden_states(prompts[0]), kind))
    for out, prompt in zip(outputs, prompts):
        assert close(out.embedding, pooled(hidden_states(prompt), kind)), prompt


def test_a_sentence_transformers_model_is_served_as_its_files_say(
    default_model_dir, hidden_states, tmp_path
):
    """`--runner auto` finds an embedding model by its sentence-transformers files and pools
    as they say (mean, not normalized here); a Matryoshka model takes `dimensions`."""
    model = tmp_path / "st-model"
    model.mkdir()
    for item in default_model_dir.iterdir():
        if item.name != "config.json":
            (model / item.name).symlink_to(item)
    config = (default_model_dir / "config.json").read_text()
    (model / "config.json").write_text(config.rstrip().rstrip("}") + ', "is_matryoshka": true}')
    (model / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "1_Pooling", '
        '"type": "sentence_transformers.models.Pooling"}]'
    )
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    states = hidden_states(SHORT)
    with small_server(model, "st") as processes:
        with WeirClient(processes.client_address) as client:
            assert client.model_info()["runner"] == "pooling"
            assert close(client.embed(SHORT).embedding, pooled(states, "MEAN", normalize=False))
            small = client.embed(SHORT, dimensions=64, normalize=True).embedding
            assert close(small, pooled(states, "MEAN", dims=64))
    shutil.rmtree(model)


def test_a_bare_transformer_checkpoint_is_an_embedding_model(
    default_model_dir, hidden_states, tmp_path
):
    """What embedding models ship: the transformer without its LM head, saved by its own
    class (tensor names without ``model.``, a ``*Model`` architecture). `--runner auto`
    serves it as a pooling model; untied, it needs no LM head."""
    bare = tmp_path / "bare"
    transformers.AutoModel.from_pretrained(default_model_dir).save_pretrained(bare)
    config = json.loads((bare / "config.json").read_text())
    assert config["architectures"] == ["LlamaModel"]
    (bare / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, bare / name)
    with LLM(str(bare), max_model_len=256, device="cpu") as llm:
        [out] = llm.embed(LONG)
        [score] = llm.score(SHORT, [LONG])  # an embedding model's: the cosine similarity
    assert close(out.embedding, pooled(hidden_states(LONG)))
    assert close(score.score, cosine(pooled(hidden_states(SHORT)), pooled(hidden_states(LONG))))


def test_a_lora_adapter_of_the_bare_transformer_embeds_as_peft_does(default_model_dir, tmp_path):
    """An embedding model's adapter is trained on the model without its LM head (PEFT then
    names its tensors without ``model.``); the base model's embeddings stay the base's."""
    adapter = save_random_adapter(
        default_model_dir,
        tmp_path / "bare",
        seed=3,
        targets=["q_proj", "down_proj"],
        rank=4,
        alpha=8,
        bare=True,
    )
    ids = transformers.AutoTokenizer.from_pretrained(default_model_dir)(LONG).input_ids
    model = peft_model(default_model_dir, adapter, bare=True)
    with torch.no_grad():
        want = {"bare": pooled(model(torch.tensor([ids])).last_hidden_state[0].numpy())}
        with model.disable_adapter():  # the base model, loaded once
            want[None] = pooled(model(torch.tensor([ids])).last_hidden_state[0].numpy())
    with LLM(
        str(default_model_dir), runner="pooling", lora_modules=[f"bare={adapter}"], device="cpu"
    ) as llm:
        [adapted] = llm.embed(LONG, lora_name="bare")
        [base] = llm.embed(LONG)
    assert close(adapted.embedding, want["bare"]) and close(base.embedding, want[None])
    assert not close(want["bare"], want[None])
