"""Sequence classifiers (reward models, moderation classifiers: `*ForSequenceClassification`
checkpoints), as vLLM's pooling runner serves them: `weir serve` finds one by its
architecture and answers `POST /classify` (vLLM's body and response), the SDK's `classify`
and `LLM.classify`, and every score is what transformers' AutoModelForSequenceClassification
computes from the same weights: the last token's final hidden state through the score head,
then a softmax over the labels (a sigmoid for one label), or the logits themselves when
asked. A classifier serves no embeddings and no generation."""

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from serving_helpers import small_server

from weir.services import LLM
from weir.services.executor.weights import load_model
from weir.shared.client import InvalidRequestError, WeirClient

transformers = pytest.importorskip("transformers")

MODEL = "smol-classify"
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SHORT = "The service was quick and the food was good."
LONG = "A lighthouse keeper finds a message in a bottle and sets out to answer it. " * 6
TOLERANCE = 1e-4


def save_classifier(default_model_dir, path, labels: dict[int, str], std: float = 0.1):
    """The default model's transformer with a random score head of ``labels``, saved as
    transformers saves a sequence classifier (beside the tokenizer's files)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        default_model_dir,
        num_labels=len(labels),
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        dtype=torch.float32,
    ).eval()
    with torch.no_grad():  # wide enough that the labels' probabilities differ
        model.score.weight.normal_(0.0, std)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    return model


@pytest.fixture(scope="module")
def classifier(default_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    return path, save_classifier(default_model_dir, path, LABELS)


@pytest.fixture(scope="module")
def logits(classifier, default_model_dir):
    """transformers' logits of a prompt (text or token ids), one prompt a batch."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = classifier[1]

    def of(prompt: str | list[int]) -> np.ndarray:
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    return of


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def close(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and np.abs(got - want).max() < TOLERANCE


@pytest.fixture(scope="module")
def server(classifier):
    # A budget of 32 tokens a step: LONG's prefill takes several steps.
    with small_server(classifier[0], MODEL, max_num_batched_tokens=32) as processes:
        yield processes


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.info["http_address"] + route, json=body, timeout=60)


