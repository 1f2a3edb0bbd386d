"""The sampling defaults a model's creator recommends in its ``generation_config.json``
(Qwen3's temperature 0.6, top_p 0.95, top_k 20...), which vLLM applies to every request that
leaves those parameters out (its ``--generation-config auto``, the default).

Read are ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (``max_tokens``: it also caps a request's own, as in vLLM); a key the file
leaves out, or null, keeps Weir's default. ``vllm`` reads none; a directory reads its file;
``--override-generation-config`` (JSON in the file's keys) goes over either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weir.shared.config_fields import json_object
from weir.shared.sampling import SamplingParams

# generation_config.json's key -> SamplingParams' field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_sampling_defaults(
    source: str, model_dir: str | Path, override: str | None = None
) -> dict[str, float | int]:
    """``source``: ``auto`` (the model directory's file), ``vllm`` (no defaults) or a
    directory holding a ``generation_config.json``; ``override``: JSON in the file's keys,
    over it (vLLM's ``--override-generation-config``). Returns SamplingParams' fields; a
    malformed file or override is a ValueError naming it and the key."""
    config: dict[str, Any] = {}
    sources = []
    if source != "vllm":
        path = (Path(model_dir) if source == "auto" else Path(source)) / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        if path.is_file():
            config = json_object(str(path), path.read_text(encoding="utf-8"))
            sources.append(str(path))
    if override is not None:
        config = {**config, **json_object("--override-generation-config", override)}
        sources.append("--override-generation-config")
    defaults = {field: config[key] for key, field in _KEYS.items() if config.get(key) is not None}
    try:
        params = SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{' with '.join(sources)}: {exc}") from None
    return {field: getattr(params, field) for field in defaults}


def with_defaults(defaults: dict[str, Any], **given: Any) -> dict[str, Any]:
    """``given`` sampling fields (None: left out by the request) over ``defaults`` (a
    ``read_sampling_defaults`` result). ``max_tokens`` is always given (None: to the context)
    and capped by the default's."""
    merged = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    cap, asked = defaults.get("max_tokens"), given["max_tokens"]
    merged["max_tokens"] = cap if asked is None else asked if cap is None else min(asked, cap)
    return merged


def default_params(defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams of a request that sets none: Weir's defaults under ``defaults``."""
    return SamplingParams(**defaults)
