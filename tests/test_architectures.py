"""Architectures beside Llama and Qwen: the mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE, gpt-oss: its biased experts, clamped SwiGLU and attention sinks), Phi-3 (q/k/v and gate/up fused in its checkpoint), Granite (its scalars),
Gemma 2 (its soft caps), Gemma 3 (its norms, GELU, local and global layers) and sliding windows (Mistral's and
Mixtral's every layer, Qwen2's from max_window_layers on, Gemma 3's local layers), with
windows far shorter than the sequences, Llama 4's chunked attention across chunk boundaries,
and Gemma 4 (layers of two head sizes, values from keys, KV shared across layers, per-layer
embeddings). Each is decoded through the engine core, chunked,
preempted and with drafts, in one process and by a tensor-parallel group of two, as
transformers decodes it (its loop over experts); and what Weir refuses of them."""

import dataclasses
import functools
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_auto_classes  # noqa: E402, F401
import tp_workload  # noqa: E402
from devices import CPU_AND_CUDA  # noqa: E402
from lora_adapters import cached_greedy, greedy  # noqa: E402
from paged_requests import BLOCK_SIZE, NUM_BLOCKS, PagedRequests  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spread_weights import spread_weights_  # noqa: E402

from weir.services.executor.model_runner import ModelRunner  # noqa: E402
from weir.services.executor.moe import check_moe  # noqa: E402
from weir.services.executor.weights import load_model  # noqa: E402
from weir.shared.lora import check_adapter  # noqa: E402
from weir.shared.model_config import ModelConfig, read_model_config  # noqa: E402
from weir.shared.rope_config import LONG_ROTATION  # noqa: E402
from weir.shared.shard_layout import ShardLayout  # noqa: E402

