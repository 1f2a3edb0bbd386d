"""Llama 4 checkpoint tensors read under the names of the other mixtures of experts.

A Llama 4 layer names its MLP `feed_forward`: a dense layer's `feed_forward.{gate,up,down}_proj`,
a sparse one's router `feed_forward.router`, its shared expert `feed_forward.shared_expert.*`
and its experts stacked in the layout its forward multiplies: `feed_forward.experts.gate_up_proj`
[experts, hidden, 2 x columns], the gate's columns then the up's, and `feed_forward.experts.
down_proj` [experts, columns, hidden]. Each is read here under Qwen's names (`mlp.gate_proj`,
`mlp.gate`, `mlp.shared_expert.gate_proj`), the stacked experts as one tensor per expert and
projection (`mlp.experts.E.gate_proj.weight`), so the loader shards and checks them as any
other.
"""

import functools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from weir.services.executor.gpt_oss_checkpoint import split_matching
from weir.services.executor.stacked_experts_checkpoint import per_expert
from weir.shared.model_config import ModelConfig

if TYPE_CHECKING:  # weights.py reads its checkpoints through this module
    from weir.services.executor.weights import TensorSource

# Under language_model.model. in a multimodal checkpoint (Llama4ForConditionalGeneration's).
_FEED_FORWARD_RE = re.compile(r"(.+\.layers\.\d+)\.feed_forward\.(.+)")
_STACKED = ("experts.gate_up_proj", "experts.down_proj")


def split_llama4_tensors(
    tensors: Iterable[tuple[str, "TensorSource"]], cfg: ModelConfig
) -> Iterator[tuple[str, "TensorSource"]]:
    return split_matching(tensors, _FEED_FORWARD_RE, functools.partial(_split, cfg))


def _split(
    cfg: ModelConfig, m: re.Match[str], source: "TensorSource"
) -> Iterator[tuple[str, "TensorSource"]]:
    layer, module = m.groups()
    if module not in _STACKED:
        yield f"{layer}.mlp.{module.replace('router.', 'gate.')}", source
        return
    h, columns = cfg.hidden_size, cfg.moe_intermediate_size
    expected = (
        (cfg.num_experts, h, 2 * columns)
        if module == "experts.gate_up_proj"
        else (cfg.num_experts, columns, h)
    )
    if tuple(source.get_shape()) != expected:
        raise ValueError(
            f"{m.group(0)}: checkpoint shape {tuple(source.get_shape())} != {expected} from "
            "config.json: the config does not describe these weights"
        )
    stacked = source[tuple(slice(None) for _ in expected)]
    yield from per_expert(f"{layer}.mlp.experts", module.removeprefix("experts."), stacked.mT)
