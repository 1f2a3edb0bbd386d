"""The vision tower of SmolVLM and Idefics3: a SigLIP-style vision transformer over each
tile's patches, then the connector, which folds each scale_factor x scale_factor block of
patches into one token (the pixel shuffle) and projects it to the language model's width.

``VisionTower(pixel_values)`` is transformers' ``Idefics3Model.get_image_features``
(``SmolVLMModel``'s, the same computation) for tiles that are all real and full size, as
Weir's image processor makes them: every tile is ``image_size`` square (an image is resized
to whole tiles before it is split, the global image to one tile) and none is padding, so
neither a ``pixel_attention_mask`` nor transformers' dropping of all-zero tiles (its padding
of a batch's images to one count) has anything to do here, and neither is implemented:
every patch attends to every patch of its tile, and every tile given is encoded (a real
tile whose normalized pixels were all exactly zero, which transformers would take for
padding and drop, included). A full mask is what transformers' own processor gives such
tiles; under it, its patch positions are those of `position_ids`.

The tower is small (SmolVLM-256M's is 93M parameters) and replicated whole on every
tensor-parallel rank."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from weir.services.executor.layers import Linear, ModuleList
from weir.shared.vision_config import GELU_APPROXIMATION, VisionConfig

if TYPE_CHECKING:  # weights.py may come to import this module
    from weir.services.executor.weights import TensorSource

# The vision tower's and the connector's tensors, as transformers saves the whole model
# (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration: Hub files, 4.x and 5.x
# alike) or its base model alone (Idefics3Model, SmolVLMModel: no ``model.``).
_PREFIXES = ("model.vision_model.", "model.connector.", "vision_model.", "connector.")
_ALL = (slice(None),)


def is_vision_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is the vision tower's or the connector's (what
    `load_vision_weights` reads; the language model's loader leaves these)."""
    return name.startswith(_PREFIXES)


class VisionLayerNorm(nn.Module):
    """A LayerNorm with a bias, torch's own (as transformers' nn.LayerNorm computes it)."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(size, device=device, dtype=dtype), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class PatchEmbedding(nn.Module):
    """Each patch_size square of the tile's pixels, all channels, to a hidden vector: a
    convolution whose stride is its kernel. Out: [tiles, patches (row-major), hidden]."""

    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        hidden_size: int,
        num_channels: int,
        patch_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.patch_size = p = patch_size
        shape = (hidden_size, num_channels, p, p)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype), False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(pixel_values, self.weight, self.bias, stride=self.patch_size)
        return x.flatten(2).transpose(1, 2)


class EncoderLayer(nn.Module):
    """A pre-norm transformer layer: bidirectional attention over a tile's patches (q/k/v in
    one projection), then a GELU MLP, each added to the residual."""

    __call__: Callable[..., torch.Tensor]

    def __init__(self, cfg: VisionConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.scale = cfg.head_dim**-0.5
        self.approximate = GELU_APPROXIMATION[cfg.hidden_act]
        self.layer_norm1 = VisionLayerNorm(d, cfg.layer_norm_eps, device, dtype)
        self.qkv_proj = Linear(d, 3 * d, True, device, dtype)
        self.out_proj = Linear(d, d, True, device, dtype)
        self.layer_norm2 = VisionLayerNorm(d, cfg.layer_norm_eps, device, dtype)
        self.fc1 = Linear(d, cfg.intermediate_size, True, device, dtype)
        self.fc2 = Linear(cfg.intermediate_size, d, True, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tiles, patches, hidden]."""
        q, k, v = self.qkv_proj(self.layer_norm1(x)).chunk(3, dim=-1)
        x = x + self.out_proj(tile_attention(q, k, v, self.heads, self.scale))
        mlp = self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate=self.approximate))
        return x + mlp


def tile_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float
) -> torch.Tensor:
    """Bidirectional attention of each tile's patches to all of its own, ``heads`` heads:
    q, k, v [tiles, patches, heads * head_dim], the heads side by side (views of a fused
    projection's output will do); out the same shape, the heads side by side again."""
    tiles, patches, width = q.shape
    q, k, v = (t.reshape(tiles, patches, heads, -1).transpose(1, 2) for t in (q, k, v))
    attn = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return attn.transpose(1, 2).reshape(tiles, patches, width)