VOCAB = 131
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LONGROPE_ORIGINAL = 16
MINISTRAL3 = dict(
    head_dim=16,
    intermediate_size=96,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
)
MISTRAL4 = dict(
    COMMON,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    rope_parameters={**MINISTRAL3["rope_parameters"], "llama_4_scaling_beta": 0.3},
)
CONFIGS = {
    "phi3": lambda: transformers.Phi3Config(**COMMON, intermediate_size=96, pad_token_id=0),
    # Phi-4-mini's rotation: LongRoPE from an original context of 16 (prompts of 5 to 29
    # tokens fit it or not, decodes leave it) and three quarters of each head rotating.
    "phi3_longrope": lambda: transformers.Phi3Config(
        **COMMON,
        intermediate_size=96,
        pad_token_id=0,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        partial_rotary_factor=0.75,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 3.0, 9.0, 27.0, 81.0, 243.0],
        },
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, intermediate_size=96, sliding_window=7),
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON,
        intermediate_size=96,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    # Soft caps low enough to bind on these weights' scores and logits; layers 0 and 2
    # windowed.
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        sliding_window=9,
        query_pre_attn_scalar=20,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        tie_word_embeddings=False,
    ),
    # Local (windowed) layers 0 and 2 rotate by their own base, the global one by a scaled
    # other; attention scaled by query_pre_attn_scalar, not head_dim. Untied: with random
    # weights a tied head mostly predicts the last token again. The attention cap is Gemma
    # 2's, kept in Gemma 3's config and never applied.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        tie_word_embeddings=False,
        attn_logit_softcapping=4.0,
        head_dim=16,
        intermediate_size=96,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,
        rope_local_base_freq=100.0,
        rope_theta=5000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # Gemma 4, as its small models are built: the full-attention layers' heads twice as wide
    # (one KV head to two) and rotated in part (proportionally), the last two layers reading
    # the KV of the last earlier layer of their kind (projecting queries alone, MLPs twice as
    # wide), a per-layer input into every layer from a table of its own and the embedding,
    # values RMS-normalized, each layer's output scaled, its logits capped.
    "gemma4_text": lambda: transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 5},
        tie_word_embeddings=False,
        head_dim=16,
        global_head_dim=32,
        intermediate_size=48,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0,
    ),
    # Gemma 4 as its large dense model: the full-attention layers' values are their keys'
    # projection (no v_proj), of KV heads of their own; no per-layer inputs, no sharing.
    "gemma4_k_eq_v": lambda: transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        tie_word_embeddings=False,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=96,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 5000.0,
                "factor": 2.0,
            },
        },
    ),
    # Granite's four scalars, and biases everywhere
    "granite": lambda: transformers.GraniteConfig(
        **COMMON,
        intermediate_size=96,
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        attention_multiplier=0.05,
        logits_scaling=2.5,
        attention_bias=True,
        mlp_bias=True,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=11,
    ),
    # The shared expert with its sigmoid gate, q/k/v biases, every other layer sparse.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=80,
        decoder_sparse_step=2,
    ),
    # Layers 0 and 2 windowed, YaRN, biases everywhere, attention sinks, and a SwiGLU limit
    # low enough to clamp many of these weights' activations.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=7,
        swiglu_limit=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # NoPE layers 1 and 2 (no_rope_layers) the only windowed ones, biases everywhere.
    "smollm3": lambda: transformers.SmolLM3Config(
        **COMMON,
        intermediate_size=96,
        no_rope_layers=[1, 0, 0],
        use_sliding_window=True,
        sliding_window=6,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        pad_token_id=0,
    ),
    # Norms of the attention's and MLP's outputs only, q/k norms over the whole projections;
    # one KV head, which both ranks of a group of two hold (their k sums of squares reduced).
    "olmo2": lambda: transformers.Olmo2Config(
        **{**COMMON, "num_key_value_heads": 1},
        intermediate_size=96,
        attention_bias=True,
        pad_token_id=0,
    ),
    # OLMo 2's norms, windows on layers 0-2 of 4, the full layer scaled and on its own base.
    "olmo3": lambda: transformers.Olmo3Config(
        **{**COMMON, "num_hidden_layers": 4},
        intermediate_size=96,
        sliding_window=5,
        pad_token_id=0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    # Renormalized top-k and a dense layer by mlp_only_layers.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=24,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # Latent attention with the query projected directly, YaRN with DeepSeek's mscale (its
    # scores scaled too), a dense first layer, two shared experts, the top 2 of 8 experts
    # from the best of 4 groups, scaled.
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=1,
        routed_scaling_factor=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    # A query latent, DeepSeek's interleaved rotation, V3's sigmoid router with its score
    # correction bias (groups by their best two), renormalized and scaled.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
    # Mistral 4: V3's latent attention (a query latent, interleaved rotation) under YaRN with
    # its mscale (the scores scaled too), its queries scaled by position past each 8 tokens;
    # a dense first layer, then the top 2 of 8 experts by a softmax from the best 2 of 4
    # groups (each scored by its best two), renormalized and scaled, beside a shared expert.
    "mistral4": lambda: transformers.Mistral4Config(**MISTRAL4),
    # GLM-4.5's: biased q/k/v (not o), per-head q/k norms, half of each head rotating, V3's
    # experts in groups.
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON,
        head_dim=24,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        attention_bias=True,
        use_qk_norm=True,
    ),
    # GLM-4.7-Flash: V3's layers, its sparse layers by mlp_layer_types, values wider than
    # the query's no-position channels, its experts in one group (as the model's).
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **{**COMMON, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=20,
        mlp_layer_types=["sparse", "dense", "sparse"],
    ),
    # Seed-OSS: biased q/k/v and o (attention_out_bias), a biased MLP.
    "seed_oss": lambda: transformers.SeedOssConfig(
        **COMMON,
        head_dim=24,
        intermediate_size=96,
        attention_out_bias=True,
        mlp_bias=True,
        pad_token_id=0,
    ),
    # ERNIE 4.5: every projection biased, each head's channels rotating in adjacent pairs.
    "ernie4_5": lambda: transformers.Ernie4_5Config(
        **COMMON, head_dim=16, intermediate_size=96, use_bias=True, tie_word_embeddings=False
    ),
    # GLM-4-0414: biased q/k/v, half of each head rotating in adjacent pairs, norms around
    # the attention and the MLP, gate/up fused in the checkpoint.
    "glm4": lambda: transformers.Glm4Config(
        **COMMON, head_dim=16, intermediate_size=96, pad_token_id=0
    ),
    # EXAONE 4: OLMo 2's norms of the outputs only, q/k norms per head, local layers and
    # global ones that rotate nothing.
    "exaone4": lambda: transformers.Exaone4Config(
        **COMMON, intermediate_size=96, sliding_window=7, sliding_window_pattern=2
    ),
    # Command R (Cohere): LayerNorms, the attention and the MLP side by side on one norm's
    # output, heads rotating in adjacent pairs, every projection biased, the logits scaled;
    # Command R+'s q/k LayerNorms, weights per head.
    "cohere": lambda: transformers.CohereConfig(
        **COMMON, intermediate_size=96, attention_bias=True, logit_scale=0.3, use_qk_norm=True
    ),
    # Command R7B (Cohere 2): local layers rotating, global ones not.
    "cohere2": lambda: transformers.Cohere2Config(
        **COMMON, intermediate_size=96, sliding_window=7, sliding_window_pattern=2
    ),
    # Ministral 8B: Mistral's layers, its window on the layers layer_types names.
    "ministral": lambda: transformers.MinistralConfig(
        **COMMON,
        head_dim=16,  # transformers' None fails its attention
        intermediate_size=96,
        sliding_window=7,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Ministral 3: YaRN, and queries scaled by their position past each 8 tokens.
    "ministral3": lambda: transformers.Ministral3Config(**COMMON, **MINISTRAL3),
    # MiniMax-M2: OLMo's q/k norms of the whole projections, half of each head rotating
    # (rotary_dim), Mixtral's experts chosen as V3's by sigmoid scores and a bias.
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **COMMON,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    # ERNIE 4.5's MoE: a dense first layer, experts chosen by a softmax plus a bias
    # (moe_statics) and a shared expert added ungated, heads rotating in adjacent pairs.
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_num_experts=6,
        moe_k=2,
        moe_num_shared_experts=1,
        tie_word_embeddings=False,
    ),
    # Solar Open: Llama's attention (q/k/v biased), GLM-4.5's experts in every layer.
    "solar_open": lambda: transformers.SolarOpenConfig(
        **COMMON,
        head_dim=16,
        attention_bias=True,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    ),
    # Starcoder2: LayerNorms with biases, an MLP not gated (c_fc, tanh GELU, c_proj), every
    # projection biased, a window on every layer.
    "starcoder2": lambda: transformers.Starcoder2Config(
        **COMMON, intermediate_size=96, sliding_window=7
    ),
    # Arcee (AFM): Llama's layers, an MLP not gated (up, squared ReLU, down).
    "arcee": lambda: transformers.ArceeConfig(**COMMON, intermediate_size=96),
    # Hunyuan (dense): q/k norms of the rotated heads, NTK-alpha's larger base.
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(
        **COMMON,
        head_dim=16,
        intermediate_size=96,
        rope_parameters={
            "rope_type": "dynamic",
            "rope_theta": 10000.0,
            "alpha": 50.0,
            "factor": 1.0,
        },
    ),
    # Hunyuan-A13B's: the dense model's attention, a float32 router's renormalized top k of
    # experts and a shared MLP in every layer, the top k given per layer as its file does.
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        **COMMON,
        head_dim=16,
        intermediate_size=48,
        num_experts=6,
        moe_topk=[2, 2, 2],
        rope_parameters={
            "rope_type": "dynamic",
            "rope_theta": 10000.0,
            "alpha": 50.0,
            "factor": 1.0,
        },
    ),
    # OLMoE: q/k norms over the whole projections, top 3 of 6 experts not renormalized.
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=48, num_experts=6, num_experts_per_tok=3, pad_token_id=0
    ),
    # Granite 3's MoE: its scalars, its stacked experts (softmax over the top 2 logits).
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **COMMON,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        attention_multiplier=0.05,
        logits_scaling=2.5,
    ),
    # ... and its shared expert, added ungated.
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(
        **COMMON,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
        shared_intermediate_size=40,
        residual_multiplier=0.4,
        pad_token_id=0,
    ),
    # Llama 4: its rotated layers (0 and 3) turn adjacent pairs by Llama 3's scaled rotation,
    # then q/k normalized without weights; its NoPE layers (1 and 2) scale their queries by
    # position past each 4 tokens; the experts of every other layer (1 and 3) weight their
    # inputs, beside a shared expert; the dense layers' MLP larger than an expert's. One
    # chunk of its chunked attention covers the whole context here (shorter chunks: below).
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        head_dim=16,
        intermediate_size=32,
        intermediate_size_mlp=96,
        num_local_experts=6,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0, 0, 1],
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.3,
        attention_chunk_size=256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}
