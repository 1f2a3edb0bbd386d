"""``POST /v1/embeddings``: OpenAI's body (and vLLM's extra fields) and its response.

Each input is one engine request on a server with the pooling runner; the response lists
their vectors in input order, as JSON floats or, with ``encoding_format: "base64"`` (what
the official ``openai`` client asks for by default), their float32 little-endian bytes in
base64.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field

from weir.services.gateway.schemas import Options, Prompt, not_zero
from weir.shared.client import EmbeddingOutput

# OpenAI's bound on the inputs of one request; each is an engine request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(Options):
    """OpenAI's ``model``, ``input`` (a text, texts, token ids or lists of them),
    ``encoding_format``, ``dimensions``, ``user``; vLLM's ``truncate_prompt_tokens``,
    ``normalize``, ``priority``."""

    _NEUTRAL: ClassVar[dict[str, Any]] = {"add_special_tokens": True}
    _ACCEPTED = frozenset(_NEUTRAL) | Options._IGNORED

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), AfterValidator(not_zero)] | None = None
    normalize: bool | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0

    def inputs(self) -> list[str | list[int]]:
        """Each input as one prompt; ValueError for an empty list or too many inputs."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if not given:
            raise ValueError("input must not be empty")
        if all(isinstance(t, int) for t in given):
            return [given]  # type: ignore[list-item]
        if len(given) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input has {len(given)} items; at most {MAX_EMBEDDING_INPUTS} per request"
            )
        return list(given)  # type: ignore[arg-type]


def embedding_response(
    model: str, outputs: list[EmbeddingOutput], encoding_format: str
) -> dict[str, Any]:
    """OpenAI's response listing the embeddings in input order, with their prompt tokens."""
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {
                "index": index,
                "object": "embedding",
                "embedding": base64.b64encode(out.data).decode()
                if encoding_format == "base64"
                else out.embedding,
            }
            for index, out in enumerate(outputs)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
