"""The vision tower of InternVL (transformers' model type ``internvl``): InternViT, a
pre-norm vision transformer over a CLS token and each tile's patches whose layers scale
their attention's and MLP's outputs by learned per-channel factors before adding them to
the residual; then the CLS token dropped, each scale_factor x scale_factor block of patches
folded into one token (the pixel shuffle, Idefics3's order) and the multi-modal projector
(a LayerNorm, a linear layer, a GELU and another linear layer) to the language model's width.

``InternVLVisionTower(pixel_values)`` is transformers' ``InternVLModel.get_image_features``
with the config's ``vision_feature_layer`` and ``vision_feature_select_strategy``, for tiles
of ``image_size`` square, as InternVL's image processor makes them: at that size the
position embeddings are used as they are (transformers interpolates them only for another
size, which is not implemented). Every tile is encoded on its own: no tile sees another's
patches.

The tower (InternViT-300M, InternVL3-1B to 14B's: 0.3B parameters) is replicated whole on
every tensor-parallel rank."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from weir.services.executor.layers import Linear, ModuleList, RMSNorm
from weir.services.executor.vision import (
    PatchEmbedding,
    TowerTarget,
    VisionLayerNorm,
    load_tower_tensors,
    pixel_shuffle,
    tile_attention,
)
from weir.shared.internvl_vision_config import InternVLVisionConfig
from weir.shared.vision_config import GELU_APPROXIMATION

if TYPE_CHECKING:  # weights.py may come to import this module
    from weir.services.executor.weights import TensorSource

# The vision tower's and the projector's tensors, as transformers' InternVL modules name
# them (``model.vision_tower.``...: InternVLForConditionalGeneration's state_dict) and as
# its checkpoints do: 5.x's save_pretrained, like the Hub's 4.x files, writes them without
# ``model.`` (its conversion mapping, reversed on saving; the language model's tensors
# under ``language_model.model.`` and the head as ``language_model.lm_head.weight``).
_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)
# transformers' InternVLVisionRMSNorm of the queries and keys, built with its default eps
# (not vision_config.layer_norm_eps), and its projector's nn.LayerNorm (torch's default).
_QK_NORM_EPS = 1e-6
_PROJECTOR_NORM_EPS = 1e-5


def is_internvl_vision_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is the vision tower's or the projector's (what
    `load_internvl_vision_weights` reads; the language model's loader leaves these)."""
    return name.startswith(_PREFIXES)


def _norm(cfg: InternVLVisionConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A layer's norm: a LayerNorm with a bias or an RMS norm (normalized in float32, scaled
    in the model's dtype, as transformers' InternVLVisionRMSNorm)."""
    if cfg.norm_type == "layer_norm":
        return VisionLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, device, dtype)
    return RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, device, dtype)


class InternVLEncoderLayer(nn.Module):
    """A pre-norm transformer layer: bidirectional attention over a tile's CLS token and
    patches (q/k/v in one projection, the queries and keys RMS-normed if use_qk_norm), then
    a GELU MLP, each scaled per channel (lambda_1, lambda_2) and added to the residual."""

    __call__: Callable[..., torch.Tensor]

    def __init__(self, cfg: InternVLVisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.scale = cfg.head_dim**-0.5
        self.approximate = GELU_APPROXIMATION[cfg.hidden_act]
        self.norm1 = _norm(cfg, device, dtype)
        self.qkv_proj = Linear(d, 3 * d, cfg.attention_bias, device, dtype)
        self.q_norm = RMSNorm(d, _QK_NORM_EPS, device, dtype) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(d, _QK_NORM_EPS, device, dtype) if cfg.use_qk_norm else None
        self.out_proj = Linear(d, d, True, device, dtype)
        self.lambda_1 = nn.Parameter(torch.empty(d, device=device, dtype=dtype), False)
        self.norm2 = _norm(cfg, device, dtype)
        self.fc1 = Linear(d, cfg.intermediate_size, True, device, dtype)
        self.fc2 = Linear(cfg.intermediate_size, d, True, device, dtype)
        self.lambda_2 = nn.Parameter(torch.empty(d, device=device, dtype=dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tiles, 1 + patches, hidden]."""
        q, k, v = self.qkv_proj(self.norm1(x)).chunk(3, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        x = x + self.lambda_1 * self.out_proj(tile_attention(q, k, v, self.heads, self.scale))
        mlp = self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))
        return x + self.lambda_2 * mlp


