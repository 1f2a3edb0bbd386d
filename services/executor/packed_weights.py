"""Projection weights prepacked for oneDNN (float32 on the CPU, the default there).

`F.linear` on a CPU runs MKL's GEMM, which repacks the weight into its blocked layout on
every call; a decode step multiplies a few dozen rows by every weight of the model, so
that repacking costs about as much as the arithmetic. Reordering each projection once at
load time into oneDNN's layout (`mkldnn._reorder_linear_weight`, the prepacking
PyTorch's own compiler uses) and calling oneDNN's matmul on it was 20-35% faster over the
30 layers of SmolLM2 at 1-38 rows and the same from 256 rows up, and 1.4-2x faster for
the LM head (docs/benchmarks.md). The packed tensors replace the float32 weights, so
memory does not grow, except for a tied LM head: its packed copy sits beside the
embedding, whose lookup needs the dense rows. `dense_weight` gives a weight back in the
usual layout.
"""

import torch
from torch import nn

from weir.services.executor.model import PROJECTIONS, CausalLM, Linear


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """`Linear` with its weight in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the addition fused into the matmul."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()


@torch.no_grad()
def pack_model(model: CausalLM) -> None:
    """Replace every layer's loaded projections with packed ones, and pack the LM head (in
    place). A tied LM head is packed as a copy: the embedding lookup keeps the dense rows."""
    for layer in model.layers:
        for name in PROJECTIONS:
            linear: Linear = getattr(layer, name)
            setattr(layer, name, PackedLinear(linear.weight, linear.bias))
    if model.lm_head is None:
        model.packed_lm_head = PackedLinear(model.embed_tokens)
    else:
        model.packed_lm_head = PackedLinear(model.lm_head)
        model.lm_head = nn.Parameter(torch.empty(0, model.config.hidden_size), False)