def pixel_shuffle(x: torch.Tensor, side: int, scale: int) -> torch.Tensor:
    """Each ``scale`` x ``scale`` block of a tile's ``side`` x ``side`` patches (row-major,
    x: [tiles, side², hidden]) as one token, the blocks row-major: its patches' features
    concatenated row by row of the block, left to right within a row ([tiles, side² /
    scale², scale² * hidden]). transformers' ``Idefics3Connector.pixel_shuffle`` in one
    permutation (it folds the columns, transposes, folds the rows and transposes back)."""
    tiles, _, hidden = x.shape
    blocks = side // scale
    x = x.reshape(tiles, blocks, scale, blocks, scale, hidden)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(tiles, blocks * blocks, scale * scale * hidden)


def position_ids(side: int) -> torch.Tensor:
    """The position embedding's row of each patch of a full tile, ``side`` patches a side,
    computed in float32 as transformers' ``Idefics3VisionEmbeddings`` computes them (NaViT's
    fractional coordinates, bucketed): for most sides the patches in order, but for some
    (19, 25, 29, 31...) float rounding moves a row or column to its neighbour's bucket, or
    the boundaries count one too many. Computed on the CPU, where the reference tests run."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32)
    step = 1.0 / torch.tensor([side], dtype=torch.float32)
    fractions = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(fractions, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


class VisionTower(nn.Module):
    """Tiles of pixels [tiles, channels, image_size, image_size] to the language model's
    image tokens [tiles, tokens_per_tile, text_hidden_size]."""

    __call__: Callable[..., torch.Tensor]

    def __init__(
        self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        d = config.hidden_size
        self.patch_embedding = PatchEmbedding(
            d, config.num_channels, config.patch_size, device, dtype
        )
        self.position_embedding = nn.Parameter(
            torch.empty(config.num_patches, d, device=device, dtype=dtype), False
        )
        self.layers = ModuleList(
            [EncoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers)]
        )
        self.post_layernorm = VisionLayerNorm(d, config.layer_norm_eps, device, dtype)
        self.connector = Linear(
            config.connector_input_size, config.text_hidden_size, False, device, dtype
        )
        self.position_ids: torch.Tensor
        self.register_buffer(
            "position_ids", position_ids(config.patches_per_side).to(device), persistent=False
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        size = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != size:
            raise ValueError(
                f"pixel_values must be [tiles, {', '.join(map(str, size))}], got "
                f"{list(pixel_values.shape)}"
            )
        x = self.patch_embedding(pixel_values.to(self.position_embedding))
        x = x + self.position_embedding[self.position_ids]
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        return self.connector(pixel_shuffle(x, cfg.patches_per_side, cfg.scale_factor))


# A checkpoint tensor's place in a tower: the parameter it fills (None: a tensor the
# checkpoint holds that the tower does not use, checked and left unread), the rows of it,
# and the tensor's shape in the checkpoint.
TowerTarget = tuple[str | None, slice, tuple[int, ...]]


def _checkpoint_targets(cfg: VisionConfig) -> dict[str, TowerTarget]:
    """Each vision tensor of a checkpoint (named without ``model.``) -> the tower's parameter
    it fills, the rows of it and the tensor's shape in the checkpoint."""
    d, p, i = cfg.hidden_size, cfg.patch_size, cfg.intermediate_size
    whole = slice(None)
    targets: dict[str, TowerTarget] = {
        "vision_model.embeddings.patch_embedding.weight": (
            "patch_embedding.weight",
            whole,
            (d, cfg.num_channels, p, p),
        ),
        "vision_model.embeddings.patch_embedding.bias": ("patch_embedding.bias", whole, (d,)),
        "vision_model.embeddings.position_embedding.weight": (
            "position_embedding",
            whole,
            (cfg.num_patches, d),
        ),
        "vision_model.post_layernorm.weight": ("post_layernorm.weight", whole, (d,)),
        "vision_model.post_layernorm.bias": ("post_layernorm.bias", whole, (d,)),
        "connector.modality_projection.proj.weight": (
            "connector.weight",
            whole,
            (cfg.text_hidden_size, cfg.connector_input_size),
        ),
    }
    for layer in range(cfg.num_hidden_layers):
        hf, weir = f"vision_model.encoder.layers.{layer}.", f"layers.{layer}."
        for part, rows in (("q", slice(0, d)), ("k", slice(d, 2 * d)), ("v", slice(2 * d, 3 * d))):
            targets[f"{hf}self_attn.{part}_proj.weight"] = (f"{weir}qkv_proj.weight", rows, (d, d))
            targets[f"{hf}self_attn.{part}_proj.bias"] = (f"{weir}qkv_proj.bias", rows, (d,))
        shapes = {
            "self_attn.out_proj": ("out_proj", (d, d)),
            "layer_norm1": ("layer_norm1", (d,)),
            "layer_norm2": ("layer_norm2", (d,)),
            "mlp.fc1": ("fc1", (i, d)),
            "mlp.fc2": ("fc2", (d, i)),
        }
        for module, (weir_module, shape) in shapes.items():
            targets[f"{hf}{module}.weight"] = (f"{weir}{weir_module}.weight", whole, shape)
            targets[f"{hf}{module}.bias"] = (f"{weir}{weir_module}.bias", whole, shape[:1])
    return targets


