"""Decoder-only transformer for the Llama family (Mistral, Ministral, Phi-3, Granite too),
Qwen2 / Qwen3, their mixtures of experts included (`moe.py`), Gemma 2 and 3, gpt-oss, SmolLM3,
OLMo 2 and 3, EXAONE 4 and Cohere's Command R, on a flat token batch (and the others
docs/architecture.md lists).

A step's tokens from all requests are concatenated into one batch of T tokens; the
`AttentionMetadata` says which request each token belongs to and where its K/V goes in the
paged cache. Projections are fused (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so
each layer runs four matmuls; `weights.py` maps Hugging Face checkpoint names onto them.
Under tensor parallelism each rank builds only its `ShardLayout` share of every layer and
sums the row-parallel partial products through `TensorParallel` (see `parallel.py`).
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from weir.kernels.reference import AttentionSpan
from weir.services.executor.attention import AttentionBackend, AttentionMetadata
from weir.services.executor.image_inputs import ImageEmbeds
from weir.services.executor.latent_attention import LatentAttention
from weir.services.executor.layers import (
    LayerKernels,
    LayerNorm,
    Linear,
    ModuleList,
    RMSNorm,
    Vector,
    act_and_mul,
    activation,
    apply_rope,
    rope_,
)
from weir.services.executor.linear_attention import GatedDeltaNet
from weir.services.executor.linear_states import LinearStates, LinearStep
from weir.services.executor.moe import SparseMoe
from weir.services.executor.parallel import TensorParallel
from weir.services.executor.rotary import Rotary
from weir.services.executor.vision_towers import build_tower
from weir.shared.model_config import GEMMA_TYPES, ModelConfig
from weir.shared.shard_layout import ShardLayout

if TYPE_CHECKING:  # lora.py, quantization.py and packed_weights.py build on this module
    from weir.services.executor.lora import LoraBatch
    from weir.services.executor.packed_weights import PackedLinear
    from weir.services.executor.quantization import Int8Weight

CPU_LOGITS_SLICE = 1024  # vocab rows per matmul when computing logits on a CPU
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a DecoderLayer's matmuls


def _block_norm(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kernels: LayerKernels | None,
) -> RMSNorm | LayerNorm:
    """The norm of the hidden states before a layer's block and after the last layer."""
    if cfg.layer_norms:
        return LayerNorm((cfg.hidden_size,), cfg.rms_norm_eps, device, dtype, cfg.norm_bias)
    norm_dtype = torch.float32 if cfg.float32_norms else dtype
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, norm_dtype, kernels)


def attention_span(cfg: ModelConfig, index: int) -> AttentionSpan | None:
    """The keys layer ``index`` attends to below each token's own: its sliding window, or
    Llama 4's chunk on its rotated layers; None: every earlier key."""
    window, chunk = cfg.layer_window(index), cfg.layer_chunk(index)
    if window is not None:
        return AttentionSpan(window)
    return None if chunk is None else AttentionSpan(chunk, chunked=True)


class AttentionSinks(nn.Module):
    """gpt-oss' learned logit per query head (this rank's heads), one more term of each of
    the head's softmax denominators; float32 whatever the model's dtype, as the kernels
    read it."""

    def __init__(self, num_heads: int, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_heads, device=device, dtype=torch.float32), requires_grad=False
        )


