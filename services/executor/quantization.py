"""Weights kept quantized on the CPU (``--quantization int8``).

int8 is weight-only: every projection and the (tied) embedding / LM head are stored as int8
with one scale per output row, symmetric, requantized from the loaded weights (for a
quantized GGUF, from its dequantized weights). Activations stay float32 between the matmuls
and (but for AMX's tiles) in them:

- with the native CPU kernels (`weir.kernels.cpu_native`), the codes are packed into int8
  panels once and every matmul, whatever its rows, is the panel matmul over them: each step's
  16 codes widened to float32 in registers, the scales applied to the sums, the bias, the
  residual add and a gated MLP's SiLU in the same pass. It reads a quarter of float32's bytes
  and ran 1.0-2.3x the row-major int8 decode kernel it replaced at 1-8 rows and 1.1-3.6x the
  dequantize-then-GEMM path from 16 rows. On a CPU with AMX, from 24 rows, the panels run on
  its tiles: the codes made bf16 (exactly) and x split into two bf16 parts, hi + lo, so x
  carries 16 significant bits there instead of 24: 1.4-2.1x from 32 rows (docs/benchmarks.md);
- otherwise PyTorch: up to ``PACKED_MAX_ROWS`` rows its ``_weight_int8pack_mm``, whose x86
  kernel is vectorized for bfloat16 inputs only (float32 inputs take a scalar loop, ~50x
  slower), so those rows go in as bfloat16 and come back as bfloat16; more rows dequantize the
  weights to float32 one block of output rows at a time into a scratch buffer that stays in
  cache and multiply with the float32 GEMM.

The per-tensor dynamic activation quantization of fbgemm (``quantized.linear_dynamic``) is
faster still but changes SmolLM2's greedy tokens too often (top-1 agreement with float32
0.58 with per-tensor scales), so it is not offered.
"""

from collections.abc import Callable

import torch
from torch import nn

from weir.kernels.cpu_native import PANEL, CpuKernels
from weir.services.executor.layers import Linear, silu_and_mul
from weir.services.executor.model import PROJECTIONS, CausalLM
from weir.shared.config import QUANTIZATION_METHODS

# Without the native kernels: PyTorch's packed kernel wins at 8 rows, loses at 16 (measured).
PACKED_MAX_ROWS = 8
# Output rows dequantized at a time on the float32 path: a block of at most 1024 x K floats.
_DEQUANT_ROWS = 1024


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError naming the fix when ``method`` cannot run on ``device`` in ``dtype``."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS} or unset, got {method!r}"
        )
    if device.type != "cpu":
        raise ValueError(
            f"quantization {method!r} runs on the CPU only (device {device}); drop "
            "--quantization or use --device cpu"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"quantization {method!r} keeps activations in float32; got dtype "
            f"{str(dtype).removeprefix('torch.')} (use --dtype float32 or leave it unset)"
        )


class Int8Weight(nn.Module):
    """A [rows, K] weight as int8 codes with a per-row scale: ``w ~= codes * scale[:, None]``;
    the codes in the native kernels' int8 panels when `kernels` is given, row-major otherwise."""

    # Buffers (register_buffer), which nn.Module's attribute lookup types only as Tensor | Module.
    scale: torch.Tensor
    qweight: torch.Tensor  # [rows, K], without kernels
    scale_bf16: torch.Tensor  # without kernels
    panels: torch.Tensor  # with kernels

    def __init__(self, weight: torch.Tensor, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_features = weight.shape[0]
        absmax = weight.abs().amax(dim=1).float().clamp_(min=1e-12)
        # PyTorch's packed kernel takes bfloat16 scales: pick bf16 values no smaller than
        # absmax / 127 (bf16 rounds by at most 2^-9), so the int8 codes use exactly the scale
        # the kernel applies and never clip (and both paths quantize alike).
        scale = (absmax / 127 * (1 + 2**-8)).to(torch.bfloat16)
        codes = torch.round(weight.float() / scale.float()[:, None]).clamp_(-127, 127)
        codes = codes.to(torch.int8)
        self.register_buffer("scale", scale.float())
        if kernels is None:
            self.register_buffer("qweight", codes)
            self.register_buffer("scale_bf16", scale)
        else:
            self.register_buffer("panels", kernels.pack_panels(codes))

    def codes(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 codes of rows ``index`` (all rows when None), [*index.shape, K]."""
        if self.kernels is None:
            return self.qweight if index is None else self.qweight[index]
        if index is None:  # panels[p, c, j] holds row p * 16 + j's code c
            return self.panels.permute(0, 2, 1).flatten(0, 1)[: self.out_features]
        return self.panels[index // PANEL, :, index % PANEL]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``index`` (an embedding lookup)."""
        return self.codes(index).float().mul_(self.scale[index].unsqueeze(-1))

    def matmul(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(residual +) x @ w.T (+ bias)`` in float32, [M, rows]."""
        if self.kernels is not None:
            return self.kernels.linear(
                x, self.panels, self.out_features, bias, residual, self.scale
            )
        out = self._torch_matmul(x)
        if residual is not None:
            out.add_(residual)
        return out if bias is None else out.add_(bias)

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up, this being a gated MLP's fused gate/up weight (gate rows first)."""
        if self.kernels is not None and self.out_features % (2 * PANEL) == 0:
            n = self.out_features // 2
            return self.kernels.linear_silu_mul(x, self.panels, n, bias, self.scale)
        return silu_and_mul(self.matmul(x, bias=bias), self.kernels)

    def _torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS:
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(
                x.bfloat16(), self.qweight, self.scale_bf16
            )
            return y.float()
        n, k = self.qweight.shape
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        block = torch.empty(min(n, _DEQUANT_ROWS), k, dtype=torch.float32)
        for start in range(0, n, _DEQUANT_ROWS):
            end = min(start + _DEQUANT_ROWS, n)
            w = block[: end - start]
            torch.mul(self.qweight[start:end], self.scale[start:end, None], out=w)
            torch.mm(x, w.t(), out=out[:, start:end])
        return out


class Int8Linear(nn.Module):
    """`Linear` with its weight kept as an `Int8Weight` (the bias, if any, in float32)."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(self, linear: Linear, kernels: CpuKernels | None) -> None:
        super().__init__()
        self.weight = Int8Weight(linear.weight.detach(), kernels)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x, bias=self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x)."""
        return self.weight.matmul(x, residual, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, this being a gated MLP's fused gate/up projection."""
        return self.weight.silu_mul(x, self.bias)


@torch.no_grad()
def quantize_model(model: CausalLM, method: str) -> None:
    """Replace the loaded float32 projections, embedding and LM head with ``method``'s
    quantized versions (in place; the float32 copies are freed)."""
    check_quantization(method, model.device, model.dtype)
    kernels = model.attention.kernels
    for layer in model.layers:
        for name in PROJECTIONS:
            setattr(layer, name, Int8Linear(getattr(layer, name), kernels))
    model.quantized_embed = Int8Weight(model.embed_tokens, kernels)
    model.embed_tokens = nn.Parameter(torch.empty(0, model.config.hidden_size), False)
    if model.lm_head is not None:
        model.quantized_lm_head = Int8Weight(model.lm_head, kernels)
        model.lm_head = nn.Parameter(torch.empty(0, model.config.hidden_size), False)