class InternVLVisionTower(nn.Module):
    """Tiles of pixels [tiles, channels, image_size, image_size] to the language model's
    image tokens [tiles, tokens_per_tile, text_hidden_size]."""

    __call__: Callable[..., torch.Tensor]

    def __init__(
        self, config: InternVLVisionConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        d = config.hidden_size
        self.patch_embedding = PatchEmbedding(
            d, config.num_channels, config.patch_size, device, dtype
        )
        # Shaped as the checkpoint holds them.
        self.cls_token = nn.Parameter(torch.empty(1, 1, d, device=device, dtype=dtype), False)
        self.position_embedding = (
            nn.Parameter(
                torch.empty(1, config.num_patches + 1, d, device=device, dtype=dtype), False
            )
            if config.use_absolute_position_embeddings
            else None
        )
        self.layers = ModuleList(
            [InternVLEncoderLayer(config, device, dtype) for _ in range(config.layers_used)]
        )
        self.final_norm = (
            VisionLayerNorm(d, config.layer_norm_eps, device, dtype)
            if config.final_norm_used
            else None
        )
        width = config.projector_input_size
        self.projector_norm = VisionLayerNorm(width, _PROJECTOR_NORM_EPS, device, dtype)
        self.linear_1 = Linear(width, config.text_hidden_size, True, device, dtype)
        self.linear_2 = Linear(
            config.text_hidden_size, config.text_hidden_size, True, device, dtype
        )
        self.projector_approximate = GELU_APPROXIMATION[config.projector_hidden_act]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        size = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != size:
            raise ValueError(
                f"pixel_values must be [tiles, {', '.join(map(str, size))}], got "
                f"{list(pixel_values.shape)}"
            )
        patches = self.patch_embedding(pixel_values.to(self.cls_token))
        x = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        if self.position_embedding is not None:
            x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        x = pixel_shuffle(x[:, 1:], cfg.patches_per_side, cfg.scale_factor)  # CLS dropped
        x = self.linear_1(self.projector_norm(x))
        return self.linear_2(F.gelu(x, approximate=self.projector_approximate))


_LAYER_RE = re.compile(r"vision_tower\.encoder\.layer\.(\d+)\.")


def _checkpoint_targets(cfg: InternVLVisionConfig) -> dict[str, TowerTarget]:
    """Each vision tensor of a checkpoint (named without ``model.``) -> the tower's parameter
    it fills (None: held, not used), the rows of it and the tensor's shape in the
    checkpoint."""
    d, p, i, t = cfg.hidden_size, cfg.patch_size, cfg.intermediate_size, cfg.text_hidden_size
    w = cfg.projector_input_size
    whole = slice(None)
    embeddings, projector = "vision_tower.embeddings.", "multi_modal_projector."
    targets: dict[str, TowerTarget] = {
        f"{embeddings}cls_token": ("cls_token", whole, (1, 1, d)),
        f"{embeddings}patch_embeddings.projection.weight": (
            "patch_embedding.weight",
            whole,
            (d, cfg.num_channels, p, p),
        ),
        f"{embeddings}patch_embeddings.projection.bias": ("patch_embedding.bias", whole, (d,)),
        f"{projector}layer_norm.weight": ("projector_norm.weight", whole, (w,)),
        f"{projector}layer_norm.bias": ("projector_norm.bias", whole, (w,)),
        f"{projector}linear_1.weight": ("linear_1.weight", whole, (t, w)),
        f"{projector}linear_1.bias": ("linear_1.bias", whole, (t,)),
        f"{projector}linear_2.weight": ("linear_2.weight", whole, (t, t)),
        f"{projector}linear_2.bias": ("linear_2.bias", whole, (t,)),
    }
    if cfg.use_absolute_position_embeddings:
        targets[f"{embeddings}position_embeddings"] = (
            "position_embedding",
            whole,
            (1, cfg.num_patches + 1, d),
        )
    if cfg.use_mask_token:
        targets[f"{embeddings}mask_token"] = (None, whole, (1, 1, d))
    if not cfg.use_mean_pooling:
        for part in ("weight", "bias"):
            param = f"final_norm.{part}" if cfg.final_norm_used else None
            targets[f"vision_tower.layernorm.{part}"] = (param, whole, (d,))
    for layer in range(cfg.num_hidden_layers):
        hf, weir = f"vision_tower.encoder.layer.{layer}.", f"layers.{layer}."
        used = layer < cfg.layers_used
        layer_targets: dict[str, tuple[str, slice, tuple[int, ...]]] = {}
        for n, part in enumerate("qkv"):
            rows = slice(n * d, (n + 1) * d)
            layer_targets[f"attention.{part}_proj.weight"] = ("qkv_proj.weight", rows, (d, d))
            if cfg.attention_bias:
                layer_targets[f"attention.{part}_proj.bias"] = ("qkv_proj.bias", rows, (d,))
        shapes = {
            "attention.projection_layer": ("out_proj", (d, d)),
            "mlp.fc1": ("fc1", (i, d)),
            "mlp.fc2": ("fc2", (d, i)),
        }
        norms = {"layernorm_before": "norm1", "layernorm_after": "norm2"}
        if cfg.use_qk_norm:
            norms |= {"attention.q_norm": "q_norm", "attention.k_norm": "k_norm"}
        for module, (weir_module, shape) in shapes.items():
            layer_targets[f"{module}.weight"] = (f"{weir_module}.weight", whole, shape)
            layer_targets[f"{module}.bias"] = (f"{weir_module}.bias", whole, shape[:1])
        for module, weir_module in norms.items():
            layer_targets[f"{module}.weight"] = (f"{weir_module}.weight", whole, (d,))
            if cfg.norm_type == "layer_norm" and module.startswith("layernorm"):
                layer_targets[f"{module}.bias"] = (f"{weir_module}.bias", whole, (d,))
        for scale in ("lambda_1", "lambda_2"):
            layer_targets[scale] = (scale, whole, (d,))
        for name, (layer_param, layer_rows, layer_shape) in layer_targets.items():
            targets[hf + name] = (weir + layer_param if used else None, layer_rows, layer_shape)
    return targets


@torch.no_grad()
def load_internvl_vision_weights(
    tower: InternVLVisionTower, tensors: Iterable[tuple[str, torch.Tensor | TensorSource]]
) -> None:
    """Copy the checkpoint's vision tower and projector tensors (by their names, as
    `is_internvl_vision_weight` knows them; whole tensors or safetensors slices) into
    ``tower``, q/k/v into its fused projection, cast to its dtype. Every one must be there,
    once, of the shape config.json gives it (those of layers after vision_feature_layer's,
    the mask token and a final norm not read are checked, not read); another under those
    prefixes is refused (ValueError names the tensor). The language model's and any other
    tensors are skipped."""
    targets = _checkpoint_targets(tower.config)
    load_tower_tensors(
        tower,
        targets,
        tensors,
        is_internvl_vision_weight,
        _LAYER_RE,
        tower.config.num_hidden_layers,
    )
