"""How a pooling server is configured: which runner a model gets, how it pools (its
sentence-transformers files, --pooler-config over them), and what a request may ask."""

import json

import numpy as np
import pytest

from weir.shared.config import EngineArgs
from weir.shared.pooling import PoolerConfig, PoolingParams, read_pooler_config, resolve_runner

HIDDEN = 8


def _model(path, architectures=("LlamaForCausalLM",), pooling=None, normalize=False, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": list(architectures), **config}))
    if pooling is not None:
        modules = [{"type": "sentence_transformers.models.Transformer", "path": ""}]
        modules.append({"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"})
        if normalize:
            modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_Norm"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


def test_the_runner_follows_the_model_unless_given(tmp_path):
    causal = _model(tmp_path / "causal")
    bare = _model(tmp_path / "bare", architectures=("Qwen3Model",))
    st = _model(tmp_path / "st", pooling={"pooling_mode_lasttoken": True})
    assert resolve_runner("auto", causal) == "generate"
    assert resolve_runner("auto", bare) == "pooling"
    assert resolve_runner("auto", st) == "pooling"
    assert resolve_runner("pooling", causal) == "pooling"
    assert resolve_runner("generate", st) == "generate"
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", causal)
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineArgs(runner="embed")


def test_sentence_transformers_files_set_the_pooler_and_the_flag_overrides_them(tmp_path):
    assert read_pooler_config(_model(tmp_path / "plain"), HIDDEN) == PoolerConfig(
        "LAST", True, HIDDEN, ()
    )
    mean = _model(tmp_path / "mean", pooling={"pooling_mode_mean_tokens": True})
    config = read_pooler_config(mean, HIDDEN)
    assert (config.pooling_type, config.normalize) == ("MEAN", False)
    cls = _model(tmp_path / "cls", pooling={"pooling_mode_cls_token": True}, normalize=True)
    config = read_pooler_config(cls, HIDDEN)
    assert (config.pooling_type, config.normalize) == ("CLS", True)
    config = read_pooler_config(cls, HIDDEN, '{"pooling_type": "LAST", "normalize": false}')
    assert (config.pooling_type, config.normalize) == ("LAST", False)


@pytest.mark.parametrize(
    ("pooling", "override", "words"),
    [
        ({"pooling_mode_weightedmean_tokens": True}, None, "cannot be served"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None, "cannot be"),
        (None, "{", "not JSON"),
        (None, "[1]", "must be a JSON object"),
        (None, '{"pooling_type": "MAX"}', "pooling_type must be one of"),
        (None, '{"normalize": "yes"}', "normalize must be true or false"),
        (None, '{"softmax": true}', "unknown key 'softmax'"),
        ({"pooling_mode_mean_tokens": True, "include_prompt": False}, None, "include_prompt"),
    ],
)
def test_a_pooler_weir_cannot_serve_is_refused_by_name(tmp_path, pooling, override, words):
    model = _model(tmp_path / "m", pooling=pooling)
    with pytest.raises(ValueError, match=words):
        read_pooler_config(model, HIDDEN, override)


def test_a_module_that_changes_the_embeddings_is_refused(tmp_path):
    """A Dense projection after the pooling (some sentence-transformers models have one)
    would be skipped: such a model is refused, not served wrong."""
    model = _model(tmp_path / "m", pooling={"pooling_mode_mean_tokens": True})
    modules = json.loads((model / "modules.json").read_text())
    modules.append({"type": "sentence_transformers.models.Dense", "path": "2_Dense"})
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="models.Dense' changes the embeddings"):
        read_pooler_config(model, HIDDEN)


def test_a_choice_of_pooling_type_serves_a_model_whose_own_weir_cannot(tmp_path):
    model = _model(tmp_path / "m", pooling={"pooling_mode_weightedmean_tokens": True})
    assert read_pooler_config(model, HIDDEN, '{"pooling_type": "MEAN"}').pooling_type == "MEAN"


def test_dimensions_only_for_matryoshka_models(tmp_path):
    plain = read_pooler_config(_model(tmp_path / "plain"), HIDDEN)
    plain.check(PoolingParams(HIDDEN))  # all of them is no change
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        plain.check(PoolingParams(4))
    free = read_pooler_config(_model(tmp_path / "free", is_matryoshka=True), HIDDEN)
    free.check(PoolingParams(3))
    with pytest.raises(ValueError, match="can have 1 to 8 dimensions"):
        free.check(PoolingParams(9))
    listed = _model(tmp_path / "listed", matryoshka_dimensions=[2, 4, 8])
    sizes = read_pooler_config(listed, HIDDEN)
    sizes.check(PoolingParams(4))
    with pytest.raises(ValueError, match=r"can have \(2, 4, 8\)"):
        sizes.check(PoolingParams(3))


def test_an_embedding_is_cut_to_its_dimensions_then_normalized():
    raw = np.arange(1, HIDDEN + 1, dtype="<f4")
    config = PoolerConfig("LAST", True, HIDDEN, None)

    def finish(params: PoolingParams) -> np.ndarray:
        return np.frombuffer(config.finish(raw.tobytes(), params), dtype="<f4")

    np.testing.assert_allclose(finish(PoolingParams()), raw / np.linalg.norm(raw), rtol=1e-6)
    np.testing.assert_allclose(finish(PoolingParams(3)), raw[:3] / np.linalg.norm(raw[:3]))
    np.testing.assert_array_equal(finish(PoolingParams(3, normalize=False)), raw[:3])
    zeros = np.frombuffer(config.finish(bytes(4 * HIDDEN), PoolingParams()), dtype="<f4")
    assert not np.isnan(zeros).any()


