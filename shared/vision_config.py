"""The vision tower of SmolVLM and Idefics3 (transformers' model types ``smolvlm`` and
``idefics3``): the shapes its SigLIP-style transformer and its connector need, read from a
config.json's ``vision_config``, its top-level ``scale_factor`` and its ``text_config``'s
hidden size (what the connector projects to).

A key left out takes transformers' default for the model type (``Idefics3VisionConfig``'s,
``SmolVLMVisionConfig``'s, a Llama ``text_config``'s); a mistyped one, an activation Weir
does not compute and a grid the pixel shuffle cannot fold are refused, each ValueError
naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weir.shared.config_fields import count, mapping, positive

# The model types whose config.json this reads.
VISION_MODEL_TYPES = ("idefics3", "smolvlm")
# transformers' defaults (5.24's configuration_idefics3.py and configuration_smolvlm.py: the
# same for both types, each kept under its own name should either change), the vision
# tower's keys then the whole model's scale_factor.
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    model_type: {
        "hidden_size": 1152,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    for model_type in VISION_MODEL_TYPES
}
_SCALE_FACTOR_DEFAULT = {model_type: 2 for model_type in VISION_MODEL_TYPES}
# A text_config left out (or its hidden_size) is transformers' default for its model type:
# both configs default it to a Llama, whose hidden_size is 4096. Another type must give it.
_TEXT_HIDDEN_DEFAULTS = {"llama": 4096}
# transformers' GELUs (its ACT2FN names) by how torch's F.gelu computes each: the exact one
# (erf) or the tanh approximation (gelu_new, gelu_fast, gelu_accurate and gelu_python_tanh
# write that formula out in Python: the same function, within float rounding). Others
# (quick_gelu's sigmoid, gelu_10's clipping, SiLU...) are refused.
GELU_APPROXIMATION = {
    "gelu": "none",
    "gelu_python": "none",
    "gelu_pytorch_tanh": "tanh",
    "gelu_python_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_accurate": "tanh",
}


@dataclass(slots=True, frozen=True)
class VisionConfig:
    """The vision transformer's shapes (``vision_config``), the pixel shuffle's
    ``scale_factor`` and the language model's ``text_hidden_size``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    scale_factor: int
    text_hidden_size: int

    def __post_init__(self) -> None:
        if self.hidden_act not in GELU_APPROXIMATION:
            raise ValueError(
                f"config.json: vision_config.hidden_act {self.hidden_act!r} is not supported; "
                f"supported: {tuple(GELU_APPROXIMATION)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config.json: vision_config.hidden_size {self.hidden_size} is not a multiple "
                f"of vision_config.num_attention_heads {self.num_attention_heads}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"config.json: vision_config.image_size {self.image_size} is not a multiple "
                f"of vision_config.patch_size {self.patch_size}: the patches do not tile it"
            )
        if self.patches_per_side % self.scale_factor:
            raise ValueError(
                f"config.json: scale_factor {self.scale_factor} does not divide the "
                f"{self.patches_per_side} patches per side of a tile (vision_config.image_size "
                f"{self.image_size} / patch_size {self.patch_size}): the pixel shuffle cannot "
                "fold them"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """A tile's patches, the vision transformer's sequence length."""
        return self.patches_per_side**2

    @property
    def tokens_per_tile(self) -> int:
        """The image tokens a tile becomes: its patches, scale_factor² of them folded into one."""
        return self.num_patches // self.scale_factor**2

    @property
    def connector_input_size(self) -> int:
        """The width of a folded token, what the connector projects: scale_factor² patches'."""
        return self.hidden_size * self.scale_factor**2

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        """The vision tower of an ``idefics3`` or ``smolvlm`` config.json (a dict of it);
        ValueError names the key that is missing, mistyped or not supported."""
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} has no vision tower Weir reads; "
                f"supported: {VISION_MODEL_TYPES}"
            )
        defaults = _VISION_DEFAULTS[model_type]
        # Keys named as the messages name them: vision_config.hidden_size.
        vision = {
            f"vision_config.{k}": v for k, v in {**defaults, **mapping(hf, "vision_config")}.items()
        }

        def vision_count(key: str) -> int:
            return count(vision, f"vision_config.{key}")

        hidden_act = vision["vision_config.hidden_act"]
        if not isinstance(hidden_act, str):
            raise ValueError(
                f"config.json: vision_config.hidden_act must be a string, got {hidden_act!r}"
            )
        return cls(
            hidden_size=vision_count("hidden_size"),
            intermediate_size=vision_count("intermediate_size"),
            num_hidden_layers=vision_count("num_hidden_layers"),
            num_attention_heads=vision_count("num_attention_heads"),
            num_channels=vision_count("num_channels"),
            image_size=vision_count("image_size"),
            patch_size=vision_count("patch_size"),
            layer_norm_eps=positive(
                vision, "vision_config.layer_norm_eps", defaults["layer_norm_eps"]
            ),
            hidden_act=hidden_act,
            scale_factor=count(hf, "scale_factor", _SCALE_FACTOR_DEFAULT[model_type]),
            text_hidden_size=_text_hidden_size(hf),
        )


def _text_hidden_size(hf: dict[str, Any]) -> int:
    """The language model's hidden size, which the connector projects to."""
    text = mapping(hf, "text_config")
    text_type = text.get("model_type", "llama")
    default = _TEXT_HIDDEN_DEFAULTS.get(text_type) if isinstance(text_type, str) else None
    return count(
        {f"text_config.{k}": v for k, v in text.items()}, "text_config.hidden_size", default
    )
