"""Qwen3-Next's and Qwen 3.5's Gated DeltaNet: their linear-attention layers' token mixer.

The layer's input projection (Qwen 3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, or
Qwen3-Next's in_proj_qkvz and in_proj_ba taken apart by key head, fused into the decoder
layer's ``qkv_proj``) gives each token its q/k/v channels, an output gate z per value head
and the update's strength (beta) and decay (g) per value head; the q/k/v channels pass a
causal depthwise convolution, then the gated delta rule reads and updates each request's state
(`kernels/gated_delta_net.py`); the heads' outputs are RMS-normalized, gated by SiLU(z), and
leave through the layer's ``o_proj`` (the checkpoint's out_proj). Under tensor parallelism a
rank holds some key heads and the value heads they serve, and their channels.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from weir.kernels.cpu_native import CpuKernels
from weir.kernels.gated_delta_net import (
    DecodeStep,
    StateBatch,
    causal_conv1d,
    gated_delta_rule,
)
from weir.services.executor.layers import LayerKernels, Vector
from weir.shared.model_config import ModelConfig
from weir.shared.shard_layout import ShardLayout


class GatedDeltaNet(nn.Module):
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        kernels: LayerKernels | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        # The native CPU kernels' convolution and decode step; Triton's decode step on a GPU
        # (its convolution PyTorch's).
        self.conv_kernels = kernels if isinstance(kernels, CpuKernels) else None
        self.decode_step = kernels if isinstance(kernels, DecodeStep) else None
        la = cfg.linear_attention
        assert la is not None
        self.num_k_heads, self.num_v_heads = layout.linear_k_heads, layout.linear_v_heads
        self.head_k_dim, self.head_v_dim = la.head_k_dim, la.head_v_dim
        self.conv_dim, self.value_dim = layout.linear_conv_dim, layout.linear_value_dim
        self.eps = cfg.rms_norm_eps
        self.conv1d = Vector((self.conv_dim, la.conv_kernel_size), device, dtype)
        self.dt_bias = Vector((self.num_v_heads,), device, dtype)
        self.A_log = Vector((self.num_v_heads,), device, dtype)
        # Not one of the model's (1 + weight) norms: this one scales by its weight as it is.
        self.norm = Vector((self.head_v_dim,), device, dtype)

    @property
    def in_rows(self) -> int:
        """The input projection's rows: q/k/v channels, z, beta's and g's inputs."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    def forward(
        self,
        mixed: torch.Tensor,
        states: StateBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """The gated heads' outputs [T, value_dim] for the input projection's rows [T,
        in_rows] of a step's tokens, the requests' states read and updated in place."""
        num_tokens = mixed.shape[0]
        qkv, z, b, a = mixed.split(
            (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads), dim=-1
        )
        qkv = causal_conv1d(qkv, self.conv1d.weight, None, conv_state, states, self.conv_kernels)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = qkv.split((key_dim, key_dim, self.value_dim), dim=-1)
        beta = b.sigmoid()
        # In float32: in half precision exp(A_log) may overflow.
        g = -self.A_log.weight.float().exp() * F.softplus(a.float() + self.dt_bias.weight)
        out = gated_delta_rule(
            q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
            v.reshape(num_tokens, self.num_v_heads, self.head_v_dim),
            g,
            beta,
            recurrent_state,
            states,
            self.decode_step,
        )
        return self._gated_norm(out, z.reshape(out.shape)).reshape(num_tokens, self.value_dim)

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head's output RMS-normalized (in float32, scaled in the model's dtype), then
        gated by SiLU(z) in float32, as transformers' Qwen3_5RMSNormGated."""
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        scaled = self.norm.weight * normed.to(dtype)
        return (scaled * F.silu(gate.float())).to(dtype)