MOE_LAYERS = {
    "granite": (),
    "phi3": (),
    "phi3_longrope": (),
    "mistral": (),
    "qwen2": (),
    "gemma2": (),
    "gemma3_text": (),
    "gemma4_text": (),
    "gemma4_k_eq_v": (),
    "smollm3": (),
    "olmo2": (),
    "olmo3": (),
    "mixtral": (0, 1, 2),
    "gpt_oss": (0, 1, 2),
    "qwen2_moe": (1,),
    "qwen3_moe": (1, 2),
    "deepseek_v2": (1, 2),
    "deepseek_v3": (1, 2),
    "mistral4": (1, 2),
    "glm4_moe": (1, 2),
    "glm4_moe_lite": (0, 2),
    "seed_oss": (),
    "ernie4_5": (),
    "glm4": (),
    "olmoe": (0, 1, 2),
    "hunyuan_v1_dense": (),
    "hunyuan_v1_moe": (0, 1, 2),
    "starcoder2": (),
    "arcee": (),
    "solar_open": (0, 1, 2),
    "ernie4_5_moe": (1, 2),
    "minimax_m2": (0, 1, 2),
    "exaone4": (),
    "ministral": (),
    "ministral3": (),
    "cohere": (),
    "cohere2": (),
    "granitemoe": (0, 1, 2),
    "granitemoeshared": (0, 1, 2),
    "llama4_text": (1, 3),
}


def save_model(kind: str, path, **changes) -> torch.nn.Module:
    """A random model of ``kind`` (its config's ``changes`` made), saved as its checkpoints
    are (one tensor per expert); returned as transformers runs it, its experts one by one."""
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    for key, value in changes.items():
        setattr(config, key, value)
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights_(model)
    with torch.no_grad():  # buffers, left as they are by the above
        for name, buffer in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                # Below -1: every expert's choice score is negative, so those of the groups
                # left out must rank below all (transformers' -inf), not at 0.
                buffer.copy_(0.3 * torch.randn_like(buffer) - 1.1)
            if name.endswith("layer_scalar"):  # Gemma 4's, each layer's own (not 1)
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def reference(kind: str, model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """``greedy``'s tokens for each prompt (LongRoPE's: ``cached_greedy``'s, its rotation
    chosen by the pass's length), the prompts decoded side by side: right-padded into one
    batch, each row's next token read at its own last token. Attention is causal, so the
    padding after a row's tokens changes none of their logits: a forward pass per token,
    not per token of every prompt."""
    if kind == "phi3_longrope":
        return [cached_greedy(model, prompt, num_tokens) for prompt in prompts]
    rows = [list(prompt) for prompt in prompts]
    with torch.no_grad():
        for _ in range(num_tokens):
            width = max(map(len, rows))
            logits = model(torch.tensor([row + [0] * (width - len(row)) for row in rows])).logits
            for row, row_logits in zip(rows, logits, strict=True):
                row.append(int(row_logits[len(row) - 1].argmax()))
    return [row[len(prompt) :] for row, prompt in zip(rows, prompts, strict=True)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_model(request.param, path)


@pytest.fixture(scope="module")
def moe(model):
    if not MOE_LAYERS[model[0]]:
        pytest.skip("not a mixture of experts")
    return model


def test_config_reads_the_experts_as_transformers_does(moe):
    kind, path, hf = moe
    cfg = read_model_config(path)
    assert cfg.moe_layers == MOE_LAYERS[kind]
    hf_cfg = hf.config
    experts = getattr(hf_cfg, "num_experts", None) or hf_cfg.num_local_experts
    assert cfg.num_experts == experts
    top_k = hf_cfg.num_experts_per_tok
    if isinstance(top_k, list) and len(set(top_k)) == 1:  # Hunyuan's, given per layer
        top_k = top_k[0]
    assert cfg.num_experts_per_tok == top_k
    sparse = [
        i
        for i, layer in enumerate(hf.model.layers)
        # Granite's block_sparse_moe, Llama 4's feed_forward
        if hasattr(
            getattr(layer, "mlp", None)
            or getattr(layer, "feed_forward", None)
            or layer.block_sparse_moe,
            "experts",
        )
    ]
    assert tuple(sparse) == cfg.moe_layers


def test_decodes_as_transformers_in_one_process_and_at_tp2(model):
    """Every expert's share of columns on each rank, the router whole (a fused checkpoint
    tensor's parts each cut as their own): the group decodes what one process decodes,
    which is what transformers decodes."""
    kind, path, hf = model
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(5)]
    work = tp_workload.Workload(
        str(path), prompts, max_tokens=10, num_blocks=20, num_speculative_tokens=2
    )
    want = {f"r{i}": tokens for i, tokens in enumerate(reference(kind, hf, prompts, 10))}
    one = tp_workload.run(work)
    assert one.chunked and one.preempted and one.draft_tokens > 0
    assert one.outputs == want
    # OLMo's q/k norms over the whole projections sum their squares over the ranks: one
    # all-reduce more per layer.
    per_layer = 3 if read_model_config(path).whole_qk_norms else 2
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want
        # The experts' partial sums join the layer's one all-reduce after its MLP.
        assert report.all_reduces == report.forwards * (per_layer * report.num_layers + 1)


def test_longrope_prompts_share_cached_blocks_only_with_prompts_rotated_alike(tmp_path):
    """A prompt within LongRoPE's original context reuses the blocks of another such prompt;
    one past it rotates even its first tokens by the long factors, so it reads none of them
    and computes its own. Each decodes what transformers decodes."""
    hf = save_model("phi3_longrope", tmp_path)
    base = list(range(3, 15))  # 12 tokens: three blocks
    prompts = [base, base + [20, 21], base + list(range(30, 38))]  # 12, 14 and 20 tokens
    work = tp_workload.Workload(
        str(tmp_path), prompts, max_tokens=8, num_blocks=40, one_at_a_time=True
    )
    report = tp_workload.run(work)
    assert report.outputs == {f"r{i}": cached_greedy(hf, p, 8) for i, p in enumerate(prompts)}
    assert report.prefix_cache_hits == len(base)  # the 14-token prompt's, of the first's blocks


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(model, device):
    """bf16 rounds where the experts' outputs are summed otherwise than transformers does,
    so the two bf16 results differ; each is as far from the float32 logits as the other, at
    the typical position (the median of the positions' mean errors: where two experts'
    router logits nearly tie, bf16 may choose the other one, and such a position is far off
    whoever computes it, transformers or Weir).
    On CUDA the grouped matmul is the GPU's own kernel and the windows the Triton kernel's
    (gpu_checks.sh runs this). The logits an argmax alone takes (``widen=False``) are the
    same values, left in bf16 unless the model scales or caps them."""
    kind, path, hf32 = model
    ids = list(range(3, 40))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="eager"
    )
    with torch.no_grad():
        want = hf32(torch.tensor([ids])).logits[0]
        hf_logits = hf16.to(device).eval()(torch.tensor([ids], device=device)).logits[0]
        hf_error = (hf_logits.float().cpu() - want).abs().mean(dim=1).median()
    model = load_model(path, device=device, dtype=torch.bfloat16)
    input_ids, positions, meta = PagedRequests(seed=0).step([("A", ids, 0)])
    if kind == "phi3_longrope":  # a prompt past the original context: every token long-rotated
        positions += LONG_ROTATION
    meta = dataclasses.replace(
        meta,
        **{f: getattr(meta, f).to(device) for f in ("query_start_loc", "seq_lens", "block_table")},
        slot_mapping=meta.slot_mapping.to(device),
    )
    with torch.inference_mode():
        kv = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        hidden = model(input_ids.to(device), positions.to(device), meta, kv)
        logits = model.compute_logits(hidden).cpu()
        narrow = model.compute_logits(hidden, widen=False).cpu()
    error = (logits - want).abs().mean(dim=1).median()
    assert error < 1.5 * hf_error, (error, hf_error)
    # For an argmax alone the LM head's bf16 logits do, unless something scales them after.
    scaled = model.config.logits_scaling != 1 or model.config.final_logit_softcapping
    assert logits.dtype == torch.float32
    assert narrow.dtype == (torch.float32 if scaled else torch.bfloat16)
    assert torch.equal(narrow.float(), logits)


