"""How a model's rotary embedding turns positions into angles, read from config.json as
transformers reads it (its ``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``).

Types: ``default``, ``linear``, ``llama3``, ``yarn`` (static: one set of frequencies and a
scale on cos and sin) and ``longrope`` (Phi-3.5's and Phi-4-mini's: short factors below
``original_max_position``, long ones past it). transformers picks LongRoPE's factors per
forward pass by the sequence's length; as it runs a cached generation, a token at position p
of a request whose prompt has P tokens rotates by the long factors when max(P, p + 1) is more
than ``original_max_position`` (the whole prompt of a long prompt, the tokens past the
original context of a short one). Weir applies that rule per token, so chunked prefill,
preemption and drafts rotate every token as one cached generation does. ``dynamic`` (NTK by
the current length) is refused, but with Hunyuan's fixed ``alpha`` (a static larger base);
Qwen-VL's ``mrope`` turns a text as ``default``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weir.shared.config_fields import count, flag, mapping, positive

# Added to the position of a token LongRoPE's long factors rotate, on its way to the model:
# past any context, so one int64 position carries both.
LONG_ROTATION = 1 << 40
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
# Where a config's partial_rotary_factor is applied as transformers applies it.
_PARTIAL_ROTARY_MODELS = (
    "phi3",
    "glm4_moe",
    "glm4",
    "minimax_m2",
    "mistral4",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
)
# Models whose sliding layers rotate by a base of their own, unscaled: the (full, sliding)
# bases where rope_parameters names none, as transformers defaults them (Gemma 3's local base
# is rope_local_base_freq; OLMo 3's sliding layers take its default base, 500000, whatever
# a legacy top-level rope_theta says: transformers pops that key for the full layers only).
_PER_LAYER_TYPE_ROPE: dict[str, Callable[[dict[str, Any]], tuple[Any, Any]]] = {
    "gemma3_text": lambda hf: (
        hf.get("rope_theta", 1_000_000.0),
        hf.get("rope_local_base_freq", 10_000.0),
    ),
    "olmo3": lambda hf: (hf.get("rope_theta", 500_000.0), 500_000.0),
    "gemma4_text": lambda hf: (1_000_000.0, 10_000.0),
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # channels of a head that rotate: the first ones (Phi-4-mini: 3/4)
    type: str = "default"
    factor: float = 1.0  # linear, llama3, yarn: how much the context was stretched
    original_max_position: int = 0  # the pretraining context (llama3, yarn, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn: the rotations that bound its ramp
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope: a divisor per rotated channel pair
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn's and longrope's)
    # proportional (Gemma 4's full layers): the share of each head's channel pairs that turn,
    # at the frequencies a whole head's rotation gives them; the others turn by 0.
    proportion: float = 1.0

    @property
    def long_prompt_threshold(self) -> int | None:
        """LongRoPE's original context: a prompt longer than this rotates by the long
        factors from its first token, so its KV differs from a shorter prompt's. None for
        the other types, whose rotation depends on the position only."""
        return self.original_max_position if self.type == "longrope" else None


def read_rope(
    hf: dict[str, Any],
    model_type: str,
    head_dim: int,
    max_pos: int,
    full_head_dim: int | None = None,
) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotation of the (full-attention) layers, of heads of ``full_head_dim`` channels
    (Gemma 4's larger than its sliding layers' ``head_dim``; None: head_dim), and Gemma 3's, Gemma 4's and
    OLMo 3's sliding layers' (their own base, unscaled; None elsewhere). ValueError names
    what is malformed or refused."""
    local: RopeConfig | None = None
    if model_type in _PER_LAYER_TYPE_ROPE:
        full_theta, local_theta = _PER_LAYER_TYPE_ROPE[model_type](hf)
        params = mapping(hf, "rope_parameters")
        full = {
            "rope_theta": full_theta,
            **(mapping(params, "full_attention") if params else {}),
            **mapping(hf, "rope_scaling"),
        }
        sliding = mapping(params, "sliding_attention") if params else {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(
                f"config.json: unsupported rope type {sliding['rope_type']!r} of the sliding layers"
            )
        theta = sliding.get("rope_theta", local_theta)
        local = RopeConfig(
            theta=positive({"rope_theta": theta}, "rope_theta", 0), rotary_dim=head_dim
        )
    else:
        # Where a file has both, transformers lets the legacy rope_scaling win.
        full = {**mapping(hf, "rope_parameters"), **mapping(hf, "rope_scaling")}
    return _scaled(full, hf, model_type, full_head_dim or head_dim, max_pos), local


def _scaled(
    rope: dict[str, Any], hf: dict[str, Any], model_type: str, head_dim: int, max_pos: int
) -> RopeConfig:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "mrope":  # Qwen-VL's: a text's three axes turn by one position, as the default
        kind = "default"
    # Hunyuan's "dynamic" with a fixed alpha stretches the base alone, whatever the length (as
    # transformers reads it, its own "ntk_alpha" type): a default rotation of a larger base.
    alpha = rope.get("alpha") if kind == "dynamic" else None
    if alpha is not None:
        kind = "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json: unsupported rope type {kind!r}; supported: {ROPE_TYPES}")
    # transformers moves a top-level partial_rotary_factor into rope_parameters.
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = head_dim
    if head_dim % 2:
        raise ValueError(
            f"config.json: head_dim {head_dim} is odd; a rotary embedding turns channel pairs"
        )
    theta = positive(rope, "rope_theta", positive(hf, "rope_theta", 10000.0))
    if kind == "proportional":  # the whole head turns, some of its pairs by 0
        return RopeConfig(
            theta=theta,
            rotary_dim=head_dim,
            type=kind,
            factor=positive(rope, "factor", 1.0),
            proportion=positive({"partial_rotary_factor": partial}, "partial_rotary_factor", 1),
        )
    if partial != 1.0:
        if model_type not in _PARTIAL_ROTARY_MODELS:
            raise ValueError(
                f"config.json: partial rotary embeddings are supported for "
                f"{_PARTIAL_ROTARY_MODELS} only, not {model_type!r}"
            )
        factor = positive({"partial_rotary_factor": partial}, "partial_rotary_factor", 1.0)
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
            raise ValueError(
                f"config.json: partial_rotary_factor {partial} rotates {rotary_dim} of "
                f"{head_dim} channels: it must rotate an even number, at least 2, at most all"
            )
    if alpha is not None:
        if head_dim < 4:
            raise ValueError(f"config.json: an NTK alpha needs head_dim 4 or more, not {head_dim}")
        theta *= positive(rope, "alpha", 1.0) ** (head_dim / (head_dim - 2))
    if kind == "default":
        return RopeConfig(theta=theta, rotary_dim=rotary_dim)
    # transformers gives a top-level original_max_position_embeddings (Phi-3's) priority.
    original = count(
        {**rope, **{k: v for k, v in hf.items() if k == "original_max_position_embeddings"}},
        "original_max_position_embeddings",
        max_pos,
    )
    common = {"theta": theta, "rotary_dim": rotary_dim, "type": kind}
    if kind == "linear":
        return RopeConfig(**common, factor=positive(rope, "factor", 1.0))
    if kind == "llama3":
        return RopeConfig(
            **common,
            factor=positive(rope, "factor", 1.0),
            original_max_position=original,
            low_freq_factor=positive(rope, "low_freq_factor", 1.0),
            high_freq_factor=positive(rope, "high_freq_factor", 4.0),
        )
    # Both YaRN and LongRoPE take the stretch from the two lengths where no factor is given.
    factor = positive(rope, "factor", max_pos / original)
    if kind == "yarn":
        return RopeConfig(
            **common,
            factor=factor,
            original_max_position=original,
            beta_fast=positive(rope, "beta_fast", 32.0),
            beta_slow=positive(rope, "beta_slow", 1.0),
            truncate=flag(rope, "truncate", True),
            attention_factor=_yarn_attention_factor(rope, factor),
        )
    short, long = (_factors(rope, key, rotary_dim // 2) for key in ("short_factor", "long_factor"))
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        **common,
        factor=factor,
        original_max_position=original,
        short_factor=short,
        long_factor=long,
        attention_factor=positive(rope, "attention_factor", default),
    )


def _yarn_attention_factor(rope: dict[str, Any], factor: float) -> float:
    """YaRN's scale of cos and sin: 0.1 ln(factor) + 1 (the paper's), or DeepSeek's ratio
    of two such scales where mscale and mscale_all_dim are given."""
    if "attention_factor" in rope:
        return positive(rope, "attention_factor", 1.0)

    def scale(mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and all_dim:
        return scale(positive(rope, "mscale", 1.0)) / scale(positive(rope, "mscale_all_dim", 1.0))
    return scale(1.0)


def _factors(rope: dict[str, Any], key: str, length: int) -> tuple[float, ...]:
    values = rope.get(key)
    if (
        not isinstance(values, list)
        or len(values) != length
        or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            for v in values
        )
    ):
        raise ValueError(
            f"config.json: rope {key} must list {length} positive numbers (one per rotated "
            f"channel pair), got {values!r}"
        )
    return tuple(float(v) for v in values)
