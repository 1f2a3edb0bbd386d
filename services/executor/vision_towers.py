"""The vision tower of a model that reads images, by its config's kind: Idefics3's and
SmolVLM's (``vision.py``) or InternVL's (``internvl_vision.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weir.services.executor.internvl_vision import (
    InternVLVisionTower,
    is_internvl_vision_weight,
    load_internvl_vision_weights,
)
from weir.services.executor.vision import VisionTower, is_vision_weight, load_vision_weights
from weir.shared.internvl_vision_config import InternVLVisionConfig
from weir.shared.vision_config import VisionConfig

Tower = VisionTower | InternVLVisionTower


def build_tower(
    config: VisionConfig | InternVLVisionConfig, dtype: torch.dtype, device: torch.device | str
) -> Tower:
    if isinstance(config, InternVLVisionConfig):
        return InternVLVisionTower(config, dtype, device)
    return VisionTower(config, dtype, device)


def is_tower_weight(tower: Tower, name: str) -> bool:
    """Whether checkpoint tensor ``name`` is the tower's (or its projector's)."""
    if isinstance(tower, InternVLVisionTower):
        return is_internvl_vision_weight(name)
    return is_vision_weight(name)


def load_tower(tower: Tower, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The tower's tensors, every one of them (ValueError names what is wrong)."""
    if isinstance(tower, InternVLVisionTower):
        load_internvl_vision_weights(tower, tensors)
    else:
        load_vision_weights(tower, tensors)
