"""Projection weights prepacked for the CPU's matmul (float32 on the CPU, the default there).

`F.linear` on a CPU runs MKL's GEMM, which repacks the weight into its blocked layout on
every call; a decode step multiplies a few dozen rows by every weight of the model, so
that repacking costs about as much as the arithmetic. Each projection and the LM head is
therefore packed once at load time (a mixture of experts' experts one by one):

- with the native CPU kernels built (`weir.kernels.cpu_native`), into their panels of 16
  weight rows, multiplied by their register-blocked GEMM (6 x 16 with 256-bit vectors, 6 x 32
  with AVX-512): on the AVX2 machines measured 1.15-1.25x oneDNN at a decode step's 8-64 rows
  and as fast or faster at prefill sizes; on an AVX-512 one the projections 1.12-1.17x at
  1-64 rows (the LM head 0.96-1.06x), 0.8-1.05x from 256 (docs/benchmarks.md);
- otherwise into oneDNN's layout (`mkldnn._reorder_linear_weight`, the prepacking PyTorch's
  own compiler uses) for oneDNN's matmul: 20-35% faster than `F.linear` at 1-38 rows,
  1.4-2x for the LM head.

The packed tensors replace the float32 weights, so memory does not grow, except for a tied
LM head: its packed copy sits beside the embedding, whose lookup needs the dense rows.
`dense_weight` gives a weight back in the usual layout.

`--dtype bfloat16` on a CPU with the native kernels (`cpu_dtypes`) packs the projections and
the LM head in bfloat16 over a float32 model: the matmul rounds its input rows to bfloat16 and
sums in float32 (AVX512_BF16's pair dot products where the CPU has them, 1.5-1.8x the float32
panels' rate), while norms, attention's arithmetic and the residual stream stay float32, as
llama.cpp runs a BF16 GGUF (the runner keeps a bfloat16 KV cache). Elsewhere bfloat16 is the
whole model's dtype.
"""

import os
from collections.abc import Callable

import torch
from torch import nn

from weir.kernels import cpu_native
from weir.kernels.cpu_native import PANEL, CpuKernels, is_bf16_panels
from weir.services.executor.layers import Linear, ModuleList, silu_and_mul
from weir.services.executor.model import PROJECTIONS, CausalLM
from weir.services.executor.moe import SparseMoe


def can_pack(device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and (kernels is not None or torch.backends.mkldnn.is_available())
        and os.environ.get("WEIR_PACK_CPU_WEIGHTS", "1") != "0"
    )


def cpu_dtypes(
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    attention_backend: str | None = None,
) -> tuple[torch.dtype, torch.dtype]:
    """(the model's dtype, its packed weights' dtype) for ``--dtype`` ``dtype``: bfloat16 on a
    CPU whose native kernels compiled and serve the model (the default attention backend, or
    "native"), with no other weight format asked for, is bfloat16 weights over a float32
    model; otherwise both are ``dtype``."""
    if (
        device.type != "cpu"
        or dtype != torch.bfloat16
        or quantization is not None
        or attention_backend not in (None, "native")
    ):
        return dtype, dtype
    kernels = cpu_native.load()
    if kernels is None or not can_pack(device, torch.float32, kernels):
        return dtype, dtype
    return torch.float32, torch.bfloat16


class PackedLinear(nn.Module):
    """`Linear` with its weight prepacked: the native kernels' panels when `kernels` is
    given (float32 or bfloat16, as ``weight`` is), oneDNN's blocked layout otherwise."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        # torch.ops are untyped: oneDNN's blocked layout is a tensor all the same.
        self.weight: torch.Tensor
        if kernels is None:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            self.weight = kernels.pack_panels(weight)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.weight, self.out_features, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [None], ""
        )
        return out

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the addition fused into the matmul."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.weight, self.out_features, self.bias, residual)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x, residual, self.weight, self.bias, "add"
        )
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, this being a gated MLP's fused gate/up projection: with the native
        kernels in the matmul's own pass (when each half fills whole panels)."""
        if self.kernels is None or self.out_features % (2 * PANEL):
            return silu_and_mul(self(x), self.kernels)
        return self.kernels.linear_silu_mul(x, self.weight, self.out_features // 2, self.bias)

    def dense_weight(self) -> torch.Tensor:
        if self.kernels is None:
            return self.weight.to_dense()
        # panels[p, c, j] holds weight[p * 16 + j, c] (bf16: inputs 2c and 2c + 1)
        panels = self.weight
        if is_bf16_panels(panels):
            panels = panels.view(torch.bfloat16).unflatten(2, (PANEL, 2)).transpose(2, 3)
            panels = panels.flatten(1, 2)
        rows = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])
        return rows[: self.out_features, : self.in_features].contiguous()


@torch.no_grad()
def pack_model(model: CausalLM, weight_dtype: torch.dtype = torch.float32) -> None:
    """Replace every layer's loaded projections with packed ones, and pack the LM head (in
    place), their weights in ``weight_dtype`` (bfloat16 with the native kernels only). A tied
    LM head is packed as a copy: the embedding lookup keeps the dense rows."""
    kernels = model.attention.kernels
    if weight_dtype != torch.float32 and kernels is None:
        raise ValueError(f"{weight_dtype} weight panels need the native CPU kernels")

    def packed(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        return PackedLinear(weight.to(weight_dtype), bias, kernels)

    for layer in model.layers:
        for name in PROJECTIONS:
            linear: Linear | None = getattr(layer, name)
            if linear is not None:  # an MoE layer has no dense MLP (but Gemma 4's)
                setattr(layer, name, packed(linear.weight, linear.bias))
        if layer.mla is not None:  # its kv_b_proj is read by head, never as a projection
            for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj"):
                linear = getattr(layer.mla, name)
                if linear is not None:
                    setattr(layer.mla, name, packed(linear.weight, linear.bias))
        if layer.moe is not None:
            _pack_experts(layer.moe, packed)
    if model.lm_head is None:
        model.packed_lm_head = packed(model.embed_tokens)
    else:
        model.packed_lm_head = packed(model.lm_head)
        model.lm_head = nn.Parameter(torch.empty(0, model.config.hidden_size), False)


def _pack_experts(
    moe: SparseMoe, packed: Callable[[torch.Tensor, torch.Tensor | None], PackedLinear]
) -> None:
    """Each expert's projections, and the shared expert's, packed; the stacked weights freed."""
    experts = range(moe.experts_gate_up.shape[0])
    gate_up_bias, down_bias = moe.experts_gate_up_bias, moe.experts_down_bias
    moe.packed_gate_up = ModuleList(
        packed(moe.experts_gate_up[e], _row(gate_up_bias, e)) for e in experts
    )
    moe.packed_down = ModuleList(packed(moe.experts_down[e], _row(down_bias, e)) for e in experts)
    hidden = moe.experts_down.shape[1]
    moe.experts_gate_up = nn.Parameter(torch.empty(0, 0, hidden), False)
    moe.experts_down = nn.Parameter(torch.empty(0, hidden, 0), False)
    moe.experts_gate_up_bias = moe.experts_down_bias = None
    for name in ("shared_gate_up", "shared_down"):
        linear: Linear | None = getattr(moe, name)
        if linear is not None:
            setattr(moe, name, packed(linear.weight, linear.bias))


def _row(stacked: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if stacked is None else stacked[expert]
