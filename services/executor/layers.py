"""The building blocks of a decoder layer: RMSNorm (and Cohere's LayerNorm), a projection,
rotate-half RoPE and the MLP's activation, each in one kernel where `LayerKernels` has one."""

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn

from weir.services.executor.attention import AttentionBackend

M = TypeVar("M", bound=nn.Module)

if TYPE_CHECKING:

    class ModuleList(nn.ModuleList, Generic[M]):
        """``nn.ModuleList`` as the type checker sees it: of one kind of module, which
        iterating and indexing give (torch's says only ``nn.Module``)."""

        def __init__(self, modules: Iterable[M] | None = None) -> None: ...

        def __iter__(self) -> Iterator[M]: ...

        @overload
        def __getitem__(self, idx: slice) -> "ModuleList[M]": ...

        @overload
        def __getitem__(self, idx: int) -> M: ...

        def __getitem__(self, idx: int | slice) -> "M | ModuleList[M]": ...

else:
    # At run time torch's own: the models' loops pay nothing for the typing.
    ModuleList = nn.ModuleList


class LayerKernels(Protocol):
    """A layer's elementwise work in one kernel each: the native CPU kernels
    (`weir.kernels.cpu_native.CpuKernels`) or the Triton ones on a GPU
    (`weir.kernels.triton_layers.TritonLayerKernels`). Without them, PyTorch operators."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None: ...

    def silu_mul_(self, gate_up: torch.Tensor) -> torch.Tensor: ...


def layer_kernels_for(attention: AttentionBackend, device: torch.device) -> LayerKernels | None:
    """The native CPU kernels where the attention backend loaded them, the Triton ones on
    CUDA, else None."""
    if attention.kernels is not None:
        return attention.kernels
    if device.type == "cuda":
        # Imported only here: importing triton is slow and needs a GPU or the interpreter.
        from weir.kernels.triton_layers import TritonLayerKernels

        return TritonLayerKernels()
    return None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF Llama convention). x: [T, heads, D]; cos, sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out


def rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: "LayerKernels | None"
) -> None:
    """Rotate-half RoPE of x [T, heads, D] in place (x may be a view of each head's first D
    channels); cos, sin: [T, 1, D/2]."""
    if kernels is not None:
        kernels.rope_(x, cos.squeeze(1), sin.squeeze(1))
    else:
        x.copy_(apply_rope(x, cos, sin))


class Vector(nn.Module):
    """One parameter named ``weight``, as the loader fills a module's (a checkpoint's bare
    tensors: A_log, dt_bias, layer_scalar)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype), False)


class RMSNorm(nn.Module):
    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        size: int,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        kernels: LayerKernels | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(
            torch.empty(size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.weight.dtype == x.dtype:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; the same result as the two below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.weight.dtype == torch.float32:  # Gemma's: scaled in fp32 too, then cast
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        # Normalize in fp32 and scale in the model dtype, like HF, so bf16 outputs match.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def normalize(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x's rows normalized by a float32 mean square of their own (a whole row's, where
        tensor parallelism holds some of its columns here), scaled as ``forward`` scales."""
        normed = x.float() * torch.rsqrt(mean_square + self.eps)
        if self.weight.dtype == torch.float32:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_unit_offset(self) -> None:
        """Scale by (1 + weight) from now on, as Gemma's norms do: the sum kept in fp32,
        where transformers computes it."""
        self.weight = nn.Parameter(self.weight.float() + 1.0, requires_grad=False)


class LayerNorm(nn.Module):
    """A LayerNorm of x's last dimension (the mean subtracted too), computed and scaled in
    float32 and only then rounded to x's dtype, as transformers' CohereLayerNorm; with
    ``bias`` (Starcoder2's) a bias added too. ``shape`` (size,), or (heads, size) for Command
    R+'s q/k norms, a weight row per head."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        shape: tuple[int, ...],
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(shape, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps) * self.weight.float()
        if self.bias is not None:
            normed += self.bias.float()
        return normed.to(x.dtype)


class Linear(nn.Module):
    """nn.Linear without the random init: every weight is loaded from the checkpoint.
    ``kernels`` serve ``silu_mul`` (a gated MLP's gate/up projection)."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
        kernels: LayerKernels | None = None,
    ):
        super().__init__()
        self.kernels = kernels
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), with the addition done by the matmul itself, into ``residual``
        (a layer's residual stream is its own): out of place, the matmul first copies
        ``residual`` into its output, a device-to-device copy per projection on CUDA."""
        out = residual.addmm_(x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, this being a gated MLP's fused gate/up projection."""
        return silu_and_mul(self(x), self.kernels)


def act_and_mul(gate_up: torch.Tensor, act: str, kernels: LayerKernels | None) -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2 * I], ``act`` one of `ModelConfig.hidden_act`'s:
    SiLU (below) or another of `activation`'s."""
    if act == "silu":
        return silu_and_mul(gate_up, kernels)
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate, act).mul_(up)


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act`` of x, new: SiLU, the tanh-approximated GELU (Gemma's, Starcoder2's) or the
    squared ReLU (Arcee's relu2)."""
    if act == "silu":
        return F.silu(x)
    if act == "relu2":
        return F.relu(x).square_()
    return F.gelu(x, approximate="tanh")


def silu_and_mul(gate_up: torch.Tensor, kernels: LayerKernels | None) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I], in place in its gate half: no new [T, I]
    tensor."""
    if kernels is not None:
        return kernels.silu_mul_(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
