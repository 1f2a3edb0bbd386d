"""Granite MoE checkpoint tensors read under the names of the other mixtures of experts.

A Granite 3 MoE checkpoint (`granitemoe`, and `granitemoeshared` with a shared expert) stacks
each layer's experts: `block_sparse_moe.input_linear` [experts, 2 x columns, hidden], the gate's
rows then the up's, `output_linear` [experts, hidden, columns], and its router is
`block_sparse_moe.router.layer`; the shared expert is `shared_mlp.input_linear` [2 x its
columns, hidden] and `output_linear`. Each is read here as one tensor per expert and
projection, named as Qwen's (`mlp.experts.E.gate_proj.weight`; the router `mlp.gate`, the
shared expert DeepSeek's `mlp.shared_experts`), so the loader shards and checks them as any
other.
"""

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from weir.services.executor.gpt_oss_checkpoint import Tensor, split_matching

if TYPE_CHECKING:  # weights.py reads its checkpoints through this module
    from weir.services.executor.weights import TensorSource

_STACKED_RE = re.compile(
    r"(model\.layers\.\d+)\.(block_sparse_moe\.input_linear|block_sparse_moe\.output_linear"
    r"|block_sparse_moe\.router\.layer|shared_mlp\.input_linear|shared_mlp\.output_linear)"
    r"\.weight"
)


def split_granite_moe_tensors(
    tensors: Iterable[tuple[str, "TensorSource"]],
) -> Iterator[tuple[str, "TensorSource"]]:
    return split_matching(tensors, _STACKED_RE, _split)


def _split(m: re.Match[str], source: "TensorSource") -> Iterator[tuple[str, "TensorSource"]]:
    layer, part = m.groups()
    if part == "block_sparse_moe.router.layer":
        yield f"{layer}.mlp.gate.weight", source
        return
    whole = source[tuple(slice(None) for _ in source.get_shape())]
    if part == "shared_mlp.input_linear":
        gate, up = whole.chunk(2, dim=0)
        yield f"{layer}.mlp.shared_experts.gate_proj.weight", Tensor(gate)
        yield f"{layer}.mlp.shared_experts.up_proj.weight", Tensor(up)
    elif part == "shared_mlp.output_linear":
        yield f"{layer}.mlp.shared_experts.down_proj.weight", Tensor(whole)
    elif part == "block_sparse_moe.input_linear":
        for expert, rows in enumerate(whole):
            gate, up = rows.chunk(2, dim=0)
            yield f"{layer}.mlp.experts.{expert}.gate_proj.weight", Tensor(gate)
            yield f"{layer}.mlp.experts.{expert}.up_proj.weight", Tensor(up)
    else:
        for expert, rows in enumerate(whole):
            yield f"{layer}.mlp.experts.{expert}.down_proj.weight", Tensor(rows)