def test_classify_answers_what_transformers_computes(server, logits):
    ids = [504, 3458, 282, 4649, 314]
    reply = _post(server, "/classify", {"model": MODEL, "input": [SHORT, LONG]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == MODEL
    [one] = _post(server, "/classify", {"input": ids}).json()["data"]
    # Trailing padding tokens: read past, as transformers does, and counted, as sent.
    padded = _post(server, "/classify", {"input": ids + [2, 2]}).json()
    assert close(padded["data"][0]["probs"], softmax(logits(ids + [2, 2])))
    assert close(padded["data"][0]["probs"], softmax(logits(ids)))
    assert padded["usage"]["prompt_tokens"] == len(ids) + 2
    for index, item, prompt in zip([0, 1, 0], [*body["data"], one], [SHORT, LONG, ids]):
        want = softmax(logits(prompt))
        assert item["index"] == index and item["num_classes"] == 3
        assert close(item["probs"], want), (item["probs"], want)
        assert item["label"] == LABELS[int(want.argmax())]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 50

    raw = _post(server, "/classify", {"input": SHORT, "activation": False}).json()
    assert close(raw["data"][0]["probs"], logits(SHORT))


def test_pooling_a_classifier_gives_its_scores_per_label(server, logits):
    """vLLM's generic /pooling: a classifier's task is classify, its data the scores."""
    reply = _post(server, "/pooling", {"model": MODEL, "input": [SHORT, LONG]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    for index, (item, prompt) in enumerate(zip(body["data"], [SHORT, LONG])):
        assert (item["index"], item["object"]) == (index, "pooling")
        assert close(item["data"], softmax(logits(prompt)))
    raw = _post(
        server, "/pooling", {"input": SHORT, "activation": False, "encoding_format": "base64"}
    )
    [item] = raw.json()["data"]
    assert close(np.frombuffer(base64.b64decode(item["data"]), "<f4"), logits(SHORT))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 50
    for fields, param in (({"dimensions": 2}, "dimensions"), ({"task": "embed"}, None)):
        refused = _post(server, "/pooling", {"input": SHORT, **fields})
        assert refused.status_code == 400, refused.text
        assert param is None or refused.json()["error"]["param"] == param


def test_the_sdk_classifies_and_names_the_labels(server, logits):
    with WeirClient(server.client_address) as client:
        info = client.model_info()
        assert info["runner"] == "pooling" and info["labels"] == list(LABELS.values())
        out = client.classify(LONG, truncate_prompt_tokens=20)
        tokens = out.prompt_token_ids
        assert len(tokens) == 20
        assert close(out.probs, softmax(logits(tokens)))
        assert close(client.classify(SHORT, activation=False).probs, logits(SHORT))
        with pytest.raises(InvalidRequestError, match="sequence classifier: it classifies"):
            client.embed(SHORT)
        with pytest.raises(InvalidRequestError, match="activation must be a bool"):
            client.classify(SHORT, activation="yes")


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [
        ("/classify", {"input": []}, 400, "must not be empty"),
        ("/classify", {"input": SHORT, "dimensions": 8}, 400, "dimensions"),
        ("/classify", {"input": SHORT, "activation": "maybe"}, 400, "activation"),
        ("/classify", {"input": [10**6]}, 400, "token id 1000000 is outside"),
        ("/classify", {"input": [SHORT, "word " * 600]}, 400, "input[1]: prompt is too long"),
        ("/classify", {"input": SHORT, "model": "other"}, 404, "does not exist"),
        ("/v1/embeddings", {"input": SHORT}, 400, "POST /classify"),
        ("/score", {"text_1": "a", "text_2": "b"}, 400, "only a classifier of one label"),
        ("/v1/completions", {"prompt": SHORT}, 400, "serves classifications only"),
    ],
)
def test_what_a_classifier_refuses_gets_a_clear_error(server, route, body, status, words):
    reply = _post(server, route, {"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]
    assert _post(server, "/classify", {"input": SHORT}).status_code == 200


@pytest.fixture(scope="module")
def cross_encoder(default_model_dir, tmp_path_factory):
    """A classifier of one label, as rerankers are: transformers' logit of a pair of texts
    encoded together (its tokenizer's pair encoding) and a server of it."""
    path = tmp_path_factory.mktemp("cross-encoder")
    model = save_classifier(default_model_dir, path, {0: "relevant"}, std=0.01)
    # A pair template, as cross-encoders' tokenizers have one: each text closed by a separator.
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
            {"SpecialToken": {"id": "<|im_end|>", "type_id": 1}},
        ],
        "special_tokens": {
            "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}
        },
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert tokenizer("a", "b").input_ids[-1] == 2

    def logit(text_1: str, text_2: str | None = None, max_length: int | None = None) -> float:
        with torch.no_grad():
            cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
            ids = tokenizer(text_1, text_2, **cut).input_ids
            return float(model(torch.tensor([ids])).logits[0, 0])

    return path, logit


def sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


QUERY = "Where is the Eiffel Tower?"
DOCUMENTS = [
    "The Eiffel Tower stands in Paris, on the Champ de Mars.",
    "Bananas are rich in potassium.",
    "Paris is the capital of France.",
]


def test_a_one_label_classifier_scores_and_reranks_pairs_as_a_cross_encoder(cross_encoder):
    """`/score`, `/rerank` and the SDK's `score`: each pair encoded together as the
    tokenizer encodes a pair, its one label's sigmoid (vLLM's cross-encoder scoring)."""
    path, logit = cross_encoder
    want = [sigmoid(logit(QUERY, d)) for d in DOCUMENTS]
    assert len({round(w, 3) for w in want}) == 3, want
    with small_server(path, "rerank") as server:
        score = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert close([item["score"] for item in score["data"]], want), (score["data"], want)
        pairs = _post(server, "/score", {"text_1": DOCUMENTS[:2], "text_2": [QUERY] * 2})
        want_pairs = [sigmoid(logit(d, QUERY)) for d in DOCUMENTS[:2]]
        assert close([item["score"] for item in pairs.json()["data"]], want_pairs)
        ranked = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
        results = ranked.json()["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])[:2]
        assert close([r["relevance_score"] for r in results], sorted(want, reverse=True)[:2])
        # vLLM's activation: false, the logits.
        logits = [logit(QUERY, d) for d in DOCUMENTS]
        raw = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS, "activation": False})
        assert close([item["score"] for item in raw.json()["data"]], logits), raw.text
        body = {"query": QUERY, "documents": DOCUMENTS, "activation": False}
        raw_ranked = _post(server, "/rerank", body).json()["results"]
        assert close([r["relevance_score"] for r in raw_ranked], sorted(logits, reverse=True))
        with WeirClient(server.client_address) as client:
            out = client.score(QUERY, DOCUMENTS[0], activation=False)
            assert close(out.score, logit(QUERY, DOCUMENTS[0]))
            assert close(client.classify(SHORT).probs, [sigmoid(logit(SHORT))])
        # Cut to 9 tokens longest first, as transformers' tokenizer cuts a pair: some of each.
        cut = _post(
            server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": 9}
        )
        want_cut = [sigmoid(logit(QUERY, d, max_length=9)) for d in DOCUMENTS]
        assert close([item["score"] for item in cut.json()["data"]], want_cut)
        assert cut.json()["usage"]["prompt_tokens"] == 27
        reply = _post(server, "/score", {"text_1": QUERY, "text_2": ["word " * 600]})
        assert reply.status_code == 400
        assert "text_1[0] and text_2[0]: prompt is too long" in reply.json()["error"]["message"]


def test_llm_classifies_and_scores_pairs(cross_encoder):
    path, logit = cross_encoder
    with LLM(str(path), max_model_len=256, device="cpu") as llm:
        [probs] = llm.classify(SHORT)
        [raw] = llm.classify(LONG, activation=False)
        scores = llm.score(QUERY, DOCUMENTS[:2])
    assert close(probs.probs, [sigmoid(logit(SHORT))])
    assert close(raw.probs, [logit(LONG)])
    assert close([s.score for s in scores], [sigmoid(logit(QUERY, d)) for d in DOCUMENTS[:2]])


def test_a_causal_lm_read_as_a_reranker_scores_by_its_yes_and_no_logits(default_model_dir):
    """Qwen3-Reranker's way, as vLLM serves it: a causal LM with `hf_overrides` naming a
    classifier and `classifier_from_token: ["no", "yes"]` (`is_original_qwen3_reranker`):
    a pair's score is the probability of "yes" of the two at its last token, as the model's
    own usage computes it with transformers' causal LM."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    causal = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])

    def p_yes(*texts: str) -> float:
        with torch.no_grad():
            last = causal(torch.tensor([tokenizer(*texts).input_ids])).logits[0, -1]
        return float(torch.softmax(last[[no, yes]], dim=0)[1])

    overrides = {
        "architectures": ["LlamaForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    with LLM(
        str(default_model_dir),
        runner="pooling",
        hf_overrides=overrides,
        max_model_len=256,
        device="cpu",
    ) as llm:
        scores = [s.score for s in llm.score(QUERY, [*DOCUMENTS, "Yes.<|im_end|>"])]
        [one] = llm.classify(SHORT)
    # Its last token is read even where it is the padding token (<|im_end|> here).
    assert close(scores, [p_yes(QUERY, d) for d in [*DOCUMENTS, "Yes.<|im_end|>"]])
    assert close(one.probs, [p_yes(SHORT)])
    unknown = {**overrides, "classifier_from_token": ["no", "no such token"]}
    with pytest.raises(ValueError, match="classifier_from_token 'no such token' is not a token"):
        load_model(default_model_dir, hf_overrides=json.dumps(unknown))
