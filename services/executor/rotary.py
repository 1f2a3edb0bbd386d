"""Rotary position embeddings: each scaling type's inverse frequencies, as transformers
computes them (`shared/rope_config.py` reads the config), and the cos and sin of a step's
tokens, computed once per step for every layer.

A LongRoPE model rotates some tokens by its long factors and the others by its short ones
(the rule is in `shared/rope_config.py`). The executor says which by the position it passes:
a token the long factors rotate comes at its position plus ``LONG_ROTATION``
(`StepInputs.rope_positions`), so one int64 tensor carries both through every path, CUDA
graphs' persistent buffers included.
"""

import math

import torch
from torch import nn

from weir.shared.rope_config import LONG_ROTATION, RopeConfig


def inv_freq(rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """The rotation's inverse frequencies [rotary_dim / 2] (fp32, CPU); ``long``: LongRoPE's
    long factors instead of its short ones."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor)
        return 1.0 / (factors * rope.theta**exponents)
    freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        return freq / rope.factor
    if rope.type == "llama3":
        return _llama3(rope, freq)
    if rope.type == "yarn":
        return _yarn(rope, rope.theta**exponents)
    if rope.type == "proportional":
        turning = int(rope.proportion * dim // 2)
        return torch.cat((freq[:turning], torch.zeros(dim // 2 - turning))) / rope.factor
    return freq


def _llama3(rope: RopeConfig, freq: torch.Tensor) -> torch.Tensor:
    factor, old_len = rope.factor, rope.original_max_position
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, pos_freqs: torch.Tensor) -> torch.Tensor:
    """Interpolated (divided by the factor) below the channels that turn fewer than
    beta_slow times over the original context, extrapolated (unchanged) above those turning
    more than beta_fast times, a linear ramp between."""
    dim = rope.rotary_dim

    def channel(rotations: float) -> float:
        turns = rope.original_max_position / (rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(rope.theta))

    low, high = channel(rope.beta_fast), channel(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


class Rotary(nn.Module):
    """cos and sin [T, 1, rotary_dim / 2] of each token's rotation, in fp32 then cast, as
    transformers computes them (so bf16 rotations match), scaled by the type's attention
    factor."""

    # Buffers (register_buffer), which nn.Module's attribute lookup types only as Tensor | Module.
    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None

    def __init__(self, rope: RopeConfig, device: torch.device) -> None:
        super().__init__()
        self.attention_factor = rope.attention_factor
        self.register_buffer("inv_freq", inv_freq(rope).to(device), persistent=False)
        long = inv_freq(rope, long=True).to(device) if rope.type == "longrope" else None
        self.register_buffer("long_inv_freq", long, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.long_inv_freq is None:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
        else:
            long = (positions >= LONG_ROTATION).unsqueeze(-1)
            position = (positions % LONG_ROTATION).float().unsqueeze(-1)
            freqs = position * torch.where(long, self.long_inv_freq, self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
