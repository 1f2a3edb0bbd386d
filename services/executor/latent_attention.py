"""DeepSeek's multi-head latent attention (MLA), run over the paged cache as one KV head.

Each token caches what every head's keys and values are made of: its rotated channels and
its normalized latent, one row of qk_rope_head_dim + kv_lora_rank channels (576 in
DeepSeek-V2 and V3, against 2 x 128 heads x 128-192 channels of plain multi-head
attention). Each head's part of ``kv_b_proj`` is absorbed into its query and its output
(vLLM's and DeepSeek's own decode path): a head's no-position query channels times its key
up-projection give its query against the latent, so its score is the query row against the
cache row, and the latent rows weighted by its softmax, times its value up-projection, are
its output. The attention kernels then see a grouped-query attention of num_heads query heads
over one KV head whose values are its keys: the cache holds each row once (its value half is
a view of its key half) and the kernels' output keeps the latent channels.
"""

import torch
from torch import nn

from weir.services.executor.attention import AttentionBackend, AttentionMetadata
from weir.services.executor.layers import LayerKernels, Linear, RMSNorm, rope_
from weir.shared.model_config import ModelConfig
from weir.shared.shard_layout import ShardLayout

# transformers builds DeepSeek's latent norms with their class's default epsilon, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """One layer's latent attention up to the output projection (the decoder layer's
    o_proj); under tensor parallelism this rank's heads, the latents whole on every rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        kernels: LayerKernels | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        mla = cfg.latent_attention
        assert mla is not None
        h, heads = cfg.hidden_size, layout.num_heads
        self.num_heads, self.kernels = heads, kernels
        self.rope_dim, self.nope_dim = mla.qk_rope_head_dim, mla.qk_nope_head_dim
        self.latent_dim, self.v_head_dim = mla.kv_lora_rank, mla.v_head_dim
        self.interleaved_rope = mla.interleaved_rope
        q_rows = heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_proj = None
            self.q_a_proj: Linear | None = Linear(h, mla.q_lora_rank, cfg.qkv_bias, device, dtype)
            self.q_a_layernorm: RMSNorm | None = RMSNorm(
                mla.q_lora_rank, LATENT_NORM_EPS, device, dtype, kernels
            )
            self.q_b_proj: Linear | None = Linear(mla.q_lora_rank, q_rows, False, device, dtype)
        else:
            self.q_proj = Linear(h, q_rows, False, device, dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj = Linear(h, self.latent_dim + self.rope_dim, cfg.qkv_bias, device, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS, device, dtype, kernels)
        # Read by head, as two batched matmuls (never as a projection of the latent).
        self.kv_b_proj = Linear(
            self.latent_dim, heads * (self.nope_dim + self.v_head_dim), False, device, dtype
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention: AttentionBackend,
        scale: float,
        query_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The heads' outputs [T, heads x v_head_dim] of x [T, hidden], K/V of its tokens
        written to ``kv_cache`` first. ``query_scale`` [T, 1, 1]: Mistral 4's factor of each
        token's queries after their rotation, which scales its absorbed latent query alike."""
        num_tokens, heads, rope = x.shape[0], self.num_heads, self.rope_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(num_tokens, heads, -1).split((self.nope_dim, rope), dim=-1)
        latent, k_rope = self.kv_a_proj(x).split((self.latent_dim, rope), dim=-1)
        up = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_head_dim, self.latent_dim)
        # The queries and the token's cache row side by side, as a decoder layer's q and k
        # heads: [rotated channels | latent channels], so one rotation turns both.
        qk = torch.empty(
            num_tokens, heads + 1, rope + self.latent_dim, dtype=x.dtype, device=x.device
        )
        qk[:, :heads, :rope] = q_rope
        absorbed = torch.bmm(q_nope.transpose(0, 1), up[:, : self.nope_dim])
        qk[:, :heads, rope:] = absorbed.transpose(0, 1)
        qk[:, heads, :rope] = k_rope
        qk[:, heads, rope:] = self.kv_a_layernorm(latent)
        rope_(qk[..., :rope], cos, sin, self.kernels)
        query, row = qk.split((heads, 1), dim=1)
        if query_scale is not None:
            query = query * query_scale
        attention.write_kv(row, row, kv_cache, meta)
        out = attention.attend(query, kv_cache, meta, scale)
        latents = out[..., rope:].transpose(0, 1).to(x.dtype)
        values = torch.bmm(latents, up[:, self.nope_dim :].transpose(1, 2))
        return values.transpose(0, 1).reshape(num_tokens, heads * self.v_head_dim)

    @torch.no_grad()
    def deinterleave_rope(self) -> None:
        """Reorder the rows that make the rotated channels from DeepSeek's adjacent pairs
        (x0, x1), (x2, x3)... to the first half against the second, as Weir rotates: the same
        permutation of a query's and a key's channels leaves their product, the score, as it
        was."""
        if not self.interleaved_rope:
            return
        order = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
        q = self.q_proj if self.q_proj is not None else self.q_b_proj
        assert q is not None
        rows = q.weight.view(self.num_heads, -1, q.weight.shape[1])[:, self.nope_dim :]
        rows.copy_(rows[:, order.to(rows.device)].clone())
        kv = self.kv_a_proj
        _permute_last_rows(kv.weight, order, self.rope_dim)
        if kv.bias is not None:
            _permute_last_rows(kv.bias, order, self.rope_dim)


def _permute_last_rows(t: torch.Tensor, order: torch.Tensor, n: int) -> None:
    tail = t[t.shape[0] - n :]
    tail.copy_(tail[order.to(t.device)].clone())
