"""Embeddings: how a server pools a prompt's hidden states, and what a request may ask.

A server started with ``--runner pooling`` (or found to hold an embedding model) answers
pooling requests instead of generating: each prompt's last-layer hidden states (after the
final norm) are pooled into one vector, as vLLM's pooling runner does. ``PoolerConfig`` is
the server's choice, read from a sentence-transformers model's ``modules.json`` and
``1_Pooling/config.json`` (vLLM reads them too), overridden by ``--pooler-config``;
``PoolingParams`` what one request adds (Matryoshka ``dimensions``, ``normalize``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weir.shared.config_fields import json_object
from weir.shared.model_config import read_json

RUNNERS = ("auto", "generate", "pooling")
MAX_DIMENSIONS = 2**31 - 1
# LAST: the prompt's last token's state (causal decoders' embedders: Qwen3-Embedding,
# e5-mistral, gte-Qwen2); MEAN: the average over every prompt token; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
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
    """One embedding request's options (vLLM's ``PoolingParams``): ``dimensions`` keeps the
    first n of a Matryoshka model's dimensions (before normalizing); ``normalize`` None
    takes the server's pooler config."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            type(self.dimensions) is not int or not 1 <= self.dimensions <= MAX_DIMENSIONS
        ):
            raise ValueError(
                f"dimensions must be an int in [1, {MAX_DIMENSIONS}], got {self.dimensions!r:.40}"
            )
        if self.normalize is not None and type(self.normalize) is not bool:
            raise ValueError(f"normalize must be a bool, got {type(self.normalize).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions, "normalize": self.normalize}

    @classmethod
    def from_dict(cls, value: Any) -> PoolingParams:
        if type(value) is not dict:
            raise ValueError(f"pooling_params must be a map, got {type(value).__name__}")
        unknown = set(value) - {"dimensions", "normalize"}
        if unknown:
            raise ValueError(f"pooling_params: unknown field {sorted(map(str, unknown))[0]!r}")
        return cls(value.get("dimensions"), value.get("normalize"))


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """How a pooling server turns a prompt into one vector. ``dimensions``: the Matryoshka
    sizes a request may ask for (() when the model is not Matryoshka, None: any)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    dimensions: tuple[int, ...] | None = ()

    def check(self, params: PoolingParams) -> None:
        """ValueError if this server cannot honour ``params``."""
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

    def finish(self, pooled: bytes, params: PoolingParams) -> bytes:
        """A request's embedding from the executor's pooled float32 vector: cut to its
        dimensions, then normalized (L2) unless it or the server says not to."""
        vector = np.frombuffer(pooled, dtype="<f4")[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            vector = vector / max(norm, 1e-12)  # as torch's F.normalize
        return vector.astype("<f4").tobytes()


def is_embedding_model(model_dir: str | os.PathLike[str]) -> bool:
    """A sentence-transformers model (a Pooling module), or a checkpoint of the bare
    transformer (``*Model`` architectures, which have no LM head): what ``--runner auto``
    serves with the pooling runner."""
    model_dir = Path(model_dir)
    if any(m.get("type") == _ST_POOLING for m in _modules(model_dir)):
        return True
    architectures = read_json(model_dir / "config.json").get("architectures") or []
    return bool(architectures) and all(
        isinstance(a, str) and a.endswith("Model") for a in architectures
    )


def resolve_runner(runner: str, model_dir: str | os.PathLike[str]) -> str:
    """``generate`` or ``pooling``: ``runner`` itself unless it is ``auto``."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner != "auto":
        return runner
    return "pooling" if is_embedding_model(model_dir) else "generate"


def read_pooler_config(
    model_dir: str | os.PathLike[str], hidden_size: int, override: str | None = None
) -> PoolerConfig:
    """The pooler of a model directory: LAST with normalization (vLLM's embedding default),
    unless its sentence-transformers files say otherwise, then ``override`` (JSON text of
    ``pooling_type`` and ``normalize``, ``--pooler-config``) over both. ValueError names
    what cannot be served."""
    model_dir = Path(model_dir)
    given = _override(override)
    pooling_type, normalize = "LAST", True
    modules = _modules(model_dir)
    for module in modules:
        if module.get("type") == _ST_POOLING and "pooling_type" not in given:
            pooling_type = _st_pooling_type(model_dir / str(module.get("path", "")))
    if modules:
        normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling_type = given.get("pooling_type", pooling_type)
    normalize = given.get("normalize", normalize)
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
    if type(normalize) is not bool:
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(pooling_type, normalize, hidden_size, _matryoshka(model_dir))


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