def test_a_classifier_takes_the_pooling_runner_and_scores_as_transformers_pipeline(tmp_path):
    """Its labels from id2label, and the activation transformers' text-classification
    pipeline applies: softmax over several labels, sigmoid for one or for multi-label
    problems, none for a regression."""
    arch = ("Qwen3ForSequenceClassification",)
    labels = {"0": "safe", "1": "unsafe", "2": "unsure"}
    model = _model(tmp_path / "three", arch, id2label=labels)
    assert resolve_runner("auto", model) == "generate"
    assert resolve_runner("auto", model, num_labels=3) == "pooling"
    config = read_pooler_config(model, HIDDEN, num_labels=3)
    assert (config.labels, config.activation, config.normalize) == (
        ("safe", "unsafe", "unsure"),
        "softmax",
        False,
    )
    one = read_pooler_config(_model(tmp_path / "one", arch), HIDDEN, num_labels=1)
    assert (one.labels, one.activation) == (("LABEL_0",), "sigmoid")
    multi = _model(tmp_path / "multi", arch, problem_type="multi_label_classification")
    assert read_pooler_config(multi, HIDDEN, num_labels=2).activation == "sigmoid"
    regression = _model(tmp_path / "regression", arch, problem_type="regression")
    assert read_pooler_config(regression, HIDDEN, num_labels=2).activation == "none"
    with pytest.raises(ValueError, match="logits are not normalized"):
        read_pooler_config(model, HIDDEN, '{"normalize": true}', num_labels=3)

    logits = np.array([2.0, -1.0, 0.5], dtype="<f4")

    def finish(pooler: PoolerConfig, params: PoolingParams) -> np.ndarray:
        return np.frombuffer(pooler.finish(logits.tobytes(), params), dtype="<f4")

    classify = PoolingParams(task="classify")
    e = np.exp(logits - logits.max())
    np.testing.assert_allclose(finish(config, classify), e / e.sum(), rtol=1e-6)
    np.testing.assert_array_equal(
        finish(config, PoolingParams(task="classify", activation=False)), logits
    )
    sigmoid = read_pooler_config(multi, HIDDEN, num_labels=3)
    np.testing.assert_allclose(finish(sigmoid, classify), 1 / (1 + np.exp(-logits)), rtol=1e-6)
    np.testing.assert_array_equal(
        finish(read_pooler_config(regression, HIDDEN, num_labels=3), classify), logits
    )


def test_a_request_asks_the_task_the_server_serves():
    embedder = PoolerConfig("LAST", True, HIDDEN)
    classifier = PoolerConfig("LAST", False, 2, labels=("no", "yes"))
    with pytest.raises(ValueError, match="embedding model, not a sequence classifier"):
        embedder.check(PoolingParams(task="classify"))
    with pytest.raises(ValueError, match="sequence classifier: it classifies"):
        classifier.check(PoolingParams())
    classifier.check(PoolingParams(task="classify", activation=False))
    for misplaced in (
        {"task": "classify", "dimensions": 4},
        {"task": "classify", "normalize": False},
        {"activation": True},
    ):
        with pytest.raises(ValueError, match="activation is a classification's option"):
            PoolingParams(**misplaced)
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="rerank")
    for unpaired in ({"task": "score"}, {"task": "classify", "text_pair": "b"}):
        with pytest.raises(ValueError, match="a score pairs its prompt with one text_pair"):
            PoolingParams(**unpaired)
    # Any other type is refused as such, whatever the task (an embedding's was let through,
    # then failed the frontend as an internal error).
    for task in ("embed", "score"):
        for pair in (5, b"x", [], False):
            with pytest.raises(ValueError, match="text_pair must be a string, got"):
                PoolingParams(task=task, text_pair=pair)
    score = PoolingParams(task="score", text_pair="a document")
    with pytest.raises(ValueError, match="has 2 labels: only a classifier of one label"):
        classifier.check(score)
    PoolerConfig("LAST", False, 1, labels=("relevant",)).check(score)
    with pytest.raises(ValueError, match="not a cross-encoder: a pair is scored by the cosine"):
        embedder.check(score)
    for params in (PoolingParams(task="classify", activation=False), score):
        assert PoolingParams.from_dict(params.to_dict()) == params
    assert PoolingParams.from_dict({"dimensions": 4}) == PoolingParams(4)


def test_a_classifier_reads_the_last_token_that_is_not_padding_as_transformers_does(tmp_path):
    model = _model(tmp_path / "padded", ("LlamaForSequenceClassification",), pad_token_id=2)
    last = read_pooler_config(model, HIDDEN, num_labels=2)
    assert last.prompt_to_pool([5, 2, 7, 2, 2]) == [5, 2, 7]
    assert last.prompt_to_pool([2, 2]) == [2]  # transformers' argmax of no match: the first
    mean = read_pooler_config(model, HIDDEN, '{"pooling_type": "MEAN"}', num_labels=2)
    assert mean.prompt_to_pool([5, 2, 2]) == [5, 2, 2]
    assert PoolerConfig().prompt_to_pool([5, 2, 2]) == [5, 2, 2]


def test_a_classifiers_labels_follow_hf_overrides_and_a_malformed_one_is_named(tmp_path):
    model = _model(tmp_path / "m", ("LlamaForSequenceClassification",), id2label={"0": "a"})
    overrides = (
        '{"id2label": {"0": "no", "1": "yes"}, "problem_type": "multi_label_classification"}'
    )
    config = read_pooler_config(model, HIDDEN, num_labels=2, hf_overrides=overrides)
    assert (config.labels, config.activation) == (("no", "yes"), "sigmoid")
    with pytest.raises(ValueError, match="id2label must be an object"):
        read_pooler_config(model, HIDDEN, num_labels=2, hf_overrides='{"id2label": ["a", "b"]}')