def test_what_weir_refuses_of_a_mixture_of_experts(moe, tmp_path):
    kind, path, _ = moe
    cfg = read_model_config(path)
    with pytest.raises(ValueError, match="does not quantize a mixture of experts"):
        load_model(path, quantization="int8")
    with pytest.raises(ValueError, match="bfloat16 only, not float32"):
        check_moe(cfg, torch.device("cuda"), torch.float32, None)
    check_moe(cfg, torch.device("cuda"), torch.bfloat16, None)
    odd = dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size + 2)
    with pytest.raises(ValueError, match="does not divide the model's .* columns of each expert"):
        ShardLayout.of(odd, 0, 4)
    layer = cfg.moe_layers[0]
    if cfg.latent_attention is not None:  # no adapter at all
        _adapter(tmp_path / "q", cfg, {layer: ("self_attn.q_proj",)})
        with pytest.raises(ValueError, match="LoRA adapters of a model with DeepSeek's latent"):
            check_adapter(tmp_path / "q", cfg, max_rank=16)
        return
    # An adapter of an MoE layer's MLP is refused; one of the attention is served (its
    # values': ERNIE's query and key rows are reordered as they load).
    _adapter(tmp_path / "mlp", cfg, {layer: ("mlp.down_proj",)})
    with pytest.raises(ValueError, match=f"adapts the MLP of layer {layer}, a mixture of"):
        check_adapter(tmp_path / "mlp", cfg, max_rank=16)
    _adapter(tmp_path / "v", cfg, {layer: ("self_attn.v_proj",)})
    check_adapter(tmp_path / "v", cfg, max_rank=16)


