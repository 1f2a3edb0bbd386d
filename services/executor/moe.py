"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek) on a flat
token batch.

A router picks each token's top-k experts. The T x k (token, expert) pairs are sorted by
expert, so each expert's rows are consecutive, and two grouped matmuls
(`torch._grouped_mm`: one call for all experts, their row offsets on the device) run every
expert's gate/up and down projections over just its rows. Nothing is read back to the host
and every shape is T x k whatever the routing, so a step keeps its one wait. Under tensor
parallelism each rank holds its share of every expert's columns, as the dense MLP is split,
and the router whole: every rank routes a token alike, and the partial sums are reduced
with the layer's one all-reduce. gpt-oss adds biases to the router and to each expert's
projections (its down projections' by rank 0 only, as a row-parallel bias) and gates with a
clamped SwiGLU. Llama 4 weights each chosen expert's input rather than its output. Gemma 4's
router reads its own norm of the residual, not the experts' input, and scales each chosen
expert's weight by a factor of that expert's; its experts gate with the tanh GELU.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from weir.services.executor.layers import (
    LayerKernels,
    Linear,
    ModuleList,
    RMSNorm,
    Vector,
    act_and_mul,
)
from weir.shared.model_config import ModelConfig
from weir.shared.shard_layout import ShardLayout

if TYPE_CHECKING:  # packed_weights.py builds on this module
    from weir.services.executor.packed_weights import PackedLinear


def check_moe(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str | None
) -> None:
    """ValueError for what the experts cannot run with: a dtype the grouped matmul has no
    CUDA kernel for (it takes bfloat16 there), or quantized weights."""
    if not cfg.num_experts:
        return
    if device.type == "cuda" and dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"a mixture-of-experts model runs on CUDA in bfloat16 only, not {name}: start it "
            "with --dtype bfloat16 or leave --dtype unset"
        )
    if quantization is not None:
        raise ValueError(
            f"--quantization {quantization} does not quantize a mixture of experts' weights: "
            "serve this model without it"
        )