_LAYER_RE = re.compile(r"vision_model\.encoder\.layers\.(\d+)\.")


@torch.no_grad()
def load_vision_weights(
    tower: VisionTower, tensors: Iterable[tuple[str, torch.Tensor | TensorSource]]
) -> None:
    """Copy the checkpoint's vision tower and connector tensors (by their names, as
    `is_vision_weight` knows them; whole tensors or safetensors slices) into ``tower``,
    q/k/v into its fused projection, cast to its dtype. Every one must be there, once, of
    the shape config.json gives it; another under those prefixes is refused (ValueError
    names the tensor). The language model's and any other tensors are skipped."""
    targets = _checkpoint_targets(tower.config)
    load_tower_tensors(
        tower, targets, tensors, is_vision_weight, _LAYER_RE, tower.config.num_hidden_layers
    )


@torch.no_grad()
def load_tower_tensors(
    tower: nn.Module,
    targets: Mapping[str, TowerTarget],
    tensors: Iterable[tuple[str, torch.Tensor | TensorSource]],
    owns: Callable[[str], bool],
    layer_re: re.Pattern[str],
    num_layers: int,
) -> None:
    """Copy the checkpoint tensors ``owns`` claims for a vision tower into ``tower``'s
    parameters as ``targets`` (keyed by the names without ``model.``) place them, each cast
    to the parameter's dtype. Every target must be there, once, of its shape; a claimed
    name no target knows is refused (``layer_re`` matching a layer's prefix, its group the
    layer's index, says so where the index is beyond the ``num_layers`` config.json gives).
    ValueError names the tensor."""
    params = dict(tower.named_parameters())
    loaded: dict[str, str] = {}
    for checkpoint_name, source in tensors:
        if not owns(checkpoint_name):
            continue
        name = checkpoint_name.removeprefix("model.")
        if name not in targets:
            layer = layer_re.match(name)
            beyond = (
                f" (config.json's vision_config.num_hidden_layers is {num_layers})"
                if layer is not None and int(layer.group(1)) >= num_layers
                else ""
            )
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} is no part of the vision tower"
                f"{beyond}: the config does not describe these weights"
            )
        if name in loaded:
            raise ValueError(
                f"checkpoint tensors {loaded[name]!r} and {checkpoint_name!r} hold the same "
                "weights (in two files?): keep one copy"
            )
        loaded[name] = checkpoint_name
        param, rows, shape = targets[name]
        found = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
        if found != shape:
            raise ValueError(
                f"{checkpoint_name}: checkpoint shape {found} != {shape} from config.json: "
                "the config does not describe these weights"
            )
        if param is not None:
            params[param][rows].copy_(source[_ALL])
    missing = [name for name in targets if name not in loaded]
    if missing:
        # Named as the checkpoint names the others (with model. where it has none).
        bare = loaded and not any(name.startswith("model.") for name in loaded.values())
        named = ", ".join(f"{'' if bare else 'model.'}{name}" for name in missing[:3])
        raise ValueError(
            f"checkpoint lacks {len(missing)} of the vision tower's tensors: {named}"
            + (", ..." if len(missing) > 3 else "")
        )
