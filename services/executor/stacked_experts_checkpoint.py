"""Stacked experts' checkpoint tensors read under the names of the other mixtures of experts.

Qwen3-VL's mixtures of experts (Qwen3-VL-30B-A3B, 235B-A22B), Mistral 4 and Gemma 4 stack each
layer's experts in two tensors: `mlp.experts.gate_up_proj` (Gemma 4's `experts.gate_up_proj`),
the gate's columns then the up's, and `mlp.experts.down_proj`. transformers 5 saves them as its
forward multiplies them, [experts, 2 x columns, hidden] and [experts, hidden, columns] (Mistral
4's and Gemma 4's only layout: transformers has no other for them); Qwen's own files hold them
transposed, [experts, hidden, 2 x columns] and [experts, columns, hidden], and where both
layouts have one shape (a square matrix) transformers reads the first, as is done here. Each is read as one tensor per expert and
projection, named as Qwen3-MoE's (`mlp.experts.E.gate_proj.weight`), so the loader shards and
checks them as any other.
"""

import functools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from weir.services.executor.gpt_oss_checkpoint import Tensor, split_matching
from weir.shared.model_config import ModelConfig

if TYPE_CHECKING:  # weights.py reads its checkpoints through this module
    from weir.services.executor.weights import TensorSource

_STACKED_RE = re.compile(r"(.+\.layers\.\d+)\.(?:mlp\.)?experts\.(gate_up_proj|down_proj)")


def split_stacked_experts(
    tensors: Iterable[tuple[str, "TensorSource"]], cfg: ModelConfig, qwen_layout: bool
) -> Iterator[tuple[str, "TensorSource"]]:
    """The tensors, stacked experts cut into one tensor per expert; ``qwen_layout``: Qwen's
    transposed layout is read too."""
    return split_matching(tensors, _STACKED_RE, functools.partial(_split, cfg, qwen_layout))


def _split(
    cfg: ModelConfig, qwen_layout: bool, m: re.Match[str], source: "TensorSource"
) -> Iterator[tuple[str, "TensorSource"]]:
    layer, part = m.groups()
    if not cfg.num_experts:  # Gemma 4's without enable_moe_block
        raise ValueError(
            f"{m.group(0)}: config.json gives the model no experts: it does not describe "
            "these weights"
        )
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    rows, columns = (2 * inter, h) if part == "gate_up_proj" else (h, inter)
    whole = source[tuple(slice(None) for _ in source.get_shape())]
    layouts = f"[experts, {rows}, {columns}]"
    if qwen_layout:
        layouts += f" nor [experts, {columns}, {rows}]"
        if tuple(whole.shape[1:]) == (columns, rows) != (rows, columns):
            whole = whole.transpose(1, 2)
    if tuple(whole.shape[1:]) != (rows, columns):
        raise ValueError(
            f"{m.group(0)}: checkpoint shape {tuple(whole.shape)} is not {layouts}: "
            "config.json does not describe these weights"
        )
    yield from per_expert(f"{layer}.mlp.experts", part, whole)


def per_expert(
    experts: str, part: str, stacked: torch.Tensor
) -> Iterator[tuple[str, "TensorSource"]]:
    """Each expert's tensors of a stacked ``part`` (gate_up_proj or down_proj) in a linear
    layer's layout, [experts, out, in] (gate_up_proj's rows the gate's then the up's), named
    as Qwen3-MoE's under ``experts``."""
    for expert, weight in enumerate(stacked):
        if part == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            yield f"{experts}.{expert}.gate_proj.weight", Tensor(gate.contiguous())
            yield f"{experts}.{expert}.up_proj.weight", Tensor(up.contiguous())
        else:
            yield f"{experts}.{expert}.down_proj.weight", Tensor(weight.contiguous())
