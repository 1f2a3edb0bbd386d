"""Sequence classifiers (reward models, moderation classifiers: `*ForSequenceClassification`
checkpoints), as vLLM's pooling runner serves them: `weir serve` finds one by its
architecture and answers `POST /classify` (vLLM's body and response), the SDK's `classify`
and `LLM.classify`, and every score is what transformers' AutoModelForSequenceClassification
computes from the same weights: the last token's final hidden state through the score head,
then a softmax over the labels (a sigmoid for one label), or the logits themselves when
asked. A classifier serves no embeddings and no generation."""

import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from serving_helpers import small_server

from weir.services import LLM
from weir.shared.client import InvalidRequestError, WeirClient

transformers = pytest.importorskip("transformers")

MODEL = "smol-classify"
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SHORT = "The service was quick and the food was good."
LONG = "A lighthouse keeper finds a message in a bottle and sets out to answer it. " * 6
TOLERANCE = 1e-4


def save_classifier(default_model_dir, path, labels: dict[int, str]):
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
        model.score.weight.normal_(0.0, 0.1)
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
    for index, item, prompt in zip([0, 1, 0], [*body["data"], one], [SHORT, LONG, ids]):
        want = softmax(logits(prompt))
        assert item["index"] == index and item["num_classes"] == 3
        assert close(item["probs"], want), (item["probs"], want)
        assert item["label"] == LABELS[int(want.argmax())]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 50

    raw = _post(server, "/classify", {"input": SHORT, "activation": False}).json()
    assert close(raw["data"][0]["probs"], logits(SHORT))


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
        ("/score", {"text_1": "a", "text_2": "b"}, 400, "POST /classify"),
        ("/v1/completions", {"prompt": SHORT}, 400, "serves classifications only"),
    ],
)
def test_what_a_classifier_refuses_gets_a_clear_error(server, route, body, status, words):
    reply = _post(server, route, {"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]
    assert _post(server, "/classify", {"input": SHORT}).status_code == 200


def test_one_label_scores_by_its_sigmoid_through_llm(default_model_dir, tmp_path):
    """A reward model's single label: its sigmoid (transformers' pipeline's choice), or
    the raw reward with ``activation=False``."""
    model = save_classifier(default_model_dir, tmp_path, {0: "LABEL_0"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    with torch.no_grad():
        want = [
            float(model(torch.tensor([tokenizer(p).input_ids])).logits[0, 0]) for p in (SHORT, LONG)
        ]
    with LLM(str(tmp_path), max_model_len=256, device="cpu") as llm:
        probs = [out.probs for out in llm.classify([SHORT, LONG])]
        [raw] = llm.classify(SHORT, activation=False)
    assert close(probs, [[1 / (1 + np.exp(-w))] for w in want])
    assert close(raw.probs, [want[0]])
