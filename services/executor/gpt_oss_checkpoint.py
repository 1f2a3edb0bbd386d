"""gpt-oss checkpoint tensors read under the names and layouts of the other mixtures of experts.

A gpt-oss checkpoint stacks each layer's experts in one tensor per projection, in the layout
its forward multiplies (`gate_up_proj` [experts, hidden, 2 x columns] with the gate and up
columns interleaved, `down_proj` [experts, columns, hidden], their biases beside them), or,
as OpenAI publishes it, quantized to MXFP4: `*_blocks` (two 4-bit E2M1 values per byte, 32
values a block) and `*_scales` (one power of two per block, biased by 127) in the
[experts, out, in] layout of a linear layer. Each is split here into one tensor per expert
and projection, named as Qwen's (`mlp.experts.E.gate_proj.weight`), so the loader shards
and checks them as any other; the router is Mixtral's `mlp.gate`, and the attention sinks a
`self_attn.sinks.weight`.
"""

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from weir.services.executor.dequantized_weight import e2m1_values
from weir.shared.model_config import ModelConfig

if TYPE_CHECKING:  # weights.py reads its checkpoints through this module
    from weir.services.executor.weights import TensorSource

_STACKED_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(.*)")
_QUANTIZED_PARTS = ("_blocks", "_scales")
_SUFFIXES = ("", "_bias", *_QUANTIZED_PARTS)
# The checkpoint tensors each of Weir's gpt-oss parameters is read from, for an error to name.
CHECKPOINT_NAMES = {
    "sinks.weight": "self_attn.sinks",
    "moe.gate.weight": "mlp.router.weight",
    "moe.gate.bias": "mlp.router.bias",
    "moe.experts_gate_up": "mlp.experts.gate_up_proj (or its _blocks and _scales)",
    "moe.experts_gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts_down": "mlp.experts.down_proj (or its _blocks and _scales)",
    "moe.experts_down_bias": "mlp.experts.down_proj_bias",
}


def split_matching(
    tensors: Iterable[tuple[str, "TensorSource"]],
    pattern: re.Pattern[str],
    split: Callable[[re.Match[str], "TensorSource"], Iterable[tuple[str, "TensorSource"]]],
) -> Iterator[tuple[str, "TensorSource"]]:
    """The tensors, each whose name ``pattern`` matches whole replaced by what ``split``
    makes of it (a stacked tensor's parts, under the names the loader reads)."""
    for name, source in tensors:
        m = pattern.fullmatch(name)
        if m is None:
            yield name, source
        else:
            yield from split(m, source)


class Tensor:
    """A tensor in memory as a `TensorSource`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] uint8 blocks and [..., rows, groups] uint8 scales (as the
    caller checked them) -> float32 [..., rows, groups x 32]: each byte's low nibble is the
    earlier value."""
    values = e2m1_values(blocks)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def split_gpt_oss_tensors(
    tensors: Iterator[tuple[str, "TensorSource"]], cfg: ModelConfig
) -> Iterator[tuple[str, "TensorSource"]]:
    """The checkpoint's tensors with every stacked expert tensor split per expert (MXFP4 ones
    dequantized once both their blocks and scales were read), under the names above; a
    stacked tensor of another shape than ``cfg`` gives it is refused by its name."""
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    for name, source in tensors:
        if name.endswith(".self_attn.sinks"):
            yield name + ".weight", source
            continue
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), source
            continue
        m = _STACKED_RE.fullmatch(name)
        if m is None:
            yield name, source
            continue
        prefix, projection, suffix = m.groups()
        if suffix not in _SUFFIXES:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        expected = _stacked_shape(cfg, projection, suffix)
        if tuple(source.get_shape()) != expected:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(source.get_shape())} != {expected} from "
                "config.json: the config does not describe these weights"
            )
        if suffix in _QUANTIZED_PARTS:
            parts = quantized.setdefault(f"{prefix}.{projection}", {})
            parts[suffix] = source[(slice(None),)]
            if len(parts) == 2:
                del quantized[f"{prefix}.{projection}"]
                blocks, scales = parts["_blocks"], parts["_scales"]
                if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
                    raise ValueError(
                        f"{prefix}.{projection}: MXFP4 blocks and scales are uint8, not "
                        f"{blocks.dtype} and {scales.dtype}"
                    )
                # One expert at a time: the whole layer's float32 weights would not fit beside
                # the model on a machine the quantized checkpoint was chosen for.
                weights = (dequantize_mxfp4(b, s) for b, s in zip(blocks, scales, strict=True))
                yield from _per_expert(prefix, projection, "weight", weights)
            continue
        stacked = source[(slice(None),)]
        if suffix == "":  # the forward's layout: [experts, in, out]
            yield from _per_expert(prefix, projection, "weight", stacked.transpose(1, 2))
        else:
            yield from _per_expert(prefix, projection, "bias", stacked)
    if quantized:
        name, parts = next(iter(quantized.items()))
        missing = next(p for p in _QUANTIZED_PARTS if p not in parts)
        raise ValueError(f"checkpoint has {name}{''.join(parts)} but no {name}{missing}")


def _stacked_shape(cfg: ModelConfig, projection: str, suffix: str) -> tuple[int, ...]:
    """A stacked expert tensor's shape by config.json (its linear layout: [experts, out, in]
    for the MXFP4 parts, [experts, in, out] for the forward's)."""
    experts, hidden, columns = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out, inputs = (2 * columns, hidden) if projection == "gate_up_proj" else (hidden, columns)
    return {
        "": (experts, inputs, out),
        "_bias": (experts, out),
        "_blocks": (experts, out, inputs // 32, 16),
        "_scales": (experts, out, inputs // 32),
    }[suffix]


def _per_expert(
    prefix: str, projection: str, kind: str, experts: Iterable[torch.Tensor]
) -> Iterator[tuple[str, "TensorSource"]]:
    """Each expert's [out(, in)] tensor under its name, gate and up rows de-interleaved."""
    for expert, rows in enumerate(experts):
        at = f"{prefix}.{expert}"
        if projection == "down_proj":
            yield f"{at}.down_proj.{kind}", Tensor(rows)
        else:
            yield f"{at}.gate_proj.{kind}", Tensor(rows[0::2])
            yield f"{at}.up_proj.{kind}", Tensor(rows[1::2])
