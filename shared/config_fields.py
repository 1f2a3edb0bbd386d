"""Typed reads of a Hugging Face config.json's keys: each ValueError names the key and what
it holds."""

import json
import math
from typing import Any


def json_object(name: str, value: Any) -> dict[str, Any]:
    """An option or file given as a JSON object's text (or, from Python, as a dict), as a
    dict; ValueError names ``name``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{name} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def mapping(hf: dict[str, Any], key: str) -> dict[str, Any]:
    value = hf.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"config.json: {key} must be an object, got {value!r}")
    return {k: v for k, v in value.items() if v is not None}


def count(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ValueError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def size(hf: dict[str, Any], key: str, default: int = 0) -> int:
    """An integer that may be 0 (a count of optional things)."""
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: {key} must be an integer >= 0, got {value!r}")
    return value


def layer_types(
    hf: dict[str, Any], num_layers: int, kinds: tuple[str, ...], default: list[str] | None = None
) -> list[str] | None:
    """config.json's layer_types (``default`` where it has none), one of ``kinds`` per layer."""
    types = hf.get("layer_types", default)
    if types is not None and (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in kinds for t in types)
    ):
        raise ValueError(
            f"config.json: layer_types must name {kinds} for each of the {num_layers} "
            f"layers, got {types!r}"
        )
    return types


def positive(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"config.json: {key} must be finite, got {value!r}")
    return float(value)


def flag(hf: dict[str, Any], key: str, default: bool = False) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {key} must be true or false, got {value!r}")
    return value
