"""Embeddings and classifications: how a server pools a prompt's hidden states, and what a
request may ask.

A server started with ``--runner pooling`` (or found to hold an embedding model or a
sequence classifier) answers pooling requests instead of generating: each prompt's
last-layer hidden states (after the final norm) are pooled into one vector, as vLLM's
pooling runner does; a classifier's executor then applies its score head, so the vector is
the labels' logits. ``PoolerConfig`` is the server's choice, read from a sentence-transformers
model's ``modules.json`` and ``1_Pooling/config.json`` (vLLM reads them too), or a
classifier's ``config.json`` (its labels, and the activation transformers' pipeline applies),
overridden by ``--pooler-config``; ``PoolingParams`` what one request adds (its task, and
Matryoshka ``dimensions`` and ``normalize`` of an embedding, ``activation`` of a
classification).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weir.shared.config_fields import json_object
from weir.shared.model_config import read_hf_config, read_json

RUNNERS = ("auto", "generate", "pooling")
MAX_DIMENSIONS = 2**31 - 1
# LAST: the prompt's last token's state (causal decoders' embedders: Qwen3-Embedding,
# e5-mistral, gte-Qwen2); MEAN: the average over every prompt token; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# What a pooling request asks: an embedding model's vector, a classifier's label scores, or
# a one-label classifier's score of a pair of texts (a cross-encoder, as rerankers are).
TASKS = ("embed", "classify", "score")
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's ``PoolingParams``): its ``task``; an
    embedding's ``dimensions`` keeps the first n of a Matryoshka model's dimensions (before
    normalizing), ``normalize`` None takes the server's pooler config; a classification's
    or a score's ``activation`` False returns the raw logits (None, True: the
    probabilities); a score's ``text_pair`` is the text its prompt is paired with (encoded
    together, as the tokenizer encodes a pair)."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    activation: bool | None = None
    text_pair: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            type(self.dimensions) is not int or not 1 <= self.dimensions <= MAX_DIMENSIONS
        ):
            raise ValueError(
                f"dimensions must be an int in [1, {MAX_DIMENSIONS}], got {self.dimensions!r:.40}"
            )
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and type(value) is not bool:
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r:.40}")
        misplaced = (
            (self.activation,) if self.task == "embed" else (self.dimensions, self.normalize)
        )
        if any(value is not None for value in misplaced):
            raise ValueError(
                "activation is a classification's option, dimensions and normalize an embedding's"
            )
        if self.text_pair is not None and type(self.text_pair) is not str:
            raise ValueError(f"text_pair must be a string, got {type(self.text_pair).__name__}")
        if (self.task == "score") != (self.text_pair is not None):
            raise ValueError("a score pairs its prompt with one text_pair (a string); only a score")

    def to_dict(self) -> dict[str, Any]:
        return {
            "dimensions": self.dimensions,
            "normalize": self.normalize,
            "task": self.task,
            "activation": self.activation,
            "text_pair": self.text_pair,
        }

    @classmethod
    def from_dict(cls, value: Any) -> PoolingParams:
        if type(value) is not dict:
            raise ValueError(f"pooling_params must be a map, got {type(value).__name__}")
        unknown = set(value) - {"dimensions", "normalize", "task", "activation", "text_pair"}
        if unknown:
            raise ValueError(f"pooling_params: unknown field {sorted(map(str, unknown))[0]!r}")
        return cls(
            value.get("dimensions"),
            value.get("normalize"),
            value.get("task", "embed"),
            value.get("activation"),
            value.get("text_pair"),
        )


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """How a pooling server turns a prompt into one vector. ``dimensions``: the Matryoshka
    sizes a request may ask for (() when the model is not Matryoshka, None: any). A
    classifier's ``labels`` name its logits, which ``activation`` (ACTIVATIONS) turns into
    scores; an embedding model has none."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    dimensions: tuple[int, ...] | None = ()
    labels: tuple[str, ...] = ()
    activation: str = "softmax"
    # A classifier's padding token (config.json's pad_token_id), which its LAST pooling skips.
    pad_token_id: int | None = None

    def check(self, params: PoolingParams) -> None:
        """ValueError if this server cannot honour ``params``."""
        if self.labels and params.task == "embed":
            raise ValueError(
                "this server's model is a sequence classifier: it classifies (POST /classify, "
                "the SDK's classify) and has no embeddings"
            )
        if not self.labels and params.task == "score":
            raise ValueError(
                "this server's model is an embedding model, not a cross-encoder: a pair is "
                "scored by the cosine of its texts' embeddings (embed each; HTTP /score and "
                "LLM.score do)"
            )
        if not self.labels and params.task != "embed":
            raise ValueError(
                "this server's model is an embedding model, not a sequence classifier "
                "(a *ForSequenceClassification architecture): it has no labels to classify by"
            )
        if params.task == "score" and len(self.labels) != 1:
            raise ValueError(
                f"this server's classifier has {len(self.labels)} labels: only a classifier of "
                "one label (a cross-encoder) scores a pair of texts"
            )
        wanted = params.dimensions
        if wanted is None or wanted == self.hidden_size:
            return
        if self.dimensions == ():
            raise ValueError(
                f"dimensions {wanted}: this model is not a Matryoshka model (its config.json "
                "has no is_matryoshka or matryoshka_dimensions), so it has only its "
                f"{self.hidden_size}; leave dimensions out"
            )
        if wanted > self.hidden_size or (self.dimensions and wanted not in self.dimensions):
            sizes = self.dimensions or f"1 to {self.hidden_size}"
            raise ValueError(
                f"dimensions {wanted}: this model's embeddings can have {sizes} dimensions (or "
                f"all {self.hidden_size}, as when dimensions is left out)"
            )

    def prompt_to_pool(self, ids: list[int]) -> list[int]:
        """The prompt a classifier's LAST pooling reads: transformers' classifiers read the
        last token that is not their padding token (the first token if all are), so the
        padding tokens after it, whose states no earlier token's depends on, are dropped."""
        if not self.labels or self.pooling_type != "LAST" or self.pad_token_id is None:
            return ids
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad_token_id:
            end -= 1
        return ids[:end]

    def finish(self, pooled: bytes, params: PoolingParams) -> bytes:
        """A request's embedding from the executor's pooled float32 vector: cut to its
        dimensions, then normalized (L2) unless it or the server says not to; a
        classification's scores from its logits, by the activation unless it asks for none."""
        vector = np.frombuffer(pooled, dtype="<f4")[: params.dimensions]
        if self.labels:
            if params.activation is False or self.activation == "none":
                return pooled
            logits = vector.astype(np.float64)
            if self.activation == "sigmoid":
                return (1 / (1 + np.exp(-logits))).astype("<f4").tobytes()
            exp = np.exp(logits - logits.max())
            softmax: np.ndarray = exp / exp.sum()
            return softmax.astype("<f4").tobytes()
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            vector = vector / max(norm, 1e-12)  # as torch's F.normalize
        return vector.astype("<f4").tobytes()


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's score inputs as pairs: ``text_1`` against each ``text_2`` (one text against
    many), or the pairs of two lists of one length; ValueError otherwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        first *= len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: send one text_1, or "
            "as many as text_2"
        )
    return list(zip(first, second))