def _adapter(path, cfg: ModelConfig, modules: dict[int, tuple[str, ...]]) -> dict:
    """A PEFT-format LoRA adapter (r 2, alpha 4) of ``modules`` by layer, random, written
    here: PEFT wraps transformers' stacked experts when asked for down_proj, which Weir's
    adapters never adapt. Returns its tensors."""
    path.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}
    (path / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for layer, names in modules.items():
        for module in names:
            rows, columns = cfg.for_layer(layer).layer_tensor_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(2, columns, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(rows, 2, generator=generator)
    save_file(tensors, path / "adapter_model.safetensors")
    return tensors


@pytest.mark.parametrize(
    "kind", ["qwen3_moe", "granite", "phi3", "gemma3_text", "olmo2", "gemma4_text", "gemma4_k_eq_v"]
)
def test_an_adapter_decodes_as_its_weights_merged_into_the_model(kind, tmp_path):
    """An adapter of every layer's q/v, and of o/down where the layer has one MLP (Qwen3-MoE:
    layer 0; Granite: each, its residual_multiplier on their updates too; Phi-3: its fused
    qkv_proj and gate_up_proj, whose parts share A; Gemma 3: each, its updates normalized
    with the projections' outputs; OLMo 2: each, q/k's updates normalized with their whole
    projections; Gemma 4: layers of two head sizes, v where a layer has it: not on its
    full-attention layers whose values are their keys, nor on its KV-sharing layers), decodes
    what transformers decodes with the adapter merged into the weights; a request without it,
    the base model's tokens."""
    path = tmp_path / "m"
    hf = save_model(kind, path)
    cfg = read_model_config(path)
    attention = (
        ("self_attn.qkv_proj",) if kind == "phi3" else ("self_attn.q_proj", "self_attn.v_proj")
    )
    mlp = ("self_attn.o_proj", "mlp.gate_up_proj" if kind == "phi3" else "mlp.down_proj")
    modules = {
        layer: tuple(
            module
            for module in attention
            if module != "self_attn.v_proj"
            or not (cfg.for_layer(layer).values_from_keys or cfg.kv_source(layer) != layer)
        )
        + (() if cfg.is_moe_layer(layer) else mlp)
        for layer in range(cfg.num_layers)
    }
    tensors = _adapter(tmp_path / "a", cfg, modules)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    base = [greedy(hf, prompt, 6) for prompt in prompts]
    with torch.no_grad():
        weights = hf.state_dict()
        for name, a in tensors.items():
            if ".lora_A." in name:
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                target = name.removeprefix("base_model.model.").replace(".lora_A.", ".")
                weights[target].add_(2.0 * (b @ a))  # alpha / r
    work = tp_workload.Workload(
        str(path),
        prompts,
        max_tokens=6,
        num_blocks=20,
        loras=[f"a={tmp_path / 'a'}"],
        lora_names=["a", None],
    )
    outputs = tp_workload.run(work).outputs
    assert outputs == {"r0": greedy(hf, prompts[0], 6), "r1": base[1]}
    assert outputs["r0"] != base[0], "the adapter must matter"
    # Each rank takes its rows of every part of a fused update (of each layer's own shape).
    if kind in ("phi3", "gemma3_text", "gemma4_text"):
        for report in tp_workload.run_group(work, world_size=2):
            assert report.outputs == outputs


def test_adapters_of_reordered_query_and_key_rows_are_refused(tmp_path):
    """ERNIE 4.5's q/k rows are reordered as they load: an adapter of them would update the
    wrong channels, so it is refused by name; one of v and o fits."""
    save_model("ernie4_5", tmp_path / "m")
    cfg = read_model_config(tmp_path / "m")
    _adapter(tmp_path / "qk", cfg, {0: ("self_attn.q_proj", "self_attn.v_proj")})
    with pytest.raises(ValueError, match="rotate in adjacent pairs"):
        check_adapter(tmp_path / "qk", cfg, 16)
    _adapter(tmp_path / "vo", cfg, {0: ("self_attn.v_proj", "self_attn.o_proj")})
    check_adapter(tmp_path / "vo", cfg, 16)


def test_adapters_of_an_mlp_that_is_not_gated_are_refused(tmp_path):
    """Arcee's MLP has no gate: an adapter of it is refused by name; one of the attention
    fits."""
    cfg = ModelConfig.from_hf(CONFIGS["arcee"]().to_dict())
    _adapter(tmp_path / "up", cfg, {0: ("mlp.up_proj",)})
    with pytest.raises(ValueError, match="whose MLP is not gated"):
        check_adapter(tmp_path / "up", cfg, 16)
    _adapter(tmp_path / "v", cfg, {0: ("self_attn.v_proj",)})
    check_adapter(tmp_path / "v", cfg, 16)


def test_a_config_that_does_not_describe_the_experts_is_refused(tmp_path):
    path = tmp_path / "m"
    save_model("qwen3_moe", path)
    hf = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")

    def refused(config: dict, match: str, weights: dict | None = None) -> None:
        (path / "config.json").write_text(json.dumps(config))
        save_file(tensors if weights is None else weights, path / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            load_model(path)

    refused({**hf, "mlp_only_layers": [0, 1]}, "layer 1 has one MLP by config.json")
    refused({**hf, "mlp_only_layers": []}, "layer 0 has a mixture of experts by config.json")
    refused({**hf, "num_local_experts": 4, "num_experts": 4}, "past config.json's 4 experts")
    refused({**hf, "moe_intermediate_size": 32}, "config does not describe these weights")
    extra = {**tensors, "model.layers.1.mlp.experts.9.up_proj.weight": torch.zeros(48, 64)}
    refused(hf, "past config.json's 8 experts", extra)
    lacking = {
        n: w for n, w in tensors.items() if n != "model.layers.1.mlp.experts.3.up_proj.weight"
    }
    refused(hf, r"lacks some of model\.layers\.1\.mlp\.experts\.E\.gate_proj", lacking)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 is more than the 8 experts"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="mlp_only_layers must be layer numbers"):
        ModelConfig.from_hf({**hf, "mlp_only_layers": "0"})


def test_deepseek_caches_one_latent_row_refuses_fp8_and_skips_its_prediction_layers(tmp_path):
    """A token's latent row is cached once (the value half is the key half's storage);
    DeepSeek-V3's multi-token prediction layer past the last is left unread, a layer past
    those is refused; routings transformers does not read are refused by name."""
    path = tmp_path / "m"
    hf_model = save_model("deepseek_v3", path)
    hf = json.loads((path / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 1
    tensors = load_file(path / "model.safetensors")
    mtp = {n.replace("layers.2.", "layers.3."): w.clone() for n, w in tensors.items() if ".2." in n}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, path / "model.safetensors")
    model = load_model(path)
    ids = list(range(3, 30))
    input_ids, positions, meta = PagedRequests(seed=0).step([("A", ids, 0)])
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    assert caches[0][1].data_ptr() == caches[0][0].data_ptr()
    row = 32 + 8  # latent and rotated channels, float32
    assert model.kv_cache_bytes_per_block(BLOCK_SIZE) == 3 * BLOCK_SIZE * row * 4
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta, caches))
        want = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="latent attention .* --kv-cache-dtype auto"):
        load_model(path, kv_cache_dtype=torch.float8_e4m3fn)
    (path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.3\."):
        load_model(path)
    for changes, match in (
        ({"moe_layer_freq": 2}, "moe_layer_freq other than 1"),
        ({"scoring_func": "softmax"}, "routes by scoring_func 'softmax'"),
        ({"topk_group": 5}, "n_group 4 groups, topk_group 5 kept"),
        ({"n_group": 8}, "scored by their best two"),
        ({"model_type": "deepseek_v2", "norm_topk_prob": True}, "V2 with norm_topk_prob"),
        ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**hf, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"q_lora_rank": None, "rope_interleave": False},
        {
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "llama_4_scaling_beta": 0.0,
            },
        },
    ],
    ids=["direct_query_half_rotation", "ungrouped_unscaled"],
)
def test_mistral4_variants_decode_as_transformers(changes, tmp_path, monkeypatch):
    """Mistral 4 with its query projected directly and its channels rotating half against
    half (not in adjacent pairs); and routed from one group, not renormalized, its queries
    not scaled, YaRN's scale on cos and sin (no mscale_all_dim: the scores unscaled)."""
    # Built with the changes (its rotation is set up as the config is made, not after).
    config = functools.partial(transformers.Mistral4Config, **{**MISTRAL4, **changes})
    monkeypatch.setitem(CONFIGS, "mistral4", config)
    hf = save_model("mistral4", tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": tokens for i, tokens in enumerate(reference("mistral4", hf, prompts, 8))}
    assert tp_workload.run(work).outputs == want


def test_mistral4_config_reads_and_refuses_as_transformers_does():
    """transformers' defaults where config.json leaves keys out; num_local_experts (its
    attribute_map's name of n_routed_experts) winning where both are given; and refused by
    name: a partial_rotary_factor of qk_head_dim that does not rotate qk_rope_head_dim
    channels (transformers' int(qk_head_dim * factor), one less for some shapes), the default
    rotation (transformers' spans all of qk_head_dim), routings transformers does not read."""
    assert ModelConfig.from_hf({"model_type": "mistral4"}) == ModelConfig.from_hf(
        transformers.Mistral4Config().to_dict()
    )
    hf = CONFIGS["mistral4"]().to_dict()
    assert ModelConfig.from_hf({**hf, "num_local_experts": 16}).num_experts == 16
    rope = {k: v for k, v in hf["rope_parameters"].items() if k != "partial_rotary_factor"}
    for changes, match in (
        ({"rope_parameters": {**rope, "partial_rotary_factor": 1.0}}, "rotates 32 of the 32"),
        (
            {"qk_nope_head_dim": 14, "qk_rope_head_dim": 30, "rope_parameters": rope},
            "partial_rotary_factor 0.68.* rotates 29 of 44 channels",
        ),
        ({"rope_parameters": {**rope, "rope_type": "default"}}, "default rotation is not read"),
        ({"scoring_func": "sigmoid"}, "routes by scoring_func 'sigmoid'"),
        ({"n_group": 8}, "scored by their best two experts"),
        ({"topk_group": 5}, "n_group 4 groups, topk_group 5 kept"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**hf, **changes})


def test_a_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3's 4B-27B checkpoints are Gemma3ForConditionalGeneration: Weir reads the
    language model (text_config, the language_model.* tensors) and leaves the vision tower
    unread; a text prompt decodes as transformers decodes it with the whole model."""
    torch.manual_seed(0)
    text = CONFIGS["gemma3_text"]().to_dict()
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
        tie_word_embeddings=False,  # the whole model's flag unties its head
    )
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    spread_weights_(hf)
    hf.save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    assert cfg.multimodal and cfg.model_type == "gemma3_text"
    assert [cfg.layer_window(i) for i in range(3)] == [8, None, 8]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want

    # PEFT names the language model's modules under model.language_model; its adapter of the
    # vision tower's attention (PEFT's default targets match it too) never runs on text.
    adapter = tmp_path / "adapter"
    tensors = _adapter(
        adapter, cfg, {0: ("self_attn.q_proj", "mlp.down_proj"), 1: ("self_attn.v_proj",)}
    )
    renamed = {
        name.replace("base_model.model.model.", "base_model.model.model.language_model."): t
        for name, t in tensors.items()
    }
    vision_q = "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    renamed[f"{vision_q}.lora_A.weight"] = torch.ones(2, 32)
    renamed[f"{vision_q}.lora_B.weight"] = torch.ones(32, 2)
    save_file(renamed, adapter / "adapter_model.safetensors")
    with torch.no_grad():
        weights = hf.state_dict()
        for name, a in renamed.items():
            if ".lora_A." in name and "vision_tower" not in name:
                b = renamed[name.replace(".lora_A.", ".lora_B.")]
                target = name.removeprefix("base_model.model.").replace(".lora_A.", ".")
                weights[target].add_(2.0 * (b @ a))  # alpha / r
    lora_work = dataclasses.replace(work, loras=[f"a={adapter}"], lora_names=["a", None])
    outputs = tp_workload.run(lora_work).outputs
    assert outputs == {"r0": greedy(hf, prompts[0], 8), "r1": want["r1"]}
    assert outputs["r0"] != want["r0"], "the adapter must matter"


def test_ernie4_5_moe_leaves_its_prediction_block_unread(tmp_path):
    """ERNIE-4.5-21B-A3B's checkpoint holds a multi-token prediction block (mtp_*) beside
    its layers, which Weir does not draft with: skipped, as vLLM skips it."""
    save_model("ernie4_5_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.mtp_block.0.mlp.down_proj.weight"] = torch.zeros(64, 96)
    tensors["model.mtp_emb_norm.0.weight"] = torch.zeros(64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_model(tmp_path)


def _mistral3(text: dict, mistral4: bool = False):
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=28,
        patch_size=14,
    )
    return transformers.Mistral3ForConditionalGeneration(
        transformers.Mistral3Config(
            text_config=(
                transformers.Mistral4Config(**{**text, **MISTRAL4})
                if mistral4
                else transformers.Ministral3Config(**text, **MINISTRAL3)
            ).to_dict(),
            vision_config=vision,
            image_token_index=VOCAB - 1,
            tie_word_embeddings=False,
        )
    )


def _qwen3_vl(text: dict, moe: bool = False):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[0],
        num_position_embeddings=16,
    )
    experts = dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2) if moe else {}
    config = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
        text_config=dict(
            text,
            head_dim=16,
            intermediate_size=96,
            rope_parameters={**rope, "mrope_interleaved": True},
            **experts,
        ),
        vision_config=vision,
        **{f"{key}_token_id": VOCAB - i for i, key in enumerate(("image", "video"), 1)},
    )
    if moe:
        return transformers.Qwen3VLMoeForConditionalGeneration(config)
    return transformers.Qwen3VLForConditionalGeneration(config)


def _qwen2_5_vl(text: dict):
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=[0],
        window_size=28,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(text, intermediate_size=96, rope_parameters=rope),
        vision_config=vision,
        **{f"{key}_token_id": VOCAB - i for i, key in enumerate(("image", "video"), 1)},
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


def _internvl(text: dict):
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=[28, 28],
        patch_size=[14, 14],
    )
    config = transformers.InternVLConfig(
        text_config=transformers.Qwen3Config(**text, head_dim=16, intermediate_size=96).to_dict(),
        vision_config=vision,
        image_token_id=VOCAB - 1,
        tie_word_embeddings=False,
    )
    return transformers.InternVLForConditionalGeneration(config)


def _glm4v(text: dict, moe: bool = False):
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        image_size=28,
        patch_size=14,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    experts = dict(
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    )
    config = (transformers.Glm4vMoeConfig if moe else transformers.Glm4vConfig)(
        text_config=dict(
            text,
            head_dim=16,
            intermediate_size=96,
            rope_parameters={**rope, "mrope_section": [1, 1, 2]},
            **(experts if moe else {}),
        ),
        vision_config=vision,
        **{f"{key}_token_id": VOCAB - i for i, key in enumerate(("image", "video"), 1)},
        tie_word_embeddings=False,
    )
    if moe:
        return transformers.Glm4vMoeForConditionalGeneration(config)
    return transformers.Glm4vForConditionalGeneration(config)


def _as_qwen2_5_vl_hub_files(path) -> None:
    """Qwen2.5-VL's files as its repositories hold them (transformers 4's): the language
    model's keys beside vision_config, its rotation as mrope, its tensors under model. and
    the vision tower's under visual."""
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = {**text.pop("rope_parameters"), "type": "mrope"}
    del rope["rope_type"]
    (path / "config.json").write_text(json.dumps({**text, **config, "rope_scaling": rope}))
    tensors = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
        for name, t in load_file(path / "model.safetensors").items()
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _as_qwen_writes_experts(path) -> None:
    """Qwen3-VL-MoE's stacked experts as Qwen's files hold them: [experts, hidden, 2 x
    columns] and [experts, columns, hidden], where transformers saves them transposed."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "build, kind",
    [
        (_mistral3, "ministral3"),
        (functools.partial(_mistral3, mistral4=True), "mistral4"),
        (_qwen3_vl, "qwen3"),
        (functools.partial(_qwen3_vl, moe=True), "qwen3_moe"),
        (_qwen2_5_vl, "qwen2"),
        (_internvl, "qwen3"),
        (_glm4v, "glm4"),
        (functools.partial(_glm4v, moe=True), "glm4_moe"),
    ],
    ids=[
        "mistral3",
        "mistral3_mistral4",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen2_5_vl",
        "internvl",
        "glm4v",
        "glm4v_moe",
    ],
)
def test_a_multimodal_checkpoint_serves_its_language_model(build, kind, tmp_path):
    """Mistral Small 3.x, Magistral and Ministral 3 are Mistral3ForConditionalGeneration,
    the Qwen-VL models Qwen2_5_VL-, Qwen3VL- and Qwen3VLMoeForConditionalGeneration, InternVL
    3 and 3.5 InternVLForConditionalGeneration, GLM-4.1V and 4.6V-Flash Glm4v-, GLM-4.5V and
    4.6V Glm4vMoeForConditionalGeneration: Weir reads the language model their
    text_config names (Ministral 3's, Mistral Small 4's Mistral 4, its stacked experts read
    in transformers' layout only; Qwen3's and Qwen3-MoE's, whose
    multimodal rotation turns a text's positions as Qwen3's does, the MoE's experts stacked
    as transformers saves them and as Qwen's files hold them) and leaves the vision tower and
    the projector unread. A text prompt decodes as transformers decodes it with the whole
    model."""
    torch.manual_seed(0)
    hf = build(COMMON).eval()
    spread_weights_(hf)
    hf.save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    assert cfg.multimodal and cfg.model_type == kind and not cfg.tie_word_embeddings
    prompts = [list(range(5, 25)), [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want
    if kind == "qwen3_moe":
        assert cfg.norm_topk_prob  # transformers' Qwen3-VL-MoE always renormalizes
        _as_qwen_writes_experts(tmp_path)
        assert tp_workload.run(work).outputs == want
    if kind == "mistral4":
        _as_qwen_writes_experts(tmp_path)
        with pytest.raises(ValueError, match=r"down_proj: checkpoint shape \(8, 32, 64\) is not"):
            load_model(tmp_path)
    if kind == "qwen2":
        _as_qwen2_5_vl_hub_files(tmp_path)
        assert read_model_config(tmp_path) == cfg
        assert tp_workload.run(work).outputs == want
        # An adapter of its vision tower's modules too (PEFT's default targets match them):
        # those never run on text.
        adapter = tmp_path / "adapter"
        tensors = _adapter(adapter, cfg, {0: ("self_attn.v_proj",)})
        tensors["base_model.model.visual.blocks.0.attn.qkv.lora_A.weight"] = torch.ones(2, 32)
        save_file(tensors, adapter / "adapter_model.safetensors")
        check_adapter(adapter, cfg, max_rank=16)


def test_a_kimi_k25_checkpoint_serves_its_deepseek_v3_language_model(tmp_path):
    """Kimi K2.5's files as Moonshot writes them: config.json's text_config of model_type
    kimi_k2 (read as DeepSeek-V3's, as transformers reads it), the language model's tensors
    under language_model. and a vision tower beside them, unread. It decodes as
    transformers' DeepSeek-V3 with those weights. (transformers' own save of the whole model
    renames the language model's layers to blocks, so the files are written here.)"""
    hf = save_model("deepseek_v3", tmp_path / "text")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    config = {
        "model_type": "kimi_k25",
        "text_config": {**text, "model_type": "kimi_k2"},
        "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 32},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        "language_model." + name: t
        for name, t in load_file(tmp_path / "text" / "model.safetensors").items()
    }
    tensors["vision_tower.encoder.blocks.0.mlp.fc0.weight"] = torch.zeros(48, 32)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(32, 32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = read_model_config(tmp_path)
    assert cfg.multimodal and cfg.model_type == "deepseek_v3" and not cfg.tie_word_embeddings
    prompts = [list(range(5, 25)), [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want


def test_an_mxfp4_checkpoint_decodes_as_transformers_dequantizes_it(tmp_path):
    """gpt-oss as OpenAI publishes it: the experts' projections in MXFP4 blocks and scales
    ([experts, out, in / 32, 16] and [experts, out, in / 32]). Random codes, dequantized by
    transformers' own converter into its model: Weir, reading the blocks, decodes as that
    model does (in one process and at TP=2); a checkpoint with blocks but no scales is
    refused by name."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    hf = save_model("gpt_oss", tmp_path, intermediate_size=64)  # in features: 32 a block
    tensors = load_file(tmp_path / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in range(3):
            experts = hf.model.layers[layer].mlp.experts
            for projection in ("gate_up_proj", "down_proj"):
                param = getattr(experts, projection)  # [experts, in, out]
                num_experts, columns, rows = param.shape
                blocks = torch.randint(0, 256, (num_experts, rows, columns // 32, 16),
                                       dtype=torch.uint8, generator=generator)  # fmt: skip
                scales = torch.randint(123, 127, (num_experts, rows, columns // 32),
                                       dtype=torch.uint8, generator=generator)  # fmt: skip
                param.copy_(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                name = f"model.layers.{layer}.mlp.experts.{projection}"
                del tensors[name]
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": greedy(hf, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want

    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.down_proj_blocks but no .*down_proj_scales"):
        load_model(tmp_path)


def test_a_gpt_oss_checkpoint_that_does_not_fit_is_refused_by_its_tensors_names(tmp_path):
    save_model("gpt_oss", tmp_path, intermediate_size=64)
    tensors = load_file(tmp_path / "model.safetensors")
    experts = "model.layers.1.mlp.experts"

    def refused(changes: dict, match: str) -> None:
        changed = {n: t for n, t in {**tensors, **changes}.items() if t is not None}
        save_file(changed, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match=match):
            load_model(tmp_path)

    refused({f"{experts}.down_proj_bias": None}, rf"lacks some of {experts}\.down_proj_bias")
    refused(
        {"model.layers.0.self_attn.sinks": None},
        r"lacks some of model\.layers\.0\.self_attn\.sinks",
    )
    refused(
        {f"{experts}.gate_up_proj": torch.zeros(6, 64, 64)},
        rf"{experts}\.gate_up_proj: checkpoint shape \(6, 64, 64\) != \(6, 64, 128\)",
    )
    blocks = torch.zeros(6, 128, 2, 16, dtype=torch.uint8)
    refused(
        {
            f"{experts}.gate_up_proj": None,
            f"{experts}.gate_up_proj_blocks": blocks,
            f"{experts}.gate_up_proj_scales": torch.zeros(6, 128, 2),
        },  # fmt: skip
        rf"{experts}\.gate_up_proj: MXFP4 blocks and scales are uint8, not torch.uint8 and torch.float32",
    )


@pytest.mark.parametrize("kind", ["gpt_oss", "olmo2", "smollm3"])
def test_bfloat16_norms_round_as_transformers_norms_do(kind, tmp_path):
    """gpt-oss' and OLMo's RMSNorms scale in float32 before rounding to bfloat16, Llama's
    (SmolLM3's) after: on a bfloat16 checkpoint, the final norm's bf16 output is
    transformers' own, bit for bit."""
    save_model(kind, tmp_path / "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    model = load_model(tmp_path / "bf16", dtype=torch.bfloat16)
    x = (3 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1))).bfloat16()
    with torch.no_grad():
        assert torch.equal(model.norm(x), hf.model.norm(x))


def test_llama4_with_two_experts_a_token_decodes_as_transformers(tmp_path):
    """Llama 4's releases route each token to one expert; with two, each chosen expert's
    input is weighted by its own sigmoid, the two outputs summed with the shared expert's."""
    hf = save_model("llama4_text", tmp_path, num_experts_per_tok=2)
    assert read_model_config(tmp_path).num_experts_per_tok == 2
    prompts = [list(range(5, 45)), [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    want = {f"r{i}": tokens for i, tokens in enumerate(reference("llama4_text", hf, prompts, 8))}
    assert tp_workload.run(work).outputs == want


def test_a_llama4_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Llama 4 Scout and Maverick are Llama4ForConditionalGeneration: Weir reads the
    language model (text_config, the language_model.* tensors, its experts stacked) and
    leaves the vision model and the projector unread; a text prompt decodes as transformers
    decodes it with the whole model."""
    torch.manual_seed(0)
    vision = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=64,
    )
    config = transformers.Llama4Config(
        text_config=CONFIGS["llama4_text"]().to_dict(),
        vision_config=vision,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
    )
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    spread_weights_(hf)
    hf.save_pretrained(tmp_path)
    assert any(n.startswith("vision_model.") for n in load_file(tmp_path / "model.safetensors"))
    cfg = read_model_config(tmp_path)
    assert cfg.multimodal and cfg.model_type == "llama4_text" and not cfg.tie_word_embeddings
    assert cfg.moe_layers == MOE_LAYERS["llama4_text"]
    prompts = [list(range(5, 45)), [20, 21, 22]]
    work = tp_workload.Workload(str(tmp_path), prompts, max_tokens=8, num_blocks=20)
    # transformers 5.24's whole model fails as it builds its output (it reads an
    # image_outputs its language model's lacks), after running that language model on the
    # prompt's embeddings: which decodes the text alone.
    want = {f"r{i}": greedy(hf.language_model, prompt, 8) for i, prompt in enumerate(prompts)}
    assert tp_workload.run(work).outputs == want


def test_llama4_attends_in_chunks_across_their_boundaries_as_transformers(tmp_path):
    """Llama 4's rotated layers (0 and 3) attend within chunks of attention_chunk_size, here
    16, its NoPE layers to the whole context: decoding across several chunk boundaries, the
    prompts chunked by the step budget (chunks of the prefill starting mid-chunk), preempted,
    with drafts and by a tensor-parallel group of two, as transformers decodes it (whose
    tokens the chunk size changes: its mask is applied); and a prompt whose first 24 tokens,
    past a boundary, the prefix cache holds."""
    hf = save_model("llama4_text", tmp_path, attention_chunk_size=16)
    assert [read_model_config(tmp_path).layer_chunk(i) for i in range(4)] == [16, None, None, 16]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (40, 23, 57, 9, 33)]
    want = reference("llama4_text", hf, prompts, 12)
    hf.config.attention_chunk_size = 256
    assert reference("llama4_text", hf, prompts, 12) != want
    want = {f"r{i}": tokens for i, tokens in enumerate(want)}
    work = tp_workload.Workload(
        str(tmp_path), prompts, max_tokens=12, num_blocks=30, num_speculative_tokens=2
    )
    one = tp_workload.run(work)
    assert one.chunked and one.preempted and one.draft_tokens > 0
    assert one.outputs == want
    for report in tp_workload.run_group(work, world_size=2):
        assert report.outputs == want

    hf.config.attention_chunk_size = 16
    base = prompts[2][:24]  # six blocks of 4, across the boundary at 16
    cached = [base + [7, 8, 9], base + [30, 31, 32, 33, 34]]
    work = tp_workload.Workload(
        str(tmp_path), cached, max_tokens=12, num_blocks=40, one_at_a_time=True
    )
    report = tp_workload.run(work)
    assert report.prefix_cache_hits == len(base)
    want = reference("llama4_text", hf, cached, 12)
    assert report.outputs == {f"r{i}": tokens for i, tokens in enumerate(want)}


def test_llama4_is_served_past_a_chunk_to_its_whole_context(tmp_path):
    """Chunked attention bounds no context: a Llama 4 is served to max_position_embeddings
    whatever its attention_chunk_size, and a longer --max-model-len is refused naming that."""
    save_model("llama4_text", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf({**hf, "attention_chunk_size": 128}).context_len == 256
    assert ModelConfig.from_hf({**hf, "attention_chunk_size": None}).context_len == 256
    runner = functools.partial(
        ModelRunner,
        str(tmp_path),
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=1 << 20,
        hf_overrides=json.dumps({"attention_chunk_size": 128}),
    )
    assert runner(max_model_len=256).max_model_len == 256
    with pytest.raises(ValueError, match="context of 256 tokens .*max_position_embeddings"):
        runner(max_model_len=257)


def test_llama4_config_reads_meta_s_files_as_transformers_does():
    """Scout's file leaves no_rope_layers empty (every fourth layer NoPE) and writes
    attn_temperature_tuning as 4 (true, as vLLM reads it; transformers 5 refuses it);
    Maverick's experts are in every other layer (interleave_moe_layer_step); each as
    transformers' config derives them."""
    hf = CONFIGS["llama4_text"]().to_dict()
    for step in (1, 2):
        release = {
            **hf,
            "num_hidden_layers": 8,
            "no_rope_layers": [],
            "moe_layers": None,
            "interleave_moe_layer_step": step,
            "attn_temperature_tuning": 4,
        }
        cfg = ModelConfig.from_hf(release)
        want = transformers.Llama4TextConfig(
            num_hidden_layers=8, no_rope_layers=[], interleave_moe_layer_step=step
        )
        assert cfg.nope_layers == tuple(i for i, r in enumerate(want.no_rope_layers) if not r)
        assert cfg.moe_layers == tuple(want.moe_layers)
        assert cfg.attn_temperature_tuning and cfg.query_scaling_length == 4
    with pytest.raises(ValueError, match="attn_temperature_tuning must be true or false"):
        ModelConfig.from_hf({**hf, "attn_temperature_tuning": "yes"})