class SparseMoe(nn.Module):
    """One layer's experts, their router and (Qwen2-MoE) the shared expert. The experts'
    gate/up and down weights are stacked: [experts, 2 x columns, hidden] and
    [experts, hidden, columns] (gpt-oss' biases likewise: [experts, 2 x columns] and
    [experts, hidden])."""

    # A buffer (register_buffer), which nn.Module's attribute lookup types only as Tensor | Module.
    expert_ends: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        layout: ShardLayout,
        kernels: LayerKernels | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        h, experts, columns = cfg.hidden_size, cfg.num_experts, layout.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routing = cfg.routing
        self.hidden_act = cfg.hidden_act
        self.kernels = kernels
        # Gemma 4's router input norm (scaling in float32, as its every norm), its weight
        # router.scale (times hidden_size ** -0.5 once loaded: `fold_router_scale`), and its
        # factor of each expert's weight.
        self.router_norm = (
            RMSNorm(h, cfg.rms_norm_eps, device, torch.float32, kernels)
            if cfg.routing.input_norm
            else None
        )
        self.per_expert_scale = (
            Vector((experts,), device, torch.float32) if cfg.routing.per_expert_scale else None
        )
        self.gate = Linear(
            h, experts, cfg.expert_bias, device, torch.float32 if cfg.routing.float32 else dtype
        )
        self.score_bias = (
            nn.Parameter(torch.empty(experts, device=device, dtype=torch.float32), False)
            if cfg.routing.score_bias
            else None
        )
        self.experts_gate_up = nn.Parameter(
            torch.empty(experts, 2 * columns, h, device=device, dtype=dtype), requires_grad=False
        )
        self.experts_down = nn.Parameter(
            torch.empty(experts, h, columns, device=device, dtype=dtype), requires_grad=False
        )
        self.experts_gate_up_bias = (
            nn.Parameter(torch.empty(experts, 2 * columns, device=device, dtype=dtype), False)
            if cfg.expert_bias
            else None
        )
        self.experts_down_bias = (
            nn.Parameter(torch.empty(experts, h, device=device, dtype=dtype), False)
            if cfg.expert_bias and layout.rank == 0
            else None
        )
        self.swiglu = None if cfg.swiglu_limit is None else (cfg.swiglu_limit, cfg.swiglu_alpha)
        # searchsorted against these gives the end of each expert's rows in the sorted pairs
        self.register_buffer(
            "expert_ends", torch.arange(1, experts + 1, device=device), persistent=False
        )
        # Set by `packed_weights.pack_model` on a CPU: each expert's two projections packed
        # for the CPU's matmul, which beats the grouped matmul 1.2-2x; they replace the
        # stacked weights.
        self.packed_gate_up: ModuleList[PackedLinear] | None = None
        self.packed_down: ModuleList[PackedLinear] | None = None
        shared = layout.shared_expert_intermediate_size
        self.shared_gate_up = (
            Linear(h, 2 * shared, False, device, dtype, kernels) if shared else None
        )
        self.shared_down = Linear(shared, h, False, device, dtype) if shared else None
        self.shared_expert_gate = (
            Linear(h, 1, False, device, dtype) if shared and cfg.shared_expert_gated else None
        )

    def forward(self, x: torch.Tensor, routed_by: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for each row of x [T, hidden] (this rank's partial sum
        under tensor parallelism), each row routed by its row of ``routed_by`` (Gemma 4's
        residual, of which x is a norm; None: x). Routing as transformers': softmax in float32
        over all experts, the top k, renormalized where the model says so."""
        num_tokens = x.shape[0]
        weights, experts = self._route(x if routed_by is None else routed_by)
        sorted_experts, order = experts.flatten().sort(stable=True)
        offsets = torch.searchsorted(sorted_experts, self.expert_ends).to(torch.int32)
        rows = x[order // self.top_k]
        row_weights = weights.flatten()[order].unsqueeze(1)
        if self.routing.weights_on_inputs:
            rows *= row_weights.to(rows.dtype)
        out = self._experts(rows, offsets, sorted_experts)
        if not self.routing.weights_on_inputs:
            out.mul_(row_weights)  # in float32, rounded once
        # Back to (token, choice) order by gathering with the inverse permutation (a CPU's
        # index_copy_ runs on one thread, 25x slower), then the k choices summed: no
        # scattered adds, so the sum is the same on every run.
        pairs = torch.arange(order.numel(), device=order.device)
        unsort = torch.empty_like(order).scatter_(0, order, pairs)
        mixed = out[unsort].view(num_tokens, self.top_k, -1).sum(dim=1)
        if self.shared_gate_up is not None:
            assert self.shared_down is not None
            shared = self.shared_down(self.shared_gate_up.silu_mul(x))
            if self.shared_expert_gate is not None:
                shared *= torch.sigmoid(self.shared_expert_gate(x))
            mixed += shared
        return mixed

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] and their float32 weights [T, k], as
        transformers routes: the top k of a softmax (or of DeepSeek-V3's sigmoid, its bias
        added for the choice only; Llama 4's: of the logits, weighted by their sigmoids),
        among the best groups where experts are grouped."""
        routing = self.routing
        if self.router_norm is not None:
            x = self.router_norm(x)
        logits = self.gate(x.to(self.gate.weight.dtype))
        scores = (
            logits.float().sigmoid() if routing.sigmoid else logits.softmax(-1, dtype=torch.float32)
        )
        if self.score_bias is not None:
            choice = scores + self.score_bias
        elif routing.sigmoid:  # the logits, which do not tie where float32 sigmoids reach 1
            choice = logits.float()
        else:
            choice = scores
        if routing.num_groups > 1:
            grouped = choice.view(x.shape[0], routing.num_groups, -1)
            group_scores = (
                grouped.topk(2, dim=-1).values.sum(dim=-1)
                if routing.group_by_top2
                else grouped.amax(dim=-1)
            )
            kept = group_scores.topk(routing.kept_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            # V2 ranks the masked experts at 0 (its softmax scores are not negative), V3 below all.
            hidden = float("-inf") if routing.sigmoid else 0.0
            choice = grouped.masked_fill(~keep.unsqueeze(-1), hidden).view_as(choice)
        weights, experts = choice.topk(self.top_k, dim=-1)
        if routing.sigmoid or self.score_bias is not None:
            weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            # V3's sigmoid weights never sum to 0; transformers adds 1e-20 all the same.
            weights = weights / (
                weights.sum(dim=-1, keepdim=True) + (1e-20 if routing.sigmoid else 0)
            )
        if routing.scaling != 1.0:
            weights = weights * routing.scaling
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale.weight[experts]
        return weights, experts

    @torch.no_grad()
    def fold_router_scale(self) -> None:
        """Once loaded: Gemma 4's router multiplies its normalized input by router.scale and
        then by hidden_size ** -0.5, here one float32 weight of its norm."""
        if self.router_norm is not None:
            self.router_norm.weight.mul_(self.router_norm.weight.shape[0] ** -0.5)

    def _experts(
        self, rows: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor
    ) -> torch.Tensor:
        """Each expert's MLP on its rows of ``rows`` (sorted by expert, ``row_experts``;
        expert e's end at ``offsets[e]``)."""
        if self.packed_gate_up is None or self.packed_down is None:
            gate_up = torch._grouped_mm(rows, self.experts_gate_up.transpose(1, 2), offs=offsets)
            if self.experts_gate_up_bias is not None:
                gate_up += self.experts_gate_up_bias[row_experts]
            act = self._activation(gate_up)
            out = torch._grouped_mm(act, self.experts_down.transpose(1, 2), offs=offsets)
            if self.experts_down_bias is not None:
                out += self.experts_down_bias[row_experts]
            return out
        # Packed weights (their biases with them) live on a CPU, where reading the offsets
        # costs no device sync.
        out = torch.empty_like(rows)
        start = 0
        for packed_gate_up, packed_down, end in zip(
            self.packed_gate_up, self.packed_down, offsets.tolist()
        ):
            if end > start:
                expert_rows = rows[start:end]
                act = (
                    packed_gate_up.silu_mul(expert_rows)
                    if self.swiglu is None and self.hidden_act == "silu"
                    else self._activation(packed_gate_up(expert_rows))
                )
                out[start:end] = packed_down(act)
            start = end
        return out

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up (SiLU, Gemma 4's tanh GELU), or gpt-oss' clamped SwiGLU as
        transformers computes it."""
        if self.swiglu is None:
            return act_and_mul(gate_up, self.hidden_act, self.kernels)
        limit, alpha = self.swiglu
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
