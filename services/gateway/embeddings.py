"""``POST /v1/embeddings``: OpenAI's body (and vLLM's extra fields) and its response;
vLLM's ``/score`` and ``/rerank`` on an embedding model, its ``/classify`` of a sequence
classifier, and its generic ``/pooling`` of either (what the model pools: the embedding, or
the scores per label).

Each input is one engine request on a server with the pooling runner; the response lists
their vectors in input order, as JSON floats or, with ``encoding_format: "base64"`` (what
the official ``openai`` client asks for by default), their float32 little-endian bytes in
base64. A score or a relevance is a cross-encoder's (a classifier of one label) of the two
texts encoded together, or with an embedding model the cosine similarity of the two texts'
embeddings (each distinct text embedded once), as vLLM scores. A classification is each
input's score per label, named by the classifier's config.json.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, Field

from weir.services.gateway.schemas import Options, Prompt, not_zero, prompt_list
from weir.shared.client import ClassificationOutput, EmbeddingOutput
from weir.shared.pooling import MAX_DIMENSIONS, score_pairs

# OpenAI's bound on the inputs of one request; each is an engine request.
MAX_EMBEDDING_INPUTS = 2048


class _InputFields(Options):
    """What the bodies of embeddings and classifications share: OpenAI's ``model``,
    ``input`` (a text, texts, token ids or lists of them), ``user``; vLLM's
    ``truncate_prompt_tokens``, ``priority``."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {"add_special_tokens": True}
    _ACCEPTED = frozenset(_NEUTRAL) | Options._IGNORED

    model: str | None = None
    input: Prompt
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), AfterValidator(not_zero)] | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0

    def inputs(self) -> list[str | list[int]]:
        """Each input as one prompt; ValueError for an empty list or too many inputs."""
        prompts = prompt_list("input", self.input)
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input has {len(prompts)} items; at most {MAX_EMBEDDING_INPUTS} per request"
            )
        return prompts


class EmbeddingRequest(_InputFields):
    """OpenAI's body, with its ``encoding_format`` and ``dimensions``; vLLM's
    ``normalize``."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    normalize: bool | None = None


class ClassificationRequest(_InputFields):
    """vLLM's ``POST /classify`` body, with its ``activation`` (false: the logits)."""

    activation: bool | None = None


class PoolingRequest(_InputFields):
    """vLLM's ``POST /pooling`` body: ``task`` (default: what the model serves, ``classify``
    for a sequence classifier, else ``embed``) and the fields of that task's own body."""

    task: Literal["embed", "classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    normalize: bool | None = None
    activation: bool | None = None

    def task_options(self, task: str) -> dict[str, Any]:
        """The options of ``task``'s engine requests; ValueError naming a field the task
        does not take."""
        given = {"dimensions": self.dimensions, "normalize": self.normalize}
        if task == "classify":
            given = {"activation": self.activation}
            wrong = "dimensions" if self.dimensions is not None else "normalize"
            if self.dimensions is not None or self.normalize is not None:
                raise ValueError(f"{wrong}: the classify task has no {wrong} (an embed task's)")
        elif self.activation is not None:
            raise ValueError("activation: the embed task has no activation (a classify task's)")
        return {
            **given,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "priority": self.priority,
        }


def _listed(kind: str, model: str, data: list[dict[str, Any]], num_tokens: int) -> dict[str, Any]:
    """A response listing ``data`` in input order, with its prompts' ``num_tokens``."""
    return {
        "id": f"{kind}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _vector(out: EmbeddingOutput | ClassificationOutput, encoding_format: str) -> Any:
    """Floats, or with ``base64`` their float32 little-endian bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(out.data).decode()
    return np.frombuffer(out.data, dtype="<f4").tolist()


def _num_tokens(outputs: Sequence[EmbeddingOutput | ClassificationOutput]) -> int:
    return sum(len(out.prompt_token_ids) for out in outputs)


def pooling_response(
    model: str, outputs: Sequence[EmbeddingOutput | ClassificationOutput], encoding_format: str
) -> dict[str, Any]:
    """vLLM's response: each input's pooled vector."""
    data = [
        {"index": index, "object": "pooling", "data": _vector(out, encoding_format)}
        for index, out in enumerate(outputs)
    ]
    response = _listed("pool", model, data, _num_tokens(outputs))
    response["usage"]["completion_tokens"] = 0
    return response


def classification_response(
    model: str, outputs: list[ClassificationOutput], labels: list[str]
) -> dict[str, Any]:
    """vLLM's response: each input's scores per label and the label that scores highest."""
    data = []
    for index, out in enumerate(outputs):
        probs = out.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(
            {"index": index, "label": labels[best], "probs": probs, "num_classes": len(probs)}
        )
    response = _listed("classify", model, data, _num_tokens(outputs))
    response["usage"]["completion_tokens"] = 0
    return response


def embedding_response(
    model: str, outputs: list[EmbeddingOutput], encoding_format: str
) -> dict[str, Any]:
    """OpenAI's response listing the embeddings in input order, with their prompt tokens."""
    data = [
        {"index": index, "object": "embedding", "embedding": _vector(out, encoding_format)}
        for index, out in enumerate(outputs)
    ]
    return _listed("embd", model, data, _num_tokens(outputs))


class _PairFields(Options):
    """What vLLM's score and rerank bodies share; ``activation`` (false: a cross-encoder's
    logit, not its probability)."""

    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), AfterValidator(not_zero)] | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0
    activation: bool | None = None


Texts = Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS, fail_fast=True)]


class ScoreRequest(_PairFields):
    """vLLM's ``POST /score``: ``text_1`` against each ``text_2`` (one text against many),
    or the pairs of two lists of one length."""

    text_1: str | Texts
    text_2: str | Texts

    def sides(self) -> tuple[list[str], list[str]]:
        """``text_1`` and ``text_2``, each as a list."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        return first, second

    def pairs(self) -> list[tuple[str, str]]:
        return score_pairs(self.text_1, self.text_2)


class RerankRequest(_PairFields):
    """vLLM's (Jina's, Cohere's) ``POST /rerank``: the ``documents`` ranked by relevance to
    the ``query``, the ``top_n`` best (0: all); each result with its document unless
    Cohere's ``return_documents`` is false (litellm's hosted_vllm rerank sends it)."""

    query: str
    documents: Texts
    top_n: Annotated[int, Field(ge=0)] = 0
    return_documents: bool = True


def score_response(model: str, scores: list[float], num_tokens: int) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    return _listed("score", model, data, num_tokens)


def rerank_response(
    model: str, body: RerankRequest, scores: list[float], num_tokens: int
) -> dict[str, Any]:
    # Best first; sorted is stable, so ties keep the documents' order.
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    results = [
        {"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
        if body.return_documents
        else {"index": i, "relevance_score": scores[i]}
        for i in ranked
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"total_tokens": num_tokens},
        "results": results[: body.top_n or None],
    }