class DecoderLayer(nn.Module):
    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        index: int,
        cfg: ModelConfig,
        layout: ShardLayout,
        tp: TensorParallel | None,
        attention: AttentionBackend,
        kernels: LayerKernels | None,
        device: torch.device,
        dtype: torch.dtype,
        kv_scales: bool = False,
    ):
        super().__init__()
        self.index = index
        # The layer's own shapes (``ModelConfig.for_layer``): what its weights load by.
        self.config, self.layout = cfg, layout
        h, d, inter = cfg.hidden_size, cfg.head_dim, layout.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, d
        self.q_size, self.kv_size = layout.num_heads * d, layout.num_kv_heads * d
        self.scale = cfg.attention_multiplier or d**-0.5
        self.span = attention_span(cfg, index)
        self.softcap = cfg.attn_logit_softcapping
        # Which rotation the model's forward computes for this layer (Gemma 3's local ones).
        self.local_rope = index in cfg.sliding_layers and cfg.sliding_rope is not None
        # The first rotary_dim channels of each head rotate (all but in Phi-4-mini; none in
        # SmolLM3's NoPE layers).
        rope = cfg.sliding_rope if self.local_rope and cfg.sliding_rope else cfg.rope
        self.rotary_dim = 0 if index in cfg.nope_layers else rope.rotary_dim
        # Llama 4's q/k norms without a weight, of its rotated layers only.
        self.qk_l2_norm_eps = cfg.rms_norm_eps if cfg.qk_l2_norm and self.rotary_dim else None
        # Whether the model's query scale applies here: Ministral 3's and Mistral 4's every
        # layer, Llama 4's NoPE layers only.
        self.scales_queries = not (cfg.attn_temperature_tuning and self.rotary_dim)
        self.hidden_act = cfg.hidden_act
        self.attention = attention
        self.kernels = kernels
        self.tp = tp
        # Row-parallel biases are added once, by rank 0, before the partial sums are reduced.
        row_bias = layout.rank == 0
        eps = cfg.rms_norm_eps
        norm_dtype = torch.float32 if cfg.float32_norms else dtype
        self.input_layernorm = None if cfg.olmo_norms else _block_norm(cfg, device, dtype, kernels)
        mla = cfg.latent_attention
        self.mla = None if mla is None else LatentAttention(cfg, layout, kernels, device, dtype)
        # Qwen3-Next's and Qwen 3.5's linear-attention layer: its input projection takes
        # qkv_proj's place, its output projection o_proj's (both then pack and quantize as any
        # layer's), neither biased by attention_bias (transformers' attention's alone).
        self.linear_attn = (
            GatedDeltaNet(cfg, layout, kernels, device, dtype)
            if cfg.is_linear_layer(index)
            else None
        )
        attends = self.linear_attn is None
        # Their attention layers: a gate per query channel, after k and v's rows.
        self.gate_size = self.q_size if cfg.attn_output_gate else 0
        # Gemma 4's: a KV-sharing layer projects queries only (it attends over an earlier
        # layer's cache); a full-attention layer's values are its keys' projection, and every
        # layer's values are RMS-normalized without a weight.
        self.shares_kv = cfg.kv_source(index) != index
        self.values_from_keys = cfg.values_from_keys
        self.value_norm_eps = cfg.rms_norm_eps if cfg.value_norm else None
        kv_rows = 0 if self.shares_kv else (1 if cfg.values_from_keys else 2) * self.kv_size
        self.qkv_rows = (
            self.linear_attn.in_rows
            if self.linear_attn is not None
            else self.q_size + kv_rows + self.gate_size
        )
        self.qkv_proj = (
            Linear(cfg.qkv_input_size or h, self.qkv_rows, cfg.qkv_bias and attends, device, dtype)
            if mla is None
            else None
        )
        # Per head, or (OLMo 2 and 3) over the whole q and k projections; Command R+'s
        # LayerNorms per head, each head's weights its own.
        self.qk_norm_heads = not cfg.whole_qk_norms
        self.qk_norm_after_rope = cfg.qk_norm_after_rope
        q_norm, k_norm = (d, d) if self.qk_norm_heads else (self.q_size, self.kv_size)
        self.q_norm: RMSNorm | LayerNorm | None = None
        self.k_norm: RMSNorm | LayerNorm | None = None
        qk_norm = cfg.qk_norm and attends
        if qk_norm and cfg.layer_norms:
            self.q_norm = LayerNorm((layout.num_heads, d), eps, device, dtype)
            self.k_norm = LayerNorm((layout.num_kv_heads, d), eps, device, dtype)
        elif qk_norm:
            self.q_norm = RMSNorm(q_norm, eps, device, norm_dtype)
            self.k_norm = None if self.shares_kv else RMSNorm(k_norm, eps, device, norm_dtype)
        attn_width = (
            layout.linear_value_dim
            if self.linear_attn is not None
            else self.q_size
            if mla is None
            else layout.num_heads * mla.v_head_dim
        )
        self.o_proj = Linear(attn_width, h, cfg.o_bias and row_bias and attends, device, dtype)
        self.sinks = AttentionSinks(layout.num_heads, device) if cfg.attention_sinks else None
        # A calibrated fp8 cache's scales (the checkpoint's k_scale, v_scale): it holds K /
        # k_scale and V / v_scale; on device, read by the kernels' launches and CUDA graphs.
        self.k_scale: nn.Parameter | None
        self.v_scale: nn.Parameter | None
        self.k_scale, self.v_scale = (
            (
                nn.Parameter(torch.empty((), device=device), requires_grad=False),
                nn.Parameter(torch.empty((), device=device), requires_grad=False),
            )
            if kv_scales
            else (None, None)
        )
        # None: Cohere's attention and MLP both read the input norm's output (parallel_block).
        self.post_attention_layernorm = (
            None if cfg.parallel_block else _block_norm(cfg, device, dtype, kernels)
        )
        # Gemma's and OLMo's norms of the attention's and MLP's outputs: post_attention_layernorm
        # then normalizes the attention's output rather than the MLP's input (Gemma's
        # pre_feedforward_layernorm does that).
        self.output_norms = cfg.sandwich_norms or cfg.olmo_norms
        self.pre_feedforward_layernorm = (
            RMSNorm(h, eps, device, norm_dtype, kernels) if cfg.sandwich_norms else None
        )
        self.post_feedforward_layernorm = (
            RMSNorm(h, eps, device, norm_dtype, kernels) if self.output_norms else None
        )
        # A layer's MLP is the experts, one gated MLP, or (Gemma 4's) both side by side, the
        # experts reading their own norm of the residual and each branch's output normalized.
        self.moe = (
            SparseMoe(cfg, layout, kernels, device, dtype) if cfg.is_moe_layer(index) else None
        )
        dense = self.moe is None or cfg.experts_beside_mlp
        beside = self.moe is not None and cfg.experts_beside_mlp

        def beside_norm() -> RMSNorm | None:
            return RMSNorm(h, eps, device, norm_dtype, kernels) if beside else None

        self.pre_feedforward_layernorm_2 = beside_norm()
        self.post_feedforward_layernorm_1 = beside_norm()
        self.post_feedforward_layernorm_2 = beside_norm()
        # Not gated (Starcoder2's, Arcee's): gate_up_proj holds the up projection alone.
        self.gated_mlp = cfg.gated_mlp
        up_rows = (2 if cfg.gated_mlp else 1) * inter
        self.gate_up_proj = (
            Linear(h, up_rows, cfg.mlp_bias, device, dtype, kernels) if dense else None
        )
        self.down_proj = (
            Linear(inter, h, cfg.mlp_bias and row_bias, device, dtype) if dense else None
        )
        # Gemma 4's per-layer input: its gate of the layer's output, projected back to the
        # residual (each rank computes the whole branch: it is small).
        per_layer = cfg.per_layer_input_size
        self.per_layer_input_gate = (
            Linear(h, per_layer, False, device, dtype) if per_layer else None
        )
        self.per_layer_projection = (
            Linear(per_layer, h, False, device, dtype) if per_layer else None
        )
        self.post_per_layer_input_norm = (
            RMSNorm(h, eps, device, norm_dtype, kernels) if per_layer else None
        )
        self.layer_scalar = Vector((1,), device, dtype) if cfg.layer_scalars else None

    def _add_row_parallel(
        self,
        name: str,
        residual: torch.Tensor,
        x: torch.Tensor,
        lora: "LoraBatch | None",
        post_norm: RMSNorm | LayerNorm | None,
    ) -> torch.Tensor:
        """residual + projection ``name`` of x (normalized by ``post_norm`` first where the
        model has one), where each rank holds some of x's columns: rank 0 adds the residual
        to its partial product, the others contribute theirs, one all-reduce sums (an
        adapter's partial updates with them)."""
        linear = getattr(self, name)
        fused = post_norm is None and (self.tp is None or self.tp.rank == 0)
        out = linear.add_to(residual, x) if fused else linear(x)
        if lora is not None:
            lora.add(out, x, self.index, name)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out if post_norm is None else residual + post_norm(out)

    def deinterleave_rope(self) -> None:
        """Reorder each query and key head's rotated rows from adjacent pairs (x0, x1), (x2,
        x3)... (ERNIE 4.5's checkpoints) to the first half against the second, as Weir
        rotates: the same permutation of a query's and a key's channels leaves their
        product, the score, as it was."""
        assert self.qkv_proj is not None
        r = self.rotary_dim
        order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
        num_heads = self.num_heads + self.num_kv_heads  # q's heads, then k's (v's follow)
        for tensor in (self.qkv_proj.weight, self.qkv_proj.bias):
            if tensor is not None:
                heads = tensor[: num_heads * self.head_dim].view(num_heads, self.head_dim, -1)
                heads[:, :r].copy_(heads[:, order.to(tensor.device)].clone())
        for norm in (self.q_norm, self.k_norm):  # Command R+'s: a weight per head and channel
            if isinstance(norm, LayerNorm):
                norm.weight[:, :r] = norm.weight[:, order.to(norm.weight.device)].clone()

    def _whole_qk_norms(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OLMo's q/k RMSNorms over the whole projections. Under tensor parallelism a rank
        holds some heads' channels: one all-reduce sums the squares of q's and k's rows over
        the ranks, each then divided by the channels summed (a KV head replicated on r ranks
        adds its squares r times and its channels r times: the mean is the whole row's)."""
        assert isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm)
        if self.tp is None:
            return self.q_norm(q), self.k_norm(k)
        sums = torch.stack((q.float().square().sum(-1), k.float().square().sum(-1)), dim=-1)
        sums = self.tp.all_reduce(sums)
        n = self.tp.world_size
        return (
            self.q_norm.normalize(q, sums[:, :1] / (n * self.q_size)),
            self.k_norm.normalize(k, sums[:, 1:] / (n * self.kv_size)),
        )

    def _head_norms(self, qk: torch.Tensor) -> torch.Tensor:
        """The Q and K heads (Q alone where the layer shares KV), each normalized by its norm
        of the head."""
        assert self.q_norm is not None
        if self.k_norm is None:
            return self.q_norm(qk)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The Q and K heads (adjacent in the fused projection: one rotation for both) with
        their first rotary_dim channels rotated, in place where a kernel does it."""
        if self.rotary_dim == self.head_dim and self.kernels is None:
            return apply_rope(qk, cos, sin)
        rope_(qk[..., : self.rotary_dim], cos, sin, self.kernels)
        return qk

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: "LoraBatch | None" = None,
        query_scale: torch.Tensor | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query_scale`` [T, 1, 1]: each token's queries are multiplied by it after their
        rotation (Ministral 3's, Mistral 4's; Llama 4's NoPE layers'). ``per_layer_input``
        [T, per_layer_input_size]: Gemma 4's input of this layer."""
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        x = self.residual_block(x, normed, cos, sin, meta, kv_cache, lora, query_scale)
        if per_layer_input is not None:
            x = x + self._per_layer_branch(x, per_layer_input)
        if self.layer_scalar is not None:
            x *= self.layer_scalar.weight
        return x

    def _per_layer_branch(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """Gemma 4's: the layer's output gates its per-layer input, projected back."""
        gate, up, norm = (
            self.per_layer_input_gate,
            self.per_layer_projection,
            self.post_per_layer_input_norm,
        )
        assert gate is not None and up is not None and norm is not None
        return norm(up(activation(gate(x), self.hidden_act) * per_layer_input))

    def residual_block(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: "LoraBatch | None" = None,
        query_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for residual stream ``x`` (added into in place) and the
        attention's input ``normed``: x normalized, or (an EAGLE-3 head's) more than x."""
        if self.linear_attn is not None:
            attn = self._mix_linearly(normed, meta)
        elif self.mla is None:
            attn = self._attend(normed, cos, sin, meta, kv_cache, lora, query_scale)
        else:
            attn = self.mla(
                normed, cos, sin, meta, kv_cache, self.attention, self.scale, query_scale
            )
        if not self.output_norms:
            x = self._add_row_parallel("o_proj", x, attn, lora, None)
            if self.post_attention_layernorm is not None:  # None: the MLP reads `normed` too
                normed = self.post_attention_layernorm(x)
        else:
            x = self._add_row_parallel("o_proj", x, attn, lora, self.post_attention_layernorm)
            ff_norm = self.pre_feedforward_layernorm
            normed = x if ff_norm is None else ff_norm(x)
        if self.moe is not None and self.gate_up_proj is None:
            # The experts in the MLP's place; an adapter never touches a mixture of experts'
            # layer's MLP (shared/lora.py).
            out = self.moe(normed)
            if self.tp is None or self.tp.rank == 0:
                out += x
            return out if self.tp is None else self.tp.all_reduce(out)
        act = self._mlp_activation(normed, lora)
        if self.moe is not None:
            return self._mlp_and_experts(x, act)
        return self._add_row_parallel("down_proj", x, act, lora, self.post_feedforward_layernorm)

    def _mlp_activation(self, normed: torch.Tensor, lora: "LoraBatch | None") -> torch.Tensor:
        """The dense MLP's activation [T, columns on this rank], its down projection's input."""
        assert self.gate_up_proj is not None
        if not self.gated_mlp:  # (adapters of its MLP are refused: shared/lora.py)
            return activation(self.gate_up_proj(normed), self.hidden_act)
        if lora is None and self.hidden_act == "silu":
            return self.gate_up_proj.silu_mul(normed)
        # an adapter's update joins gate/up before the activation
        gate_up = self.gate_up_proj(normed)
        if lora is not None:
            lora.add(gate_up, normed, self.index, "gate_up_proj")
        return act_and_mul(gate_up, self.hidden_act, self.kernels)

    def _mlp_and_experts(self, x: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """Gemma 4's layer output for residual ``x``: its dense MLP's output (the down
        projection of ``act``) and its experts' (on their own norm of x, routed by x itself),
        each normalized, summed, normalized again and added to x. Under tensor parallelism each
        branch's norm needs the branch's whole sum, so the two partial sums cannot be added
        before they are reduced: one all-reduce sums both, side by side."""
        pre_2, post_1 = self.pre_feedforward_layernorm_2, self.post_feedforward_layernorm_1
        post_2, post = self.post_feedforward_layernorm_2, self.post_feedforward_layernorm
        assert pre_2 is not None and post_1 is not None and post_2 is not None
        assert post is not None and self.down_proj is not None and self.moe is not None
        mlp, experts = self.down_proj(act), self.moe(pre_2(x), routed_by=x)
        if self.tp is not None:
            mlp, experts = self.tp.all_reduce(torch.cat((mlp, experts), dim=-1)).chunk(2, dim=-1)
        return x + post(post_1(mlp) + post_2(experts))

    def _mix_linearly(self, normed: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A linear-attention layer's gated heads [T, value_dim], the requests' states
        updated."""
        assert self.linear_attn is not None and self.qkv_proj is not None
        assert meta.linear is not None
        return self.linear_attn(
            self.qkv_proj(normed),
            meta.linear.batch,
            meta.linear.conv[self.index],
            meta.linear.recurrent[self.index],
        )

    def _attend(
        self,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: "LoraBatch | None",
        query_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The heads' outputs [T, q_size] for the normalized states, their K/V cached."""
        num_tokens = normed.shape[0]
        assert self.qkv_proj is not None
        qkv = self.qkv_proj(normed)
        if lora is not None:
            lora.add(qkv, normed, self.index, "qkv_proj")
        if self.gate_size:
            qkv, gate = qkv.split((qkv.shape[-1] - self.gate_size, self.gate_size), dim=-1)
        if self.q_norm is not None and not self.qk_norm_heads:
            q, k, values = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            qkv = torch.cat((*self._whole_qk_norms(q, k), values), dim=-1)
        qkv = qkv.view(num_tokens, -1, self.head_dim)
        if self.shares_kv:
            qk, v = qkv, None
        elif self.values_from_keys:  # the keys' projection, before their norm and rotation
            # (which make new tensors: the value norm, and the q/k norms Gemma 4 always has)
            qk, v = qkv, qkv[:, self.num_heads :]
        else:
            qk, v = qkv.split((self.num_heads + self.num_kv_heads, self.num_kv_heads), dim=1)
        if v is not None and self.value_norm_eps is not None:
            v = F.rms_norm(v.float(), (self.head_dim,), eps=self.value_norm_eps).to(v.dtype)
        if self.q_norm is not None and self.qk_norm_heads and not self.qk_norm_after_rope:
            qk = self._head_norms(qk)
        if self.rotary_dim:
            qk = self._rotate(qk, cos, sin)
        if self.qk_norm_after_rope:
            qk = self._head_norms(qk)
        if self.qk_l2_norm_eps is not None:
            qk = F.rms_norm(qk.float(), (self.head_dim,), eps=self.qk_l2_norm_eps).to(qk.dtype)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if query_scale is not None and self.scales_queries:
            q = (q * query_scale).to(qk.dtype)
        if self.k_scale is not None and self.v_scale is not None:
            # q . (k8 * k_scale) = (q * k_scale) . k8; sum p (v8 * v_scale) = v_scale sum p v8.
            assert v is not None  # KV sharing with calibrated scales is refused (CausalLM)
            self.attention.write_kv(k / self.k_scale, v / self.v_scale, kv_cache, meta)
            q = q * self.k_scale
        elif v is not None:  # None: a KV-sharing layer reads what an earlier layer wrote
            self.attention.write_kv(k, v, kv_cache, meta)
        attn = self.attention.attend(
            q,
            kv_cache,
            meta,
            self.scale,
            self.span,
            self.softcap,
            None if self.sinks is None else self.sinks.weight,
        )
        if self.v_scale is not None:
            attn = attn * self.v_scale
        attn = attn.reshape(num_tokens, self.q_size)
        return attn * torch.sigmoid(gate) if self.gate_size else attn


class CausalLM(nn.Module):
    """The decoder plus its LM head. Parameters are uninitialized until `weights.load_weights`.
    With ``tp`` (a world larger than 1), this rank's shard of them. Without
    ``layer_kernels`` (see ``layer_kernels_for``) the layers run PyTorch operators."""

    # What calling it returns (forward's result): torch types a module call as Any.
    __call__: Callable[..., torch.Tensor]

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel | None = None,
        layer_kernels: LayerKernels | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        fp8_cache = kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1
        if fp8_cache and cfg.latent_attention:
            raise ValueError(
                f"an fp8 KV cache with multi-head latent attention ({cfg.model_type}) is not "
                "supported: use --kv-cache-dtype auto"
            )
        quantized = cfg.checkpoint_quantization
        kv_scales = quantized.kv_cache_scales if fp8_cache and quantized is not None else None
        if kv_scales not in (None, "tensor"):
            raise ValueError(
                f"config.json: kv_cache_scheme of {kv_scales}: an fp8 cache applies static scales "
                "per tensor; use --kv-cache-dtype auto (the scales then go unused)"
            )
        if kv_scales and cfg.kv_sources:
            raise ValueError(
                f"config.json: an fp8 cache's static scales with layers sharing KV "
                f"({cfg.model_type}) are not supported; use --kv-cache-dtype auto"
            )
        self.config = cfg
        self.tp = tp
        self.layout = (
            ShardLayout.of(cfg) if tp is None else ShardLayout.of(cfg, tp.rank, tp.world_size)
        )
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.kv_cache_shape = KVCacheShape(cfg, self.layout, dtype, self.kv_cache_dtype, device)
        self.attention = attention
        vocab_rows = self.layout.vocab_per_rank
        self.embed_tokens = nn.Parameter(
            torch.empty(vocab_rows, cfg.hidden_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.layers = ModuleList(
            DecoderLayer(
                i,
                cfg.for_layer(i),
                layer_layout(cfg, i, self.layout),
                tp,
                attention,
                layer_kernels,
                device,
                dtype,
                kv_scales == "tensor",
            )
            for i in range(cfg.num_layers)
        )
        self.norm = _block_norm(cfg, device, dtype, layer_kernels)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(vocab_rows, cfg.hidden_size, device=device, dtype=dtype),
                requires_grad=False,
            )
        )
        # A sequence classifier's head, whole on every rank (the pooled states it reads are).
        self.score = (
            nn.Parameter(
                torch.empty(cfg.num_labels, cfg.hidden_size, device=device, dtype=dtype),
                requires_grad=False,
            )
            if cfg.num_labels
            else None
        )
        self.device = device
        self.rotary = Rotary(cfg.rope, device)
        self.local_rotary = None if cfg.sliding_rope is None else Rotary(cfg.sliding_rope, device)
        # Whose cache the attention backend plans a step over: a linear-attention layer's
        # entry has the cache's shape but no memory (``KVCacheShape.allocate``).
        self.first_attention_layer = cfg.attention_layers[0]
        # Gemma multiplies its embeddings by sqrt(hidden) rounded to the model's dtype
        # (transformers' embed_scale buffer); Granite by its multiplier as it is.
        self.embedding_multiplier = (
            _rounded(cfg.embedding_multiplier, dtype)
            if cfg.model_type in GEMMA_TYPES
            else cfg.embedding_multiplier
        )
        # Gemma 4's per-layer embeddings: a table of its own vocabulary (whole on every rank),
        # and a projection of the embedding, each token's row a vector for every layer.
        per_layer = cfg.num_layers * cfg.per_layer_input_size
        self.embed_tokens_per_layer = (
            nn.Parameter(
                torch.empty(cfg.per_layer_vocab_size, per_layer, device=device, dtype=dtype),
                requires_grad=False,
            )
            if per_layer
            else None
        )
        self.per_layer_model_projection = (
            Linear(cfg.hidden_size, per_layer, False, device, dtype) if per_layer else None
        )
        self.per_layer_projection_norm = (
            RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps, device, torch.float32)
            if per_layer
            else None
        )
        self.per_layer_embedding_scale = _rounded(cfg.per_layer_input_size**0.5, dtype)
        # Set by `quantization.quantize_model`: the vocabulary matrices kept quantized.
        self.quantized_embed: Int8Weight | None = None
        self.quantized_lm_head: Int8Weight | None = None
        # Set by `packed_weights.pack_model`: the LM head prepacked for the CPU's matmul.
        self.packed_lm_head: PackedLinear | None = None
        # Set by an EAGLE-3 head over this model: the layers whose inputs it reads, in order.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        # A model that takes images: its vision tower, whole on every rank (it is small).
        self.vision = None if cfg.vision is None else build_tower(cfg.vision, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: "LoraBatch | None" = None,
        embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for T flat tokens (with ``lora``,
        each request's adapter added to its tokens; with ``embeds``, its rows of image
        features in place of those tokens' embeddings)."""
        x = self._decode(input_ids, positions, attn_metadata, kv_caches, lora, None, embeds)
        return self.norm(x)

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: "LoraBatch | None" = None,
        embeds: ImageEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s hidden states and, where ``aux_hidden_state_layers`` names layers
        (an EAGLE-3 head reads them), the residual stream entering each of them, in the
        layers' order, side by side: [T, n * hidden]; None where it names none."""
        if not self.aux_hidden_state_layers:
            return self(input_ids, positions, attn_metadata, kv_caches, lora, embeds), None
        width = len(self.aux_hidden_state_layers) * self.config.hidden_size
        aux = torch.empty(len(input_ids), width, dtype=self.dtype, device=self.device)
        x = self._decode(input_ids, positions, attn_metadata, kv_caches, lora, aux, embeds)
        return self.norm(x), aux

    def _decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        lora: "LoraBatch | None",
        aux: torch.Tensor | None,
        embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer; into ``aux``'s columns, that entering
        each layer of ``aux_hidden_state_layers`` (copied: a layer adds into it in place)."""
        kv_cache = kv_caches[self.first_attention_layer]
        self.attention.prepare(attn_metadata, kv_cache)
        if self.config.linear_layers and attn_metadata.linear is None:
            attn_metadata.linear = self._scratch_states(attn_metadata)
        rotations = self.rotary(positions, self.dtype)
        local = rotations if self.local_rotary is None else self.local_rotary(positions, self.dtype)
        query_scale = self._query_scale(positions)
        x = self._embed(input_ids)
        if self.embedding_multiplier != 1.0:
            x *= self.embedding_multiplier
        if embeds is not None:
            x[embeds.rows] = embeds.features
        per_layer_inputs = self._per_layer_inputs(input_ids, x)
        h = self.config.hidden_size
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if aux is not None and layer.index in self.aux_hidden_state_layers:
                column = self.aux_hidden_state_layers.index(layer.index) * h
                aux[:, column : column + h].copy_(x)
            cos, sin = local if layer.local_rope else rotations
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, layer.index]
            x = layer(x, cos, sin, attn_metadata, kv_cache, lora, query_scale, per_layer_input)
        return x

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's inputs of every layer [T, layers, per_layer_input_size] from the tokens
        and their (scaled) embeddings ``x``, as transformers computes them; None elsewhere."""
        table, projection = self.embed_tokens_per_layer, self.per_layer_model_projection
        norm = self.per_layer_projection_norm
        if table is None or projection is None or norm is None:
            return None
        shape = (len(input_ids), self.config.num_layers, self.config.per_layer_input_size)
        rows = F.embedding(input_ids, table).view(shape) * self.per_layer_embedding_scale
        projected = norm((projection(x) * self.config.hidden_size**-0.5).view(shape))
        return (projected + rows) * 2**-0.5

    def _scratch_states(self, meta: AttentionMetadata) -> LinearStep:
        """Linear-attention states of their own for a pass outside serving that brings none
        (a kernel warm-up), a slot a request."""
        starts = meta.query_start_loc.cpu().numpy()
        states = LinearStates(self.config, self.layout, len(starts) - 1, self.dtype, self.device)
        return states.unserved(starts)

    def _query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's and Mistral 4's factor of each token's queries, [T, 1, 1] in the
        model's dtype, as transformers computes it (in float32, then rounded); Llama 4's in
        float32, its positions counted from 1 (transformers rounds its queries once, after the
        product)."""
        beta, length = self.config.query_scaling_beta, self.config.query_scaling_length
        if not beta:
            return None
        llama4 = self.config.attn_temperature_tuning
        scale = 1 + beta * torch.log(1 + torch.floor((positions + int(llama4)) / length))
        return (scale if llama4 else scale.to(self.dtype))[:, None, None]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        # Vocabulary-parallel: rows of tokens outside this rank's range are zero here.
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab_per_rank)
        x = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_embed is not None:
            return self.quantized_embed.rows(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor | None:
        """fp32 logits [N, vocab] for the N hidden rows asked for; under tensor parallelism
        gathered on rank 0, and None on the other ranks. ``widen=False``, for a caller that
        takes only each row's argmax: the LM head's own dtype where nothing follows it (no
        scaling, soft cap or gather), since widening writes twice the bytes the head did
        (~50 us for 256 rows of a 128k vocabulary on an H200) for the same argmax."""
        widen = widen or (
            self.config.logits_scaling != 1.0
            or self.config.final_logit_softcapping is not None
            or self.tp is not None
        )
        logits = self._logits_shard(hidden, widen)
        if self.config.logits_scaling != 1.0:
            logits /= self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        if self.tp is None:
            return logits
        return self.tp.gather_logits(logits, self.config.vocab_size)

    def classify(self, states: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's float32 logits [N, num_labels] of N pooled states, its
        score head applied in the model's dtype (as transformers applies it)."""
        assert self.score is not None
        return F.linear(states.to(self.dtype), self.score).float()

    def _logits_shard(self, hidden: torch.Tensor, widen: bool) -> torch.Tensor:
        quantized = self.quantized_embed if self.lm_head is None else self.quantized_lm_head
        if quantized is not None:
            return quantized.matmul(hidden)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        if hidden.device.type != "cpu":
            logits = F.linear(hidden, weight)
        else:
            # On a CPU, vocab slices keep each slice's output block in cache: ~1.4x faster at
            # 64 rows.
            vocab = weight.shape[0]
            logits = torch.empty(hidden.shape[0], vocab, dtype=hidden.dtype)
            for start in range(0, vocab, CPU_LOGITS_SLICE):
                end = min(start + CPU_LOGITS_SLICE, vocab)
                torch.mm(hidden, weight[start:end].t(), out=logits[:, start:end])
        return logits.float() if widen else logits

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Once, after the weights are loaded: Gemma's norms take their (1 + weight) scales,
        Gemma 4's router its input's scale, and Granite's residual multiplier is folded
        (below)."""
        if self.config.gemma_norms:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.add_unit_offset()
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.fold_router_scale()
            if layer.mla is not None:
                layer.mla.deinterleave_rope()
            elif self.config.interleaved_rope and layer.rotary_dim:  # a NoPE layer's stay
                layer.deinterleave_rope()
        self._fold_residual_multiplier()

    def _fold_residual_multiplier(self) -> None:
        """Granite scales each residual branch (attention's and the MLP's) by
        ``residual_multiplier``: folded into the weights of the projections that end them,
        so the fused residual adds stay one matmul; the experts' into their routing weights,
        which multiply their outputs in float32 (folded into their weights it would round each
        one to the model's dtype: in bfloat16 half again as far from float32 as
        transformers)."""
        factor = self.config.residual_multiplier
        if factor == 1.0:
            return
        for layer in self.layers:
            ends = [layer.o_proj, layer.down_proj]
            if layer.moe is not None:
                ends += [layer.moe.shared_down]
                routing = layer.moe.routing
                layer.moe.routing = dataclasses.replace(routing, scaling=routing.scaling * factor)
            for linear in ends:
                if linear is not None:
                    linear.weight.mul_(factor)
                    if linear.bias is not None:
                        linear.bias.mul_(factor)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block costs on this rank across all layers (K and V)."""
        return self.kv_cache_shape.bytes_per_block(block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        return self.kv_cache_shape.allocate(num_blocks, block_size)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (Gemma's embedding scales are buffers of the model's
    dtype in transformers)."""
    return float(torch.tensor(value).to(dtype))


def layer_layout(cfg: ModelConfig, index: int, layout: ShardLayout) -> ShardLayout:
    """The rank's share of layer ``index``: the model's, but where the layer has shapes of
    its own (``ModelConfig.for_layer``)."""
    layer_cfg = cfg.for_layer(index)
    if layer_cfg is cfg:
        return layout
    return ShardLayout.of(layer_cfg, layout.rank, layout.world_size)


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """The paged KV cache of a model's layers on one rank (a served model's, an EAGLE
    head's)."""

    config: ModelConfig
    layout: ShardLayout
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: torch.device

    def _token_shape(self, index: int) -> tuple[int, int]:
        """(KV heads on this rank, head size) of layer ``index``'s cache."""
        return layer_layout(self.config, index, self.layout).num_kv_heads, self.config.for_layer(
            index
        ).head_dim

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block costs across all layers (K and V)."""
        copies = 1 if self.config.latent_attention else 2
        item = self.kv_cache_dtype.itemsize
        return sum(
            copies * block_size * math.prod(self._token_shape(i)) * item
            for i in self.config.cache_layers
        )

    def allocate(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        cfg = self.config
        shape = (2, num_blocks, block_size, self.layout.num_kv_heads, cfg.head_dim)
        if cfg.latent_attention:  # a latent row is its own value: one copy, seen twice
            one = (1, *shape[1:])
            return [
                torch.zeros(one, dtype=self.dtype, device=self.device).expand(shape)
                for _ in range(cfg.num_layers)
            ]
        caches: list[torch.Tensor] = []
        for i in range(cfg.num_layers):
            if cfg.is_linear_layer(i):  # no KV: an entry of the cache's shape and no memory
                none = torch.zeros((), dtype=self.kv_cache_dtype, device=self.device)
                caches.append(none.expand(shape))
            elif cfg.kv_source(i) != i:  # Gemma 4's sharing layers: an earlier layer's cache
                caches.append(caches[cfg.kv_source(i)])
            else:
                layer_shape = (2, num_blocks, block_size, *self._token_shape(i))
                caches.append(
                    torch.zeros(layer_shape, dtype=self.kv_cache_dtype, device=self.device)
                )
        return caches