def cosine(a: bytes, b: bytes) -> float:
    """The cosine similarity of two float32 vectors' bytes, in [-1, 1] (0 when one is all
    zeros): how an embedding model scores a pair of texts."""
    x = np.frombuffer(a, dtype="<f4").astype(np.float64)
    y = np.frombuffer(b, dtype="<f4").astype(np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return min(1.0, max(-1.0, float(x @ y / norms))) if norms else 0.0


def is_embedding_model(model_dir: str | os.PathLike[str]) -> bool:
    """A sentence-transformers model (a Pooling module), or a checkpoint of the bare
    transformer (``*Model`` architectures, which have no LM head)."""
    model_dir = Path(model_dir)
    if any(m.get("type") == _ST_POOLING for m in _modules(model_dir)):
        return True
    architectures = read_json(model_dir / "config.json").get("architectures") or []
    return bool(architectures) and all(
        isinstance(a, str) and a.endswith("Model") for a in architectures
    )


def resolve_runner(runner: str, model_dir: str | os.PathLike[str], num_labels: int = 0) -> str:
    """``generate`` or ``pooling``: ``runner`` itself unless it is ``auto``, which pools an
    embedding model and a sequence classifier (``num_labels``, its config's labels)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner != "auto":
        return runner
    return "pooling" if num_labels or is_embedding_model(model_dir) else "generate"


def read_pooler_config(
    model_dir: str | os.PathLike[str],
    hidden_size: int,
    override: str | None = None,
    num_labels: int = 0,
    reads_last_token: bool = False,
    hf_overrides: str | None = None,
) -> PoolerConfig:
    """The pooler of a model directory: LAST with normalization (vLLM's embedding default),
    unless its sentence-transformers files say otherwise, then ``override`` (JSON text of
    ``pooling_type`` and ``normalize``, ``--pooler-config``) over both; a classifier's
    (``num_labels`` of them) LAST, unnormalized, with its labels, past its padding tokens
    unless it ``reads_last_token`` (a causal LM made a classifier, as its own usage reads
    it), from config.json with ``hf_overrides`` over it. ValueError names what cannot be
    served."""
    model_dir = Path(model_dir)
    given = _override(override)
    if num_labels:
        if "normalize" in given:
            raise ValueError("pooler_config: a sequence classifier's logits are not normalized")
        config = read_hf_config(model_dir, hf_overrides)
        return PoolerConfig(
            _pooling_type(given.get("pooling_type", "LAST")),
            False,
            num_labels,
            labels=_labels(config, num_labels),
            activation=_activation(config, num_labels),
            pad_token_id=pad
            if type(pad := config.get("pad_token_id")) is int and not reads_last_token
            else None,
        )
    pooling_type, normalize = "LAST", True
    modules = _modules(model_dir)
    for module in modules:
        if module.get("type") == _ST_POOLING and "pooling_type" not in given:
            pooling_type = _st_pooling_type(model_dir / str(module.get("path", "")))
    if modules:
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling_type = given.get("pooling_type", pooling_type)
    normalize = given.get("normalize", normalize)
    pooling_type = _pooling_type(pooling_type)
    if type(normalize) is not bool:
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(pooling_type, normalize, hidden_size, _matryoshka(model_dir))


def _pooling_type(name: Any) -> str:
    if name not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {name!r}")
    return str(name)


def _labels(config: dict[str, Any], num_labels: int) -> tuple[str, ...]:
    """The labels' names by their index (config.json's id2label; LABEL_i where it has none)."""
    names = config.get("id2label") or {}
    if not isinstance(names, dict):
        raise ValueError(f"config.json: id2label must be an object, got {names!r:.80}")
    return tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(num_labels))


def _activation(config: dict[str, Any], num_labels: int) -> str:
    """What turns a classifier's logits into its scores, as transformers' text-classification
    pipeline chooses: a sigmoid for one label or several independent ones, nothing for a
    regression, else a softmax."""
    problem = config.get("problem_type")
    if problem == "regression":
        return "none"
    return "sigmoid" if num_labels == 1 or problem == "multi_label_classification" else "softmax"


def _override(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    given = json_object("pooler_config", text)
    unknown = set(given) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(
            f"pooler_config: unknown key {sorted(unknown)[0]!r} (it takes pooling_type and "
            "normalize)"
        )
    return given


def _modules(model_dir: Path) -> list[dict[str, Any]]:
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of modules")
    for module in modules:
        if module.get("type") not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE):
            raise ValueError(
                f"{path}: module {module.get('type')!r} changes the embeddings and Weir does "
                "not implement it (it serves Transformer, Pooling and Normalize)"
            )
    return modules


def _st_pooling_type(directory: Path) -> str:
    config = read_json(directory / "config.json")
    if config.get("include_prompt", True) is not True:
        raise ValueError(
            f"{directory / 'config.json'}: include_prompt false (pooling without the "
            "instruction's tokens) is not supported"
        )
    modes = [mode for key, mode in _ST_POOLING_MODES.items() if config.get(key)]
    other = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    if len(other) != 1 or len(modes) != 1:
        raise ValueError(
            f"{directory / 'config.json'}: pooling {other or 'none'} cannot be served (Weir "
            "pools with exactly one of lasttoken, mean_tokens, cls_token); start with "
            '--pooler-config \'{"pooling_type": "LAST"}\' to choose'
        )
    return modes[0]


def _matryoshka(model_dir: Path) -> tuple[int, ...] | None:
    config = read_json(model_dir / "config.json")
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and all(type(s) is int and s > 0 for s in sizes):
        return tuple(sizes)
    return None if config.get("is_matryoshka") is True else ()
