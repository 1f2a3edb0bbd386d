"""The vision tower of InternVL (transformers' model type ``internvl``: OpenGVLab's ``-hf``
checkpoints, InternVL3 and InternVL3.5): the shapes its InternViT transformer and its
multi-modal projector need, read from a config.json's ``vision_config``, its top-level
``downsample_ratio``, ``projector_hidden_act``, ``vision_feature_layer`` and
``vision_feature_select_strategy``, and its ``text_config``'s hidden size (what the projector
projects to).

A key left out takes transformers' default (5.24's ``InternVLVisionConfig``'s and
``InternVLConfig``'s; a Qwen2 ``text_config``'s); a mistyped one, and one that asks for what
Weir does not compute, are refused, each ValueError naming the key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from weir.shared.config_fields import count, flag, mapping, positive
from weir.shared.vision_config import GELU_APPROXIMATION

# The model type whose config.json this reads.
INTERNVL_MODEL_TYPE = "internvl"
# transformers' defaults (5.24's configuration_internvl.py): the vision tower's keys (its
# image_size and patch_size a pair there, (448, 448) and (14, 14); an int is one side)...
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 448,
    "patch_size": 14,
    "hidden_act": "gelu",
    "norm_type": "layer_norm",
    "layer_norm_eps": 1e-6,
    "use_qk_norm": False,
    "attention_bias": False,
    "layer_scale_init_value": 0.1,
    "use_mean_pooling": True,
    "use_absolute_position_embeddings": True,
    "use_mask_token": False,
}
# ... and the whole model's.
_TOP_DEFAULTS: dict[str, Any] = {
    "downsample_ratio": 0.5,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
}
# A text_config left out (or its hidden_size) is transformers' default for its model type:
# InternVLConfig defaults it to a Qwen2, whose hidden_size is 4096 (so is Qwen3's and
# Llama's). Another type must give it.
_TEXT_HIDDEN_DEFAULTS = {"qwen2": 4096, "qwen3": 4096, "llama": 4096}
# transformers' NORM2FN: the encoder layers' two norms.
NORM_TYPES = ("layer_norm", "rms_norm")
# vision_feature_select_strategy: "default" drops the CLS token before the pixel shuffle.
# "full" keeps it, which transformers cannot compute either (a CLS token and side² patches
# are no square grid: its reshape, or else its projector's layer norm, fails).
SELECT_STRATEGIES = ("default",)


@dataclass(slots=True, frozen=True)
class InternVLVisionConfig:
    """The vision transformer (``vision_config``), the pixel shuffle's ``downsample_ratio``,
    the feature selection, the projector's activation and the language model's
    ``text_hidden_size``. ``image_size`` and ``patch_size`` are one side of a square."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    # "layer_norm" (with a bias) or "rms_norm": the layers' norms. The final norm, where
    # use_mean_pooling is false, is a LayerNorm either way, as transformers builds it.
    norm_type: str
    layer_norm_eps: float
    # RMS norms (eps 1e-6, over all heads together) of the queries and keys.
    use_qk_norm: bool
    # Biases of q/k/v (the attention's output projection always has one).
    attention_bias: bool
    # The initial value of each layer's per-channel scales (lambda_1 of the attention's
    # output, lambda_2 of the MLP's), which the checkpoint holds as learned: not read.
    layer_scale_init_value: float
    # True: the vision model has no final norm (transformers' nn.Identity); false: a
    # LayerNorm after the last layer, which vision_feature_layer -1 reads through.
    use_mean_pooling: bool
    use_absolute_position_embeddings: bool
    # A mask token the checkpoint holds (masked image modeling): not used.
    use_mask_token: bool
    downsample_ratio: float
    # The hidden state the projector reads: -1, the vision model's output (after its final
    # norm, if any); else transformers' hidden_states[vision_feature_layer], of the
    # num_hidden_layers + 1 (the embeddings' first), never normed.
    vision_feature_layer: int
    vision_feature_select_strategy: str
    projector_hidden_act: str
    text_hidden_size: int

    def __post_init__(self) -> None:
        for key, act in (
            ("vision_config.hidden_act", self.hidden_act),
            ("projector_hidden_act", self.projector_hidden_act),
        ):
            if act not in GELU_APPROXIMATION:
                raise ValueError(
                    f"config.json: {key} {act!r} is not supported; "
                    f"supported: {tuple(GELU_APPROXIMATION)}"
                )
        if self.norm_type not in NORM_TYPES:
            raise ValueError(
                f"config.json: vision_config.norm_type {self.norm_type!r} is not supported; "
                f"supported: {NORM_TYPES}"
            )
        if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
            raise ValueError(
                "config.json: vision_feature_select_strategy "
                f"{self.vision_feature_select_strategy!r} is not supported; supported: "
                f"{SELECT_STRATEGIES} ('full' keeps the CLS token, which leaves no square grid "
                "to pixel-shuffle: transformers cannot compute it either)"
            )
        layers = self.num_hidden_layers
        if not -(layers + 1) <= self.vision_feature_layer <= layers:
            raise ValueError(
                f"config.json: vision_feature_layer {self.vision_feature_layer} selects none "
                f"of the {layers + 1} hidden states (vision_config.num_hidden_layers {layers} "
                "and the embeddings')"
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
        # The pixel shuffle folds n x n patches into one for a downsample_ratio of 1 / n:
        # transformers' checks (a side % the ratio, in floats) refuse every n but powers of 2.
        ratio = self.downsample_ratio
        scale = round(1 / ratio) if 0 < ratio <= 1 else 0
        if not scale or 1 / scale != ratio or scale & (scale - 1):
            raise ValueError(
                f"config.json: downsample_ratio {ratio} is not 1 / 2^k (1, 0.5, 0.25...): "
                "transformers' pixel shuffle folds by no other ratio"
            )
        if self.patches_per_side % scale:
            raise ValueError(
                f"config.json: downsample_ratio {self.downsample_ratio} cannot fold the "
                f"{self.patches_per_side} patches per side of a tile (vision_config.image_size "
                f"{self.image_size} / patch_size {self.patch_size}) {scale} x {scale}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """A tile's patches; the vision transformer's sequence is these and the CLS token."""
        return self.patches_per_side**2

    @property
    def scale_factor(self) -> int:
        """The patches a side of one folded block: 1 / downsample_ratio."""
        return round(1 / self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        """The image tokens a tile becomes: its patches (the CLS token dropped),
        scale_factor² of them folded into one."""
        return self.num_patches // self.scale_factor**2

    @property
    def projector_input_size(self) -> int:
        """The width of a folded token, what the projector reads: scale_factor² patches'."""
        return self.hidden_size * self.scale_factor**2

    @property
    def layers_used(self) -> int:
        """The encoder layers the selected hidden state comes out of (the later ones' output
        is not read, so they are neither built nor run)."""
        if self.vision_feature_layer == -1:
            return self.num_hidden_layers
        return self.vision_feature_layer % (self.num_hidden_layers + 1)

    @property
    def final_norm_used(self) -> bool:
        """Whether the selected hidden state goes through the vision model's final norm."""
        return self.vision_feature_layer == -1 and not self.use_mean_pooling

    @classmethod
    def from_hf(cls, hf: Any) -> InternVLVisionConfig:
        """The vision tower of an ``internvl`` config.json (a dict of it); ValueError names
        the key that is missing, mistyped or not supported."""
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type != INTERNVL_MODEL_TYPE:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not {INTERNVL_MODEL_TYPE!r}: no "
                "InternVL vision tower"
            )
        # Keys named as the messages name them: vision_config.hidden_size.
        vision = {
            f"vision_config.{k}": v
            for k, v in {**_VISION_DEFAULTS, **mapping(hf, "vision_config")}.items()
        }
        top = {k: default if hf.get(k) is None else hf[k] for k, default in _TOP_DEFAULTS.items()}

        def vision_count(key: str) -> int:
            return count(vision, f"vision_config.{key}")

        def vision_flag(key: str) -> bool:
            return flag(vision, f"vision_config.{key}")

        scale_init = vision["vision_config.layer_scale_init_value"]
        if (
            isinstance(scale_init, bool)
            or not isinstance(scale_init, (int, float))
            or not math.isfinite(scale_init)
        ):
            raise ValueError(
                "config.json: vision_config.layer_scale_init_value must be a number, got "
                f"{scale_init!r}"
            )
        feature_layer = top["vision_feature_layer"]
        if isinstance(feature_layer, bool) or not isinstance(feature_layer, int):
            raise ValueError(
                "config.json: vision_feature_layer must be one layer's index (an integer; "
                f"a list of layers is not supported), got {feature_layer!r}"
            )
        return cls(
            hidden_size=vision_count("hidden_size"),
            intermediate_size=vision_count("intermediate_size"),
            num_hidden_layers=vision_count("num_hidden_layers"),
            num_attention_heads=vision_count("num_attention_heads"),
            num_channels=vision_count("num_channels"),
            image_size=_side(vision, "vision_config.image_size"),
            patch_size=_side(vision, "vision_config.patch_size"),
            hidden_act=_string(vision, "vision_config.hidden_act"),
            norm_type=_string(vision, "vision_config.norm_type"),
            layer_norm_eps=positive(
                vision, "vision_config.layer_norm_eps", _VISION_DEFAULTS["layer_norm_eps"]
            ),
            use_qk_norm=vision_flag("use_qk_norm"),
            attention_bias=vision_flag("attention_bias"),
            layer_scale_init_value=float(scale_init),
            use_mean_pooling=vision_flag("use_mean_pooling"),
            use_absolute_position_embeddings=vision_flag("use_absolute_position_embeddings"),
            use_mask_token=vision_flag("use_mask_token"),
            downsample_ratio=positive(top, "downsample_ratio", _TOP_DEFAULTS["downsample_ratio"]),
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=_string(top, "vision_feature_select_strategy"),
            projector_hidden_act=_string(top, "projector_hidden_act"),
            text_hidden_size=_text_hidden_size(hf),
        )


def _string(hf: dict[str, Any], key: str) -> str:
    value = hf[key]
    if not isinstance(value, str):
        raise ValueError(f"config.json: {key} must be a string, got {value!r}")
    return value


def _side(vision: dict[str, Any], key: str) -> int:
    """image_size or patch_size: an int, or a [height, width] pair of one value (transformers
    writes a pair); a rectangle is refused."""
    value = vision[key]
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(
                f"config.json: {key} {list(value)!r} is not a square: only square tiles "
                "and patches are supported"
            )
        return count({key: value[0]}, key)
    return count(vision, key)


def _text_hidden_size(hf: dict[str, Any]) -> int:
    """The language model's hidden size, which the projector projects to."""
    text = mapping(hf, "text_config")
    text_type = text.get("model_type", "qwen2")
    default = _TEXT_HIDDEN_DEFAULTS.get(text_type) if isinstance(text_type, str) else None
    return count(
        {f"text_config.{k}": v for k, v in text.items()}, "text_config.hidden_size", default
    )
