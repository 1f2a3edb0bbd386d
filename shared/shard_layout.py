"""Which slice of a model each tensor-parallel rank holds (see
``weir.services.executor.parallel``): plain arithmetic on the config, so the scheduler can
refuse a group size the model cannot be split by before any rank loads."""

from __future__ import annotations

from dataclasses import dataclass

from weir.shared.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What rank ``rank`` of ``world_size`` holds of a model (the whole model when 1)."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    q_head_start: int  # first query head (checkpoint numbering)
    kv_head_start: int  # first KV head
    intermediate_size: int  # MLP columns on this rank
    moe_intermediate_size: int  # each expert's MLP columns on this rank (0: no experts)
    shared_expert_intermediate_size: int  # the shared expert's columns on this rank
    vocab_start: int  # first vocabulary row
    vocab_per_rank: int  # rows per rank (the last rank's rows past vocab_size are zero)
    # A linear-attention layer's key and value heads on this rank, and the first of each.
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_head_start: int = 0
    linear_v_head_start: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0

    @property
    def linear_conv_dim(self) -> int:
        """The q/k/v channels of a linear-attention layer's convolution on this rank."""
        return 2 * self.linear_k_heads * self.linear_k_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_v_heads * self.linear_v_head_dim

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, world_size: int = 1) -> ShardLayout:
        """Raises ValueError (one line, naming the model's numbers) when the model cannot
        be split ``world_size`` ways."""
        n = world_size
        if n < 1 or not 0 <= rank < n:
            raise ValueError(f"rank {rank} is outside a tensor-parallel world of size {n}")
        heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        if heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's {heads} attention heads"
            )
        # Gemma 4's full-attention layers have KV heads of their own (``for_layer``).
        for kv_heads in {kv, cfg.global_num_kv_heads or kv}:
            if kv_heads % n if kv_heads >= n else n % kv_heads:
                raise ValueError(
                    f"tensor_parallel_size {n} does not fit the model's {kv_heads} KV heads "
                    "(it must divide them or be a multiple of them)"
                )
        for columns, what in (
            (inter, "MLP columns"),
            (cfg.moe_intermediate_size, "columns of each expert's MLP"),
            (cfg.shared_expert_intermediate_size, "columns of the shared expert's MLP"),
        ):
            if columns % n:
                raise ValueError(
                    f"tensor_parallel_size {n} does not divide the model's {columns} {what}"
                )
        linear = cfg.linear_attention
        k_heads, v_heads = (0, 0) if linear is None else (linear.num_k_heads, linear.num_v_heads)
        if k_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's {k_heads} key heads of "
                "its linear-attention layers"
            )
        local_kv = max(kv // n, 1)
        vocab_per_rank = -(-cfg.vocab_size // n)
        return cls(
            rank=rank,
            world_size=n,
            num_heads=heads // n,
            num_kv_heads=local_kv,
            q_head_start=rank * (heads // n),
            kv_head_start=rank * kv // n if kv < n else rank * local_kv,
            intermediate_size=inter // n,
            moe_intermediate_size=cfg.moe_intermediate_size // n,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n,
            vocab_start=rank * vocab_per_rank,
            vocab_per_rank=vocab_per_rank,
            linear_k_heads=k_heads // n,
            linear_v_heads=v_heads // n,
            linear_k_head_start=rank * (k_heads // n),
            linear_v_head_start=rank * (v_heads // n),
            linear_k_head_dim=0 if linear is None else linear.head_k_dim,
            linear_v_head_dim=0 if linear is None else linear.head_v_dim,
        )
