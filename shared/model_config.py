"""The architecture facts Weir needs from a Hugging Face ``config.json``.

The scheduler reads the vocabulary and the context length, the executor every shape; both
take the end-of-sequence tokens from ``eos_token_ids``.
Both read it here, so a malformed file is one clear error at start-up in whichever
process reads it first, not a KeyError deep in a model build. A key left out takes
transformers' default for the model type; a feature Weir does not implement is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weir.shared import gemma4_config
from weir.shared.checkpoint_quantization import (
    CheckpointQuantization,
    read_checkpoint_quantization,
)
from weir.shared.config_fields import count, flag, layer_types, mapping, positive, size
from weir.shared.internvl_vision_config import InternVLVisionConfig
from weir.shared.rope_config import RopeConfig, read_rope
from weir.shared.vision_config import VisionConfig

SUPPORTED_MODEL_TYPES = (
    "llama",
    "granite",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "smollm3",
    "olmo2",
    "olmo3",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "seed_oss",
    "ernie4_5",
    "glm4",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "exaone4",
    "cohere",
    "cohere2",
    "ministral",
    "ministral3",
    "minimax_m2",
    "ernie4_5_moe",
    "solar_open",
    "starcoder2",
    "arcee",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "llama4_text",
    "mistral4",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "gemma4_text",
)
GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma4_text")
# Qwen's hybrid language models, Qwen3-Next and Qwen 3.5 (dense and mixture of experts):
# Gated DeltaNet (linear attention) layers and gated attention (``_linear_attention``).
QWEN_HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Multimodal checkpoints Weir serves the language model of: the model types their
# text_config may name, the first where it names none. The vision tower's weights are left
# unread, and a prompt is text only, but for IMAGE_TYPES.
TEXT_OF_MULTIMODAL = {
    "gemma3": ("gemma3_text",),
    "mistral3": ("mistral", "ministral3", "mistral4"),
    "kimi_k25": ("deepseek_v3", "kimi_k2"),
    "qwen3_vl": ("qwen3_vl_text",),
    "qwen3_vl_moe": ("qwen3_vl_moe_text",),
    "qwen2_vl": ("qwen2_vl_text",),
    "qwen2_5_vl": ("qwen2_5_vl_text",),
    "internvl": ("qwen2", "qwen3", "qwen3_moe", "llama"),
    "glm4v": ("glm4v_text",),
    "glm4v_moe": ("glm4v_moe_text",),
    "llama4": ("llama4_text",),
    "qwen3_5": ("qwen3_5_text",),
    "qwen3_5_moe": ("qwen3_5_moe_text",),
    "gemma4": ("gemma4_text",),
    "idefics3": ("llama",),
    "smolvlm": ("llama",),
}
# Multimodal checkpoints whose images Weir reads too (its vision tower, ``vision_config``),
# with their image token's id where config.json names none (transformers' default).
IMAGE_TYPES = {"idefics3": 128257, "smolvlm": 128257, "internvl": 151667}
# Of them, those whose language model and its defaults are Idefics3's.
_IDEFICS3_TYPES = ("idefics3", "smolvlm")
# Multimodal model types whose older files hold the language model's keys beside
# vision_config, with no text_config (as transformers still reads them).
_TEXT_AT_TOP_LEVEL = ("qwen2_vl", "qwen2_5_vl")
_QWEN3_VL = {"rope_theta": 500000.0, "max_position_embeddings": 128000}
# Model types read as another, with the defaults of theirs that differ and the keys it
# always reads as given: Kimi K2's is DeepSeek-V3's (as transformers reads it), the
# Qwen-VL and GLM-V models' language models Qwen2's, Qwen3's, Qwen3-MoE's, GLM-4's and
# GLM-4.5's (their multimodal rotation turns a text's positions as those do; Qwen3-VL-MoE's
# experts' weights always renormalized, GLM-4.1V's q/k/v always biased, GLM-4.5V's q/k never
# normalized).
MODEL_TYPE_ALIASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "kimi_k2": ("deepseek_v3", {}, {}),
    "qwen3_vl_text": ("qwen3", _QWEN3_VL, {}),
    "qwen2_vl_text": ("qwen2", {"rope_theta": 1000000.0}, {}),
    "qwen2_5_vl_text": ("qwen2", {"rope_theta": 1000000.0}, {}),
    "glm4v_text": (
        "glm4",
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "partial_rotary_factor": 1.0},
        {"attention_bias": True},
    ),
    "glm4v_moe_text": (
        "glm4_moe",
        {"max_position_embeddings": 65536, "attention_bias": True},
        {"use_qk_norm": False},
    ),
    "qwen3_vl_moe_text": (
        "qwen3_moe",
        {
            **_QWEN3_VL,
            "num_local_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
        },
        {"norm_topk_prob": True},
    ),
}
_QWEN3_5 = {
    "vocab_size": 248320,
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
# transformers' defaults, per model type, for keys a config.json may leave out.
_QWEN_MOE = {"max_position_embeddings": 32768, "decoder_sparse_step": 1, "norm_topk_prob": False}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "granite": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe_text": {
        **_QWEN3_5,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
    # Qwen 3.5's layers (but its vocabulary) with Qwen2-MoE's experts, renormalized.
    "qwen3_next": {
        **_QWEN3_5,
        **_QWEN_MOE,
        "vocab_size": 151936,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
    },
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "olmo3": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "exaone4": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "cohere": {
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "cohere2": {"max_position_embeddings": 8192, "tie_word_embeddings": True},
    "ministral": {"max_position_embeddings": 131072},
    "starcoder2": {
        "max_position_embeddings": 4096,
        "hidden_act": "gelu_pytorch_tanh",
        "norm_epsilon": 1e-5,
        "use_bias": True,
        "tie_word_embeddings": True,
    },
    "arcee": {"max_position_embeddings": 4096, "hidden_act": "relu2", "rms_norm_eps": 1e-5},
    "hunyuan_v1_dense": {
        "vocab_size": 290943,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    },
    "hunyuan_v1_moe": {
        "vocab_size": 290943,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "num_experts": 1,
        "moe_topk": 1,
    },
    "minimax_m2": {
        "max_position_embeddings": 196608,
        "head_dim": 128,
        "rope_theta": 5000000.0,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
    },
    "ministral3": {
        "max_position_embeddings": 262144,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    "smollm3": {
        "max_position_embeddings": 32768,
        "rope_theta": 2000000.0,
        "tie_word_embeddings": True,
        "no_rope_layer_interval": 4,
    },
    "mixtral": {
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
    },
    "qwen2_moe": {
        **_QWEN_MOE,
        "num_local_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
    "qwen3_moe": {
        **_QWEN_MOE,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "gemma2": {
        "max_position_embeddings": 8192,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # Llama 4's (Scout's shape; its multimodal checkpoints' text_config may leave keys out).
    "llama4_text": {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "no_rope_layer_interval": 4,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "attention_chunk_size": 8192,
    },
    # Gemma 3's multimodal checkpoints leave most of text_config to these (the 4B's shape).
    "gemma3_text": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "tie_word_embeddings": True,
    },
}
_DEEPSEEK = {
    "rms_norm_eps": 1e-6,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
_DEFAULTS[gemma4_config.MODEL_TYPE] = gemma4_config.DEFAULTS
_DEFAULTS["deepseek_v2"] = {
    **_DEEPSEEK,
    "max_position_embeddings": 2048,
    "first_k_dense_replace": 0,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1407,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
}
_DEFAULTS["deepseek_v3"] = {
    **_DEEPSEEK,
    "max_position_embeddings": 4096,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
}
# Mistral 4 (Mistral Small 4): DeepSeek-V3's latent attention and shared experts, routed by a
# softmax among groups, its queries scaled by position (Ministral 3's), YaRN rotating the
# qk_rope_head_dim channels of each head.
_DEFAULTS["mistral4"] = {
    **_DEEPSEEK,
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "max_position_embeddings": 1048576,
    "kv_lora_rank": 256,
    "q_lora_rank": 1024,
    "qk_nope_head_dim": 64,
    "first_k_dense_replace": 0,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 128.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
# GLM-4.5, 4.6 and 4.7: grouped-query attention rotating half of each head, DeepSeek-V3's
# experts.
_DEFAULTS["glm4_moe"] = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "partial_rotary_factor": 0.5,
    "first_k_dense_replace": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
}
# Solar Open (Upstage): Llama's attention (q/k/v biased by attention_bias, o_proj never),
# GLM-4.5's experts in every layer.
_DEFAULTS["solar_open"] = {
    **_DEFAULTS["glm4_moe"],
    "vocab_size": 196608,
    "rope_theta": 1000000.0,
    "head_dim": 128,
    "moe_intermediate_size": 1280,
    "intermediate_size": 1280,  # no config gives it: unused, every layer's MLP is the experts
    "partial_rotary_factor": 1.0,
    "num_nextn_predict_layers": 0,
}
# GLM-4.7-Flash: DeepSeek-V3's attention and experts.
_DEFAULTS["glm4_moe_lite"] = {
    **_DEFAULTS["deepseek_v3"],
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 768,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "moe_intermediate_size": 1536,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.8,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 1,
}
# Seed-OSS: Llama's layers with biased q/k/v (attention_out_bias for o_proj's).
_DEFAULTS["seed_oss"] = {
    "max_position_embeddings": 524288,
    "head_dim": 128,
    "attention_bias": True,
}
# ERNIE 4.5 (dense): Llama's layers, every projection biased with use_bias, each head's
# channels rotating in adjacent pairs.
_DEFAULTS["ernie4_5"] = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
}
# ERNIE 4.5's mixtures of experts (ERNIE-4.5-21B-A3B, 300B-A47B): its dense layers', and
# experts from moe_layer_start_index on.
_DEFAULTS["ernie4_5_moe"] = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "moe_k": 6,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_intermediate_size": 1536,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": -1,
    "moe_layer_interval": 1,
}
# GLM-4-0414 (GLM-4-9B/32B, GLM-Z1): biased q/k/v, half of each head rotating in adjacent
# pairs, norms before and after the attention and the MLP, gate/up fused in the checkpoint.
_DEFAULTS["glm4"] = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1.5625e-7,
    "head_dim": 128,
    "attention_bias": True,
    "partial_rotary_factor": 0.5,
}
# OLMoE: Llama's norms, q/k norms over the whole projections (OLMo 2's), Qwen's experts of
# intermediate_size in every layer.
_DEFAULTS["olmoe"] = {
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}
# Granite 3's mixtures of experts: Granite's scalars, Mixtral's routing (softmax over the
# top k logits), experts of intermediate_size in every layer; granitemoeshared adds a
# shared expert of shared_intermediate_size, added ungated.
_DEFAULTS["granitemoe"] = {
    "max_position_embeddings": 2048,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
_DEFAULTS["granitemoeshared"] = {**_DEFAULTS["granitemoe"], "shared_intermediate_size": 0}
# gpt-oss: transformers' defaults, YaRN among them where a config gives no rotation.
_DEFAULTS["gpt_oss"] = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
# The MLP's activation: SiLU, or (Gemma's, and those of the MLPs without a gate, Starcoder2's
# and Arcee's) the tanh-approximated GELU or the squared ReLU; the experts of a mixture and
# the packed CPU kernels fuse SiLU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu2")


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): each token's keys and values come from
    one latent of kv_lora_rank channels (normalized) plus qk_rope_head_dim rotated channels
    shared by every head; each head's query has qk_nope_head_dim channels matched against
    its own up-projection of the latent and qk_rope_head_dim rotated ones, and its value
    v_head_dim channels. The query comes from the hidden state directly (q_lora_rank 0) or
    through a normalized latent of q_lora_rank channels."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint's rotated channels turn in adjacent pairs (DeepSeek's layout), not
    # half against half: the loader reorders their rows.
    interleaved_rope: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """Qwen3-Next's and Qwen 3.5's Gated DeltaNet, their linear_attention layers' token
    mixer: a state of num_v_heads matrices (head_k_dim x head_v_dim) per request in place of
    a KV cache, read and updated by each token's key-head queries and keys (each serving
    num_v_heads / num_k_heads value heads) after a causal depthwise convolution of
    conv_kernel_size over the q/k/v channels."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int

    @property
    def conv_dim(self) -> int:
        """The channels the convolution mixes: q's, k's and v's."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def group(self) -> int:
        """The value heads each key head serves."""
        return self.num_v_heads // self.num_k_heads


@dataclass(frozen=True, slots=True)
class ExpertRouting:
    """How a router turns its logits into the chosen experts' weights, beyond the top k of
    a softmax (Mixtral's, Qwen's, gpt-oss'): DeepSeek's groups of experts (only the
    ``kept_groups`` best of ``num_groups`` are chosen from, a group scored by its best
    expert, or by the sum of its best two with ``group_by_top2``), V3's sigmoid scores with a
    learned bias that steers the choice but not the weights, and a factor on the weights."""

    sigmoid: bool = False
    num_groups: int = 1
    kept_groups: int = 1
    group_by_top2: bool = False
    score_bias: bool = False
    scaling: float = 1.0
    # The router's weight and logits in float32 whatever the model's dtype (DeepSeek's, as
    # transformers keeps them).
    float32: bool = False
    # Llama 4's: each chosen expert's weight scales the token's row before the expert's MLP
    # (rounded to the model's dtype, as transformers' routed_in), not the MLP's output after.
    weights_on_inputs: bool = False
    # Gemma 4's: the router reads its input RMS-normalized, scaled by a learned vector and by
    # hidden_size ** -0.5 (input_norm), and each chosen expert's weight, renormalized, is
    # multiplied by a learned factor of that expert's (per_expert_scale).
    input_norm: bool = False
    per_expert_scale: bool = False


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A model's architecture, parsed and checked from its HF config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # A token of a layer in sliding_layers attends to the last sliding_window tokens only
    # (itself included): Mistral's, Mixtral's and Phi-3's every layer, Gemma 3's local layers,
    # Qwen's by max_window_layers with use_sliding_window. None: every layer attends to all.
    sliding_window: int | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Gemma 4); num_experts 0 for a
    # dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, 0 for none
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts
    expert_bias: bool = False  # gpt-oss: biases of the router and of every expert's projections
    # Gemma 4's: an MoE layer keeps its dense MLP, the experts beside it (each branch with
    # norms of its own, their normalized outputs summed); elsewhere the experts replace it.
    experts_beside_mlp: bool = False
    # gpt-oss' clamped SwiGLU of the experts: gate clamped above and up on both sides at
    # swiglu_limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: SiLU(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # gpt-oss: a learned logit per query head in each softmax of its attention (no value).
    attention_sinks: bool = False
    routing: ExpertRouting = ExpertRouting()
    # The shared expert's output is scaled by the sigmoid of its own gate (Qwen2-MoE's), or
    # added as it is (DeepSeek's).
    shared_expert_gated: bool = True
    # DeepSeek's attention; None: heads of query, key and value (head_dim is then the
    # cache's row: the latent and the rotated channels, in one KV head).
    latent_attention: LatentAttention | None = None
    # DeepSeek-V3's multi-token prediction layers after the last one, left unread.
    num_nextn_predict_layers: int = 0
    # SmolLM3's and Llama 4's NoPE layers: their queries and keys are not rotated.
    nope_layers: tuple[int, ...] = ()
    # The checkpoint's rotated channels of each head turn in adjacent pairs (ERNIE 4.5's),
    # not half against half: the loader reorders the q and k projections' rows.
    interleaved_rope: bool = False

    sliding_layers: tuple[int, ...] = ()
    # Gemma 3's local (sliding_layers) layers rotate with their own base and no scaling; None:
    # every layer rotates by ``rope``.
    sliding_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    # Gemma: every RMSNorm scales by (1 + weight).
    gemma_norms: bool = False
    # Gemma's and GLM-4's: a layer normalizes the outputs of its attention and MLP before
    # the residual adds too (post_attention_layernorm, pre_feedforward_layernorm before the
    # MLP, post_feedforward_layernorm after it; GLM-4 names them post_self_attn_layernorm,
    # post_attention_layernorm and post_mlp_layernorm).
    sandwich_norms: bool = False
    # OLMo 2 and 3: no norm before the attention or the MLP, only of their outputs before
    # each residual add (post_attention_layernorm, post_feedforward_layernorm).
    olmo_norms: bool = False
    # OLMo 2's, 3's and OLMoE's q/k norms span the whole projection, not each head.
    whole_qk_norms: bool = False
    # Hunyuan's q/k norms (query_layernorm, key_layernorm) normalize the rotated heads.
    qk_norm_after_rope: bool = False
    # Llama 4's use_qk_norm: the rotated layers' q and k heads RMS-normalized after their
    # rotation without a weight (its Llama4TextL2Norm), in float32; NoPE layers' are not.
    qk_l2_norm: bool = False
    # Cohere's: the norms before each layer's block and after the last are LayerNorms (the
    # mean subtracted too, no bias; rms_norm_eps holds layer_norm_eps), and so are Command
    # R+'s q/k norms, with weights of their own for each head; a layer's attention and MLP
    # both read its one norm's output, each adding its output to the residual.
    layer_norms: bool = False
    parallel_block: bool = False
    # Starcoder2's LayerNorms add a bias too.
    norm_bias: bool = False
    # A dense layer's MLP: down(act(gate) * up), or (Starcoder2's, Arcee's) down(act(up)).
    gated_mlp: bool = True
    # gpt-oss' and OLMo's RMSNorms scale in float32 and only then round to the model's dtype
    # (their weights kept in float32); the others scale in the model's dtype, as Llama's.
    float32_norms: bool = False
    # Gemma 2's soft caps: each attention score s becomes c * tanh(s / c), and each logit
    # likewise with its own c; None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Read from a multimodal checkpoint's text_config (TEXT_OF_MULTIMODAL): its language
    # model's weights are named under language_model.
    multimodal: bool = False
    # A model that takes images (IMAGE_TYPES): its vision tower, and the token each of an
    # image's features takes the place of; None: text only.
    vision: VisionConfig | InternVLVisionConfig | None = None
    image_token_id: int | None = None
    # A sequence classifier's (``*ForSequenceClassification``: reward models, moderation
    # classifiers) number of labels: its ``score`` head replaces the LM head; 0 for a causal LM.
    num_labels: int = 0
    # A causal LM read as a classifier (vLLM's hf_overrides for Qwen3-Reranker and its kind):
    # its labels are these tokens' rows of the LM head (``classifier_from_token``), or with
    # ``two_way_softmax`` the second's row less the first's, one label whose sigmoid is the
    # second token's probability of the two (``is_original_qwen3_reranker``).
    classifier_from_token: tuple[str, ...] = ()
    two_way_softmax: bool = False
    # How the checkpoint's weights are quantized (dequantized as they load); None: they are not.
    checkpoint_quantization: CheckpointQuantization | None = None

    # Ministral 3's (as Llama 4's) queries are scaled by their position after the rotation:
    # by 1 + beta * ln(1 + floor(position / length)), beta here and length
    # original_max_position_embeddings; 0: not scaled.
    query_scaling_beta: float = 0.0
    query_scaling_length: int = 1
    # Llama 4's form of that scaling (its attn_temperature_tuning: beta attn_scale, length
    # floor_scale): positions counted from 1, the NoPE layers' queries only, multiplied in
    # float32 and rounded once after.
    attn_temperature_tuning: bool = False
    # Llama 4's chunked local attention: a token of a rotated layer attends to the earlier
    # tokens of its own chunk of this many (positions p - p % size .. p). None: no chunks.
    attention_chunk_size: int | None = None

    # Granite's scalars: the embedding's and each residual branch's factor, the attention's
    # scale (None: head_dim ** -0.5) and the divisor of the logits.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Qwen3-Next's and Qwen 3.5's hybrid layers: those of linear_layers mix tokens by a Gated
    # DeltaNet (linear_attention) instead of attention; the others are attention layers whose
    # output is gated by the sigmoid of a gate their q_proj computes beside each query head
    # (attn_output_gate).
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()
    attn_output_gate: bool = False
    # Channels the q/k/v projections read; 0: hidden_size. An EAGLE-3 head's (never a
    # config.json's) reads twice that: the token's embedding and the hidden state, side by side.
    qkv_input_size: int = 0
    # Gemma 4's attention (``shared/gemma4_config.py``): its full-attention layers' head size
    # and KV heads where they differ from the sliding layers' (0: the same), their values the
    # keys' projection (no v_proj), every layer's values RMS-normalized without a weight.
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    values_from_keys: bool = False
    value_norm: bool = False
    # Layer i attends over the KV cache of layer kv_sources[i]: Gemma 4's last
    # num_kv_shared_layers project queries only and read the last earlier layer of their kind;
    # empty: every layer its own. double_wide_mlp: those layers' MLPs are twice as wide.
    kv_sources: tuple[int, ...] = ()
    double_wide_mlp: bool = False
    # Gemma 4's per-layer embeddings: a vector of this size per layer and token (its own
    # vocabulary's table plus a projection of the embedding) gates a branch of each layer's
    # residual; 0: none. layer_scalars: each layer's output scaled by a weight of its own.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalars: bool = False

    @property
    def context_len(self) -> int:
        """The longest context the model serves, as vLLM derives it: max_position_embeddings,
        stretched by a linear rope scaling's factor, or YaRN's original context times its
        factor (Qwen's long-context recipe adds only rope_scaling), whichever is longer (vLLM
        takes the derived one even where shorter). Llama 3's and LongRoPE's lengths are
        already the stretched ones, and so is Gemma 3's, whose linear factor stretches its
        global layers alone."""
        stretched = self.max_position_embeddings
        if self.rope.type == "yarn":
            stretched = int(self.rope.original_max_position * self.rope.factor)
        elif self.rope.type == "linear" and self.model_type != "gemma3_text":
            stretched = int(self.max_position_embeddings * self.rope.factor)
        return max(stretched, self.max_position_embeddings)

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer ``index`` mixes tokens by linear attention (keeps no KV cache)."""
        return index in self.linear_layers

    @property
    def caches_prefixes(self) -> bool:
        """Whether a prefix's cached KV is all a request needs to go on from it: not where
        linear-attention layers keep a state per request (prefix caching is then off)."""
        return not self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend: all but the linear-attention ones."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    def kv_source(self, index: int) -> int:
        """The layer whose KV cache layer ``index`` attends over (its own but Gemma 4's
        KV-sharing layers')."""
        return self.kv_sources[index] if self.kv_sources else index

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers that keep a KV cache of their own."""
        return tuple(i for i in self.attention_layers if self.kv_source(i) == i)

    def for_layer(self, index: int) -> ModelConfig:
        """The config with layer ``index``'s own shapes: Gemma 4's full-attention layers'
        head size and KV heads, its KV-sharing layers' double-wide MLP; elsewhere this one."""
        if not (self.global_head_dim or self.values_from_keys or self.double_wide_mlp):
            return self
        full = index not in self.sliding_layers  # values from keys are the full layers' alone
        wide = self.double_wide_mlp and self.kv_source(index) != index
        return dataclasses.replace(
            self,
            head_dim=self.global_head_dim if full and self.global_head_dim else self.head_dim,
            num_kv_heads=(self.global_num_kv_heads or self.num_kv_heads)
            if full
            else self.num_kv_heads,
            values_from_keys=self.values_from_keys and full,
            intermediate_size=self.intermediate_size * (2 if wide else 1),
        )

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer ``index``; None where it attends to every token."""
        return self.sliding_window if index in self.sliding_layers else None

    def layer_chunk(self, index: int) -> int | None:
        """The attention chunk of layer ``index``: Llama 4's on its rotated layers, as
        transformers' default layer_types chunks them; None where attention is not chunked."""
        return None if index in self.nope_layers else self.attention_chunk_size

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """ValueError names the key that is missing, mistyped or not supported."""
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type in MODEL_TYPE_ALIASES:
            model_type, defaults, fixed = MODEL_TYPE_ALIASES[model_type]
            hf = {**defaults, **hf, **fixed, "model_type": model_type}
        if model_type in TEXT_OF_MULTIMODAL:
            text = mapping(hf, "text_config")
            if model_type in _TEXT_AT_TOP_LEVEL and "text_config" not in hf:
                text = {k: v for k, v in hf.items() if k not in ("model_type", "vision_config")}
            text_types = TEXT_OF_MULTIMODAL[model_type]
            text_type = text.get("model_type", text_types[0])
            if text_type not in text_types:
                raise ValueError(
                    f"config.json: a {model_type} checkpoint's text_config of model_type "
                    f"{text_type!r} is not supported; supported: {text_types}"
                )
            # Idefics3's and SmolVLM's text_config defaults to an rms_norm_eps of its own.
            defaults = {"rms_norm_eps": 1e-5} if model_type in _IDEFICS3_TYPES else {}
            language_model = cls.from_hf({**defaults, **text, "model_type": text_type})
            # The whole model's tie_word_embeddings ties its head, as transformers reads it
            # (left out: tied, but where the config class unties it: Llama 4's, Idefics3's).
            tied = hf.get("tie_word_embeddings")
            untied = ("llama4", *_IDEFICS3_TYPES)
            tied = model_type not in untied if tied is None else flag(hf, "tie_word_embeddings")
            image_token_id = None
            if model_type in IMAGE_TYPES:
                image_token_id = size(hf, "image_token_id", IMAGE_TYPES[model_type])
                if image_token_id >= language_model.vocab_size:
                    raise ValueError(
                        f"config.json: image_token_id {image_token_id} is outside the "
                        f"vocabulary of {language_model.vocab_size} tokens"
                    )
            return dataclasses.replace(
                language_model,
                multimodal=True,
                tie_word_embeddings=tied,
                checkpoint_quantization=read_checkpoint_quantization(hf, language_model.model_type),
                vision=_vision_config(model_type, hf),
                image_token_id=image_token_id,
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: unsupported model_type {model_type!r}; "
                "supported: "
                f"{SUPPORTED_MODEL_TYPES + tuple(TEXT_OF_MULTIMODAL) + tuple(MODEL_TYPE_ALIASES)}"
            )
        # A null counts as left out, as transformers reads it (but a null sliding_window).
        window = _sliding_window(model_type, hf)
        # DeepSeek's null q_lora_rank: a query projected directly, not the default latent.
        direct_query = "q_lora_rank" in hf and hf["q_lora_rank"] is None
        # Llama 4's null attention_chunk_size: attention not chunked, not the default chunk.
        unchunked = "attention_chunk_size" in hf and hf["attention_chunk_size"] is None
        hf = {**_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None}}
        gemma = model_type in ("gemma2", "gemma3_text")
        gemma4 = model_type == gemma4_config.MODEL_TYPE
        qwen_hybrid = model_type in QWEN_HYBRID_TYPES
        cohere = model_type in ("cohere", "cohere2")
        # Cohere multiplies its logits by logit_scale.
        logits_scaling: dict[str, Any] = (
            {"logits_scaling": 1 / positive(hf, "logit_scale", 0.0625)} if cohere else {}
        )
        ernie = model_type in ("ernie4_5", "ernie4_5_moe")
        # ERNIE's and Starcoder2's use_bias: every projection's.
        use_bias = (ernie or model_type == "starcoder2") and flag(hf, "use_bias")
        # Gemma's configs name it hidden_activation (transformers reads only that one there).
        act_key = "hidden_activation" if gemma or gemma4 else "hidden_act"
        act = hf.get(act_key, "silu")
        # Starcoder2's and Arcee's MLPs are not gated: up, the activation, down.
        gated = model_type not in ("starcoder2", "arcee")
        implemented = ACTIVATIONS if gemma or gemma4 or not gated else ACTIVATIONS[:1]
        if act not in implemented:
            raise ValueError(
                f"config.json: unsupported {act_key} {act!r}; implemented: {implemented}"
            )
        if not gemma4 and flag(hf, "use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported")
        if hf.get("clip_qkv") is not None:
            raise ValueError(
                "config.json: clip_qkv (queries, keys and values clamped) is not supported"
            )
        hidden, num_heads = count(hf, "hidden_size"), count(hf, "num_attention_heads")
        num_kv_heads = count(hf, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        max_pos = count(hf, "max_position_embeddings")
        attention_bias = flag(hf, "attention_bias")
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        if model_type == "minimax_m2" and "rotary_dim" in hf:
            # MiniMax-M2's files give the rotated channels of each head, as transformers reads.
            rotated = count(hf, "rotary_dim") / count(hf, "head_dim")
            hf.setdefault("partial_rotary_factor", rotated)
        latent = _latent_attention(model_type, hf, direct_query)
        if latent is None:
            head_dim = count(hf, "head_dim", hidden // num_heads)
            # Gemma 4's full-attention layers rotate heads of their own size.
            full_head_dim = (
                gemma4_config.full_attention_heads(hf, count(hf, "num_hidden_layers"))[0]
                if gemma4
                else head_dim
            )
            rope, sliding_rope = read_rope(hf, model_type, head_dim, max_pos, full_head_dim)
        else:  # one KV head: the latent and the rotated channels every head reads
            num_kv_heads, head_dim = 1, latent.kv_lora_rank + latent.qk_rope_head_dim
            rope, sliding_rope = _latent_rope(model_type, hf, latent, max_pos)
        num_layers = count(hf, "num_hidden_layers")
        # Gemma 3's and OLMo 3's sliding layers rotate as such even where no window is set.
        sliding = (
            ()
            if window is None and sliding_rope is None
            else _sliding_layers(model_type, hf, num_layers)
        )
        return cls(
            model_type=model_type,
            vocab_size=count(hf, "vocab_size"),
            hidden_size=hidden,
            # Llama 4's intermediate_size is its experts'; its dense layers' MLP is larger.
            # Qwen 3.5's MoE has no dense layer: its experts' size stands in.
            intermediate_size=count(
                hf,
                {
                    "llama4_text": "intermediate_size_mlp",
                    "qwen3_5_moe_text": "moe_intermediate_size",
                }.get(model_type, "intermediate_size"),
            ),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=positive(hf, "layer_norm_eps", 1e-5)
            if cohere
            else positive(hf, "norm_epsilon", 1e-5)
            if model_type == "starcoder2"
            else positive(hf, "rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=max_pos,
            sliding_window=window,
            sliding_layers=sliding,
            sliding_rope=sliding_rope,
            hidden_act=act,
            # Qwen3-Next's and 3.5's norms are Gemma's, (1 + weight) (but their Gated
            # DeltaNet's own).
            gemma_norms=gemma or qwen_hybrid,
            sandwich_norms=gemma or gemma4 or model_type == "glm4",
            # Qwen2 has q/k/v biases (Qwen2-MoE unless its qkv_bias says not) and never an
            # o_proj bias.
            qkv_bias=attention_bias
            or model_type == "qwen2"
            or (model_type == "qwen2_moe" and flag(hf, "qkv_bias", True))
            or use_bias,
            o_bias=(
                flag(hf, "attention_out_bias")
                if model_type == "seed_oss"
                else attention_bias
                and not qwen2
                and model_type not in ("glm4_moe", "glm4", "solar_open")
            )
            or use_bias,
            # Only these configs have mlp_bias (transformers ignores the key elsewhere).
            mlp_bias=(
                model_type in ("llama", "granite", "smollm3", "seed_oss", "arcee")
                and flag(hf, "mlp_bias")
            )
            or use_bias,
            interleaved_rope=ernie or model_type in ("glm4", "cohere", "cohere2", "llama4_text"),
            qk_norm=model_type
            in (
                "qwen3",
                "gemma4_text",
                *QWEN_HYBRID_TYPES,
                "qwen3_moe",
                "gemma3_text",
                "olmo2",
                "olmo3",
                "olmoe",
                "exaone4",
                "minimax_m2",
                "hunyuan_v1_dense",
                "hunyuan_v1_moe",
            )
            or (model_type in ("glm4_moe", "cohere") and flag(hf, "use_qk_norm")),
            olmo_norms=model_type in ("olmo2", "olmo3", "exaone4"),
            whole_qk_norms=model_type in ("olmo2", "olmo3", "olmoe", "minimax_m2"),
            qk_norm_after_rope=model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"),
            float32_norms=model_type in ("gpt_oss", "olmo2", "olmo3", "gemma4_text"),
            attention_sinks=model_type == "gpt_oss",
            nope_layers=_nope_layers(hf, num_layers)
            if model_type in ("smollm3", "llama4_text")
            # EXAONE 4's global layers rotate nothing where it has local ones; Command R7B's
            # (Cohere 2's) never, nor its local ones without a window.
            else tuple(i for i in range(num_layers) if i not in sliding)
            if (model_type == "exaone4" and window is not None) or model_type == "cohere2"
            else (),
            layer_norms=cohere or model_type == "starcoder2",
            norm_bias=model_type == "starcoder2",
            parallel_block=cohere,
            gated_mlp=gated,
            tie_word_embeddings=flag(hf, "tie_word_embeddings"),
            checkpoint_quantization=read_checkpoint_quantization(hf, model_type),
            **_classifier(hf),
            **_experts(model_type, hf, num_layers),
            **_latent_fields(latent, hf),
            **_deepseek_experts(model_type, hf, num_layers),
            **_granite(model_type, hf),
            **_gemma(model_type, hf),
            **_query_scaling(model_type, hf),
            **_llama4(model_type, hf, unchunked),
            **_linear_attention(model_type, hf, num_layers),
            **(gemma4_config.gemma4_fields(hf, num_layers) if gemma4 else {}),
            **logits_scaling,
        )

    def layer_tensor_shape(self, module: str) -> tuple[int, int]:
        """(rows, columns) of decoder-layer weight ``module`` (its Hugging Face name, e.g.
        ``self_attn.q_proj``; an expert's without its number, ``mlp.experts.gate_proj``), whole,
        not a tensor-parallel shard; columns 0 for a vector. KeyError for a module these
        models do not have."""
        h, d, inter = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        qkv_in = self.qkv_input_size or h
        expert, shared = self.moe_intermediate_size, self.shared_expert_intermediate_size
        if self.latent_attention is not None and module.startswith("self_attn."):
            return self._latent_tensor_shape(module)
        if module.startswith("linear_attn."):
            return self._linear_tensor_shape(module)
        # q/k norms over the whole projections (OLMo's), a weight row per head (Command R+'s),
        # or one weight every head shares.
        q_norm, k_norm = (
            ((q, 0), (kv, 0))
            if self.whole_qk_norms
            else ((self.num_heads, d), (self.num_kv_heads, d))
            if self.layer_norms
            else ((d, 0), (d, 0))
        )
        return {
            "mlp.gate": (self.num_experts, h),
            "mlp.experts.gate_proj": (expert, h),
            "mlp.experts.up_proj": (expert, h),
            "mlp.experts.down_proj": (h, expert),
            "mlp.shared_expert.gate_proj": (shared, h),
            "mlp.shared_expert.up_proj": (shared, h),
            "mlp.shared_expert.down_proj": (h, shared),
            "mlp.shared_expert_gate": (1, h),
            "mlp.shared_experts.gate_proj": (shared, h),
            "mlp.shared_experts.up_proj": (shared, h),
            "mlp.shared_experts.down_proj": (h, shared),
            "self_attn.qkv_proj": (q + 2 * kv, qkv_in),  # Phi-3's fused checkpoint tensors
            "mlp.gate_up_proj": (2 * inter, h),
            # Qwen 3.5's: each query head's channels, then its gate's (``attn_output_gate``).
            "self_attn.q_proj": (2 * q if self.attn_output_gate else q, qkv_in),
            "self_attn.gated_q": (q, qkv_in),
            "self_attn.q_gate": (q, qkv_in),
            "self_attn.k_proj": (kv, qkv_in),
            "self_attn.v_proj": (kv, qkv_in),
            "self_attn.o_proj": (h, q),
            "self_attn.q_norm": q_norm,
            "self_attn.sinks": (self.num_heads, 0),
            "self_attn.query_layernorm": (d, 0),  # Hunyuan's q/k norms
            "self_attn.key_layernorm": (d, 0),
            "self_attn.k_norm": k_norm,
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
            "mlp.c_fc": (inter, h),  # Starcoder2's up and down projections
            "mlp.c_proj": (h, inter),
            "input_layernorm": (h, 0),
            "post_attention_layernorm": (h, 0),
            "pre_feedforward_layernorm": (h, 0),
            "post_feedforward_layernorm": (h, 0),
            "per_layer_input_gate": (self.per_layer_input_size, h),  # Gemma 4's
            "per_layer_projection": (h, self.per_layer_input_size),
            "post_per_layer_input_norm": (h, 0),
            "layer_scalar": (1, 0),
            # Gemma 4's router (its input norm's weight, scale; a factor per expert) and the
            # norms around its experts.
            "router.proj": (self.num_experts, h),
            "router.scale": (h, 0),
            "router.per_expert_scale": (self.num_experts, 0),
            "pre_feedforward_layernorm_2": (h, 0),
            "post_feedforward_layernorm_1": (h, 0),
            "post_feedforward_layernorm_2": (h, 0),
        }[module]

    def _linear_tensor_shape(self, module: str) -> tuple[int, int]:
        la, h = self.linear_attention, self.hidden_size
        if la is None:
            raise KeyError(module)
        key, value = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
        kernel = la.conv_kernel_size
        return {
            "linear_attn.in_proj_qkv": (la.conv_dim, h),
            # Qwen3-Next's: q, k, v and z (or b and a) interleaved by key head.
            "linear_attn.in_proj_qkvz": (la.conv_dim + value, h),
            "linear_attn.in_proj_ba": (2 * la.num_v_heads, h),
            "linear_attn.in_proj_q": (key, h),
            "linear_attn.in_proj_k": (key, h),
            "linear_attn.in_proj_v": (value, h),
            "linear_attn.in_proj_z": (value, h),
            "linear_attn.in_proj_b": (la.num_v_heads, h),
            "linear_attn.in_proj_a": (la.num_v_heads, h),
            "linear_attn.conv1d": (la.conv_dim, kernel),
            "linear_attn.conv1d_q": (key, kernel),
            "linear_attn.conv1d_k": (key, kernel),
            "linear_attn.conv1d_v": (value, kernel),
            "linear_attn.dt_bias": (la.num_v_heads, 0),
            "linear_attn.A_log": (la.num_v_heads, 0),
            "linear_attn.norm": (la.head_v_dim, 0),
            "linear_attn.out_proj": (h, value),
        }[module]

    def _latent_tensor_shape(self, module: str) -> tuple[int, int]:
        mla, h, heads = self.latent_attention, self.hidden_size, self.num_heads
        assert mla is not None
        q_in = mla.q_lora_rank or h
        return {
            "self_attn.q_proj": (heads * mla.qk_head_dim, h),
            "self_attn.q_a_proj": (mla.q_lora_rank, h),
            "self_attn.q_a_layernorm": (mla.q_lora_rank, 0),
            "self_attn.q_b_proj": (heads * mla.qk_head_dim, q_in),
            "self_attn.kv_a_proj_with_mqa": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
            "self_attn.kv_a_layernorm": (mla.kv_lora_rank, 0),
            "self_attn.kv_b_proj": (
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
            ),
            "self_attn.o_proj": (h, heads * mla.v_head_dim),
        }[module]


def _vision_config(
    model_type: str, hf: dict[str, Any]
) -> VisionConfig | InternVLVisionConfig | None:
    """The vision tower of a checkpoint whose images Weir reads (IMAGE_TYPES)."""
    if model_type == "internvl":
        return InternVLVisionConfig.from_hf(hf)
    return VisionConfig.from_hf(hf) if model_type in _IDEFICS3_TYPES else None


def _sliding_window(model_type: str, hf: dict[str, Any]) -> int | None:
    """The window as transformers applies it: Mistral's and Gemma's (4096 where the key is
    left out, none where it is null; OLMo 3's and EXAONE 4's likewise), gpt-oss' (128 where left
    out), Mixtral's and Phi-3's
    whenever set; Qwen's (4096 by default) and SmolLM3's only with use_sliding_window."""
    windowed = (
        "mistral",
        "mixtral",
        "phi3",
        "gemma2",
        "gemma3_text",
        "gpt_oss",
        "olmo3",
        "exaone4",
        "cohere2",
        "ministral",
        "ministral3",
        "starcoder2",
        "gemma4_text",
    )
    if model_type not in windowed and not flag(hf, "use_sliding_window"):
        return None
    defaults = {
        **dict.fromkeys(("mixtral", "phi3", "smollm3", "ministral3", "starcoder2")),
        "gpt_oss": 128,
        "gemma4_text": gemma4_config.DEFAULTS["sliding_window"],
    }
    window = hf.get("sliding_window", defaults.get(model_type, 4096))
    return None if window is None else count({"sliding_window": window}, "sliding_window")


def _sliding_layers(model_type: str, hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers the window applies to, as transformers picks them: every layer of Mistral,
    Mixtral, Phi-3 and Qwen3-MoE; elsewhere those config.json's layer_types names
    "sliding_attention", or where it has none, Qwen2's and Qwen3's layers from
    max_window_layers on, Qwen2-MoE's even layers below it, and every Gemma 3 and EXAONE 4
    layer but each sliding_window_pattern-th (Gemma 2's and gpt-oss' every even layer; OLMo 3's
    all but every fourth), SmolLM3's NoPE layers."""
    if model_type in ("mistral", "mixtral", "phi3", "qwen3_moe", "ministral3", "starcoder2"):
        return tuple(range(num_layers))
    if model_type == gemma4_config.MODEL_TYPE:
        gemma4_types = gemma4_config.layer_types(hf, num_layers)
        return tuple(i for i, kind in enumerate(gemma4_types) if kind == "sliding_attention")
    types = layer_types(hf, num_layers, ("sliding_attention", "full_attention"))
    if types is not None:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type == "ministral":
        return tuple(range(num_layers))
    if model_type == "gpt_oss":
        return tuple(range(0, num_layers, 2))
    if model_type == "smollm3":
        return _nope_layers(hf, num_layers)
    if model_type == "olmo3":
        return tuple(i for i in range(num_layers) if (i + 1) % 4)
    if model_type in ("gemma2", "gemma3_text", "exaone4", "cohere2"):
        default = {"gemma3_text": 6, "exaone4": 4, "cohere2": 4}.get(model_type)
        pattern = 2 if model_type == "gemma2" else count(hf, "sliding_window_pattern", default)
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    first_full = count(hf, "max_window_layers", 28)
    if model_type == "qwen2_moe":
        return tuple(i for i in range(min(first_full, num_layers)) if i % 2 == 0)
    return tuple(range(first_full, num_layers))


def _nope_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """SmolLM3's and Llama 4's layers without a rotation, as transformers reads them: where
    no_rope_layers (one flag per layer, 1: rotated) says 0, else (where it is left out or
    empty, as in Llama 4 Scout's file) every no_rope_layer_interval-th layer."""
    flags = hf.get("no_rope_layers")
    if not flags:
        interval = count(hf, "no_rope_layer_interval")
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) or isinstance(f, bool) for f in flags)
    ):
        raise ValueError(
            f"config.json: no_rope_layers must be 0 or 1 for each of the {num_layers} layers, "
            f"got {flags!r}"
        )
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


def _gemma(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    if model_type not in ("gemma2", "gemma3_text"):
        return {}
    # Gemma scales its embeddings by sqrt(hidden_size) and its attention by
    # query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5. A cap left out or null is
    # none (the nulls were dropped above). Gemma 3's config keeps Gemma 2's attention cap,
    # which its attention never applies (transformers' and vLLM's).
    caps: tuple[str, ...] = ("final_logit_softcapping",)
    if model_type == "gemma2":
        caps += ("attn_logit_softcapping",)
    return {
        "attn_logit_softcapping": None,
        "embedding_multiplier": math.sqrt(count(hf, "hidden_size")),
        "attention_multiplier": positive(hf, "query_pre_attn_scalar", 256) ** -0.5,
        **{cap: positive(hf, cap, 1.0) if cap in hf else None for cap in caps},
    }


def _linear_attention(model_type: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's and Qwen 3.5's linear-attention layers, where layer_types names them
    (every full_attention_interval-th layer attends, as transformers defaults them)."""
    if model_type not in QWEN_HYBRID_TYPES:
        return {}
    interval = count(hf, "full_attention_interval")
    kinds = ("linear_attention", "full_attention")
    default = [kinds[(i + 1) % interval == 0] for i in range(num_layers)]
    types = layer_types(hf, num_layers, kinds, default)
    assert types is not None
    if kinds[1] not in types:  # the attention backend plans a step over such a layer's cache
        raise ValueError(
            f"config.json: layer_types must name one full_attention at least, got {types!r}"
        )
    linear = LinearAttention(
        num_k_heads=count(hf, "linear_num_key_heads"),
        num_v_heads=count(hf, "linear_num_value_heads"),
        head_k_dim=count(hf, "linear_key_head_dim"),
        head_v_dim=count(hf, "linear_value_head_dim"),
        conv_kernel_size=count(hf, "linear_conv_kernel_dim"),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(
            f"config.json: linear_num_value_heads {linear.num_v_heads} is not a multiple of "
            f"linear_num_key_heads {linear.num_k_heads}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: {model_type}'s hidden_act must be silu (its convolution's)")
    return {
        "linear_attention": linear,
        "linear_layers": tuple(i for i, t in enumerate(types) if t == kinds[0]),
        "attn_output_gate": True,
    }


def _query_scaling(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3's and Mistral 4's position scaling of their queries, from their
    rope_parameters (where transformers reads it)."""
    if model_type not in ("ministral3", "mistral4"):
        return {}
    rope = {**mapping(hf, "rope_parameters"), **mapping(hf, "rope_scaling")}
    beta = rope.get("llama_4_scaling_beta", 0.0)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
        raise ValueError(f"config.json: llama_4_scaling_beta must be a number >= 0, got {beta!r}")
    if not beta:
        return {}
    length = count(rope, "original_max_position_embeddings")
    return {"query_scaling_beta": float(beta), "query_scaling_length": length}


def _llama4(model_type: str, hf: dict[str, Any], unchunked: bool) -> dict[str, Any]:
    """Llama 4's attention beside Llama's, as transformers reads it: q/k norms without a
    weight on its rotated layers (use_qk_norm), its NoPE layers' queries scaled by their
    position (attn_temperature_tuning, by attn_scale past each floor_scale tokens; Meta's
    files write it as a number, 4, read as true as vLLM reads it), and the chunk of its
    chunked attention."""
    if model_type != "llama4_text":
        return {}
    tuning = hf["attn_temperature_tuning"]
    if type(tuning) not in (bool, int):
        raise ValueError(
            f"config.json: attn_temperature_tuning must be true or false, got {tuning!r}"
        )
    temperature = (
        {
            "attn_temperature_tuning": True,
            "query_scaling_beta": positive(hf, "attn_scale", 0.1),
            "query_scaling_length": count(hf, "floor_scale"),
        }
        if tuning
        else {}
    )
    return {
        "qk_l2_norm": flag(hf, "use_qk_norm"),
        "attention_chunk_size": None if unchunked else count(hf, "attention_chunk_size"),
        **temperature,
    }


def _granite(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    if model_type not in ("granite", "granitemoe", "granitemoeshared"):
        return {}
    return {
        "embedding_multiplier": positive(hf, "embedding_multiplier", 1.0),
        "residual_multiplier": positive(hf, "residual_multiplier", 1.0),
        "attention_multiplier": positive(hf, "attention_multiplier", 1.0),
        "logits_scaling": positive(hf, "logits_scaling", 1.0),
    }


def _experts(model_type: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE model type, as transformers reads them: Mixtral's
    experts (and gpt-oss') are the size of intermediate_size in every layer, always
    renormalized; Qwen's
    are moe_intermediate_size in every decoder_sparse_step-th layer not in mlp_only_layers;
    Gemma 4's (enable_moe_block) num_experts of moe_intermediate_size, top_k_experts of them,
    in every layer beside its dense MLP."""
    extra: dict[str, Any] = {}
    top_k_key = "num_experts_per_tok"
    if model_type in ("mixtral", "gpt_oss"):
        experts, inter = count(hf, "num_local_experts"), count(hf, "intermediate_size")
        layers, norm, shared = list(range(num_layers)), True, 0
        if model_type == "gpt_oss":
            # Its softmax over the top k logits is the renormalized top k of a softmax over all.
            extra = {
                "expert_bias": True,
                "swiglu_limit": positive(hf, "swiglu_limit", 7.0),
                "swiglu_alpha": positive(hf, "swiglu_alpha", 1.702),
            }
    elif model_type in ("granitemoe", "granitemoeshared"):
        experts, inter = count(hf, "num_local_experts"), count(hf, "intermediate_size")
        layers, norm = list(range(num_layers)), True
        shared = hf.get("shared_intermediate_size", 0) if model_type == "granitemoeshared" else 0
        if type(shared) is not int or shared < 0:
            raise ValueError(
                f"config.json: shared_intermediate_size must be a count, got {shared!r}"
            )
        extra = {"shared_expert_gated": False}
    elif model_type == "minimax_m2":
        # Mixtral's experts chosen by sigmoid scores and a bias, as V3's (one group, no
        # scaling), renormalized; its multi-token prediction modules after the last layer.
        experts, inter = count(hf, "num_local_experts"), count(hf, "intermediate_size")
        layers, norm, shared = list(range(num_layers)), True, 0
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(
                f"config.json: MiniMax-M2 routes by scoring_func {hf['scoring_func']!r}, which "
                "Weir does not read (transformers reads a sigmoid)"
            )
        nextn = hf.get("num_mtp_modules", 0) if flag(hf, "use_mtp") else 0
        if type(nextn) is not int or nextn < 0:
            raise ValueError(f"config.json: num_mtp_modules must be a count, got {nextn!r}")
        extra = {
            "routing": ExpertRouting(sigmoid=True, score_bias=True),
            "num_nextn_predict_layers": nextn,
        }
    elif model_type == "ernie4_5_moe":
        # Chosen by a float32 softmax plus a bias (moe_statics), weighted by the softmax's
        # scores renormalized; the shared experts' columns added ungated.
        experts, inter = count(hf, "moe_num_experts"), count(hf, "moe_intermediate_size")
        interval, start = count(hf, "moe_layer_interval"), hf["moe_layer_start_index"]
        end = hf["moe_layer_end_index"]
        end = num_layers - 1 if end == -1 else end
        if type(start) is not int or type(end) is not int:
            raise ValueError(
                "config.json: moe_layer_start_index and moe_layer_end_index must be layer "
                f"numbers, got {start!r} and {end!r}"
            )
        layers = [i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end]
        num_shared = hf["moe_num_shared_experts"]
        if type(num_shared) is not int or num_shared < 0:
            raise ValueError(
                f"config.json: moe_num_shared_experts must be a count, got {num_shared!r}"
            )
        norm, shared = True, inter * num_shared
        if flag(hf, "use_bias"):
            raise ValueError("config.json: ERNIE 4.5's experts with use_bias are not read")
        top_k_key = "moe_k"
        extra = {
            "routing": ExpertRouting(score_bias=True, float32=True),
            "shared_expert_gated": False,
        }
    elif model_type == "llama4_text":
        # The top k of the logits weighted by their sigmoids, not renormalized, each scaling
        # its expert's input; a shared expert of the experts' size added ungated; the experts
        # in the layers moe_layers lists, else in every interleave_moe_layer_step-th.
        experts, inter = count(hf, "num_local_experts"), count(hf, "intermediate_size")
        step = count(hf, "interleave_moe_layer_step")
        listed = hf.get("moe_layers", list(range(step - 1, num_layers, step)))
        if not isinstance(listed, list) or not all(type(i) is int for i in listed):
            raise ValueError(f"config.json: moe_layers must be layer numbers, got {listed!r}")
        layers = [i for i in range(num_layers) if i in listed]
        norm, shared = False, inter
        extra = {
            "routing": ExpertRouting(sigmoid=True, weights_on_inputs=True),
            "shared_expert_gated": False,
        }
    elif model_type == "hunyuan_v1_moe":
        # Hunyuan-A13B's: a float32 router's softmax, its top k renormalized, experts and
        # the shared MLP (added ungated) of intermediate_size, in every layer; its file may
        # give the top k and the experts per layer (the same in every layer, as released).
        experts = _one_per_layer(hf, "num_experts", num_layers)
        inter, layers, norm = count(hf, "intermediate_size"), list(range(num_layers)), True
        shared = inter
        hf = {**hf, "moe_topk": _one_per_layer(hf, "moe_topk", num_layers)}
        top_k_key = "moe_topk"
        extra = {"routing": ExpertRouting(float32=True), "shared_expert_gated": False}
    elif model_type == "olmoe":
        experts = count(hf, "num_experts", hf.get("num_local_experts"))
        inter, layers, shared = count(hf, "intermediate_size"), list(range(num_layers)), 0
        norm = flag(hf, "norm_topk_prob")
    elif model_type == "qwen3_5_moe_text":
        # Every layer's experts, their softmax's top k renormalized, beside a shared expert
        # gated by its sigmoid (Qwen2-MoE's).
        experts, inter = count(hf, "num_experts"), count(hf, "moe_intermediate_size")
        layers, norm = list(range(num_layers)), True
        shared = count(hf, "shared_expert_intermediate_size")
    elif model_type == gemma4_config.MODEL_TYPE:
        # With enable_moe_block, every layer's experts beside its dense MLP, the top k of a
        # softmax renormalized, then scaled per expert.
        if not flag(hf, "enable_moe_block"):
            return {}
        experts, inter = count(hf, "num_experts"), count(hf, "moe_intermediate_size")
        layers, norm, shared = list(range(num_layers)), True, 0
        top_k_key = "top_k_experts"
        extra = {
            "routing": ExpertRouting(input_norm=True, per_expert_scale=True),
            "experts_beside_mlp": True,
        }
    elif model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        # transformers >= 5 writes num_local_experts where Qwen's own files say num_experts.
        experts = count(hf, "num_experts", hf.get("num_local_experts"))
        inter = count(hf, "moe_intermediate_size")
        step = count(hf, "decoder_sparse_step")
        dense = hf.get("mlp_only_layers", [])
        if not isinstance(dense, list) or not all(type(i) is int for i in dense):
            raise ValueError(f"config.json: mlp_only_layers must be layer numbers, got {dense!r}")
        layers = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        norm = flag(hf, "norm_topk_prob")
        # Qwen2-MoE's and Qwen3-Next's shared expert, gated by its sigmoid.
        shared = 0 if model_type == "qwen3_moe" else count(hf, "shared_expert_intermediate_size")
    else:
        return {}
    top_k = count(hf, top_k_key)
    if top_k > experts:
        raise ValueError(f"config.json: {top_k_key} {top_k} is more than the {experts} experts")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm,
        "shared_expert_intermediate_size": shared,
        "moe_layers": tuple(layers),
        **extra,
    }


def _one_per_layer(hf: dict[str, Any], key: str, num_layers: int) -> int:
    """A count config.json may give once or per layer (Hunyuan's), the same in each."""
    value = hf[key]
    if isinstance(value, list):
        if len(value) != num_layers or len(set(value)) != 1:
            raise ValueError(
                f"config.json: {key} differs between layers ({value!r}); Weir reads one for all"
            )
        value = value[0]
    return count({key: value}, key)


# DeepSeek's architectures, and those built of its layers (GLM-4.7-Flash, Mistral 4); GLM-4.5's
# and 4.6's attention is of q/k/v heads, its experts DeepSeek-V3's.
_LATENT_ATTENTION_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4")
_DEEPSEEK_EXPERT_TYPES = (*_LATENT_ATTENTION_TYPES, "glm4_moe", "solar_open")


def _latent_attention(
    model_type: str, hf: dict[str, Any], direct_query: bool
) -> LatentAttention | None:
    if model_type not in _LATENT_ATTENTION_TYPES:
        return None
    return LatentAttention(
        q_lora_rank=0 if direct_query else count(hf, "q_lora_rank"),
        kv_lora_rank=count(hf, "kv_lora_rank"),
        qk_nope_head_dim=count(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=count(hf, "qk_rope_head_dim"),
        v_head_dim=count(hf, "v_head_dim"),
        # transformers' DeepSeek-V2 always turns adjacent pairs; V3 where rope_interleave says.
        interleaved_rope=model_type == "deepseek_v2" or flag(hf, "rope_interleave", True),
    )


def _latent_rope(
    model_type: str, hf: dict[str, Any], latent: LatentAttention, max_pos: int
) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotation of each head's qk_rope_head_dim channels. Mistral 4's config gives it as
    transformers reads it, a partial_rotary_factor of the whole qk_head_dim (by default the
    rotated channels' share), of which int(qk_head_dim * factor) rotate: a factor that does
    not come to qk_rope_head_dim (a float's rounding can make it one less) is refused, and so
    is its default rotation, which transformers' Mistral 4 computes over the whole
    qk_head_dim (its partial_rotary_factor unread), wider than the channels it turns."""
    if model_type != "mistral4":
        return read_rope(hf, model_type, latent.qk_rope_head_dim, max_pos)
    share = latent.qk_rope_head_dim / latent.qk_head_dim
    rope, local = read_rope(
        {"partial_rotary_factor": share, **hf}, model_type, latent.qk_head_dim, max_pos
    )
    if rope.type == "default":
        raise ValueError(
            "config.json: Mistral 4's default rotation is not read: transformers computes it "
            "over all qk_head_dim channels, not the qk_rope_head_dim that turn, and cannot run it"
        )
    if rope.rotary_dim != latent.qk_rope_head_dim:
        raise ValueError(
            f"config.json: partial_rotary_factor rotates {rope.rotary_dim} of the "
            f"{latent.qk_head_dim} query and key channels, not qk_rope_head_dim "
            f"{latent.qk_rope_head_dim}"
        )
    return rope, local


def _latent_fields(latent: LatentAttention | None, hf: dict[str, Any]) -> dict[str, Any]:
    """The latent attention, and its scale: qk_head_dim ** -0.5, by DeepSeek's YaRN mscale
    squared."""
    if latent is None:
        return {}
    return {
        "latent_attention": latent,
        "attention_multiplier": latent.qk_head_dim**-0.5 * _yarn_mscale(hf) ** 2,
    }


def _deepseek_experts(model_type: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek-V2's and V3's experts (and those of the GLM models built like V3's, and of
    Mistral 4), as transformers reads them: the experts in the sparse layers, a shared expert
    of n_shared_experts experts' columns, V2's softmax over all experts (the top k of the best
    topk_group groups with group_limited_greedy), V3's sigmoid with its correction bias and
    Mistral 4's softmax (groups scored by their best two), the weights scaled by
    routed_scaling_factor, the router in float32 (Mistral 4's in the model's dtype)."""
    if model_type not in _DEEPSEEK_EXPERT_TYPES:
        return {}
    v2, mistral4 = model_type == "deepseek_v2", model_type == "mistral4"
    v3 = not (v2 or mistral4)  # the GLM models route as V3
    # Mistral 4's num_local_experts is its n_routed_experts (transformers' attribute_map),
    # and wins where a file has both.
    experts = count(hf, "num_local_experts" if "num_local_experts" in hf else "n_routed_experts")
    top_k = count(hf, "num_experts_per_tok")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(
            "config.json: moe_layer_freq other than 1 is not read (transformers' is 1)"
        )
    scoring, method = hf.get("scoring_func"), hf.get("topk_method")
    if scoring not in (None, "sigmoid" if v3 else "softmax") or (
        v2 and method not in ("greedy", "group_limited_greedy")
    ):
        raise ValueError(
            f"config.json: {model_type} routes by scoring_func {scoring!r} and topk_method "
            f"{method!r}, which Weir does not read (transformers reads neither)"
        )
    grouped = not v2 or method == "group_limited_greedy"
    groups = count(hf, "n_group") if grouped else 1
    kept = count(hf, "topk_group") if grouped else 1
    if experts % groups or kept > groups or top_k > kept * (experts // groups):
        raise ValueError(
            f"config.json: {experts} experts in n_group {groups} groups, topk_group {kept} kept, "
            f"cannot give num_experts_per_tok {top_k}"
        )
    if not v2 and experts // groups < 2:
        raise ValueError(
            f"config.json: {model_type}'s groups are scored by their best two experts, so "
            "each needs two"
        )
    if flag(hf, "mlp_bias"):
        raise ValueError("config.json: DeepSeek's MLPs with mlp_bias are not read")
    if v2 and flag(hf, "norm_topk_prob"):
        raise ValueError(
            "config.json: DeepSeek-V2 with norm_topk_prob is not read (transformers ignores it)"
        )
    inter = count(hf, "moe_intermediate_size")
    shared = hf.get("n_shared_experts") or 0
    if type(shared) is not int or shared < 0:
        raise ValueError(f"config.json: n_shared_experts must be a count, got {shared!r}")
    nextn = hf.get("num_nextn_predict_layers", 0) if v3 else 0
    if type(nextn) is not int or nextn < 0:
        raise ValueError(f"config.json: num_nextn_predict_layers must be a count, got {nextn!r}")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": not v2 and flag(hf, "norm_topk_prob"),
        "shared_expert_intermediate_size": shared * inter,
        "shared_expert_gated": False,
        "moe_layers": _sparse_layers(hf, num_layers),
        "routing": ExpertRouting(
            sigmoid=v3,
            num_groups=groups,
            kept_groups=kept,
            group_by_top2=not v2,
            score_bias=v3,
            scaling=positive(hf, "routed_scaling_factor", 1.0),
            float32=not mistral4,
        ),
        "num_nextn_predict_layers": nextn,
    }


def _sparse_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """DeepSeek's layers from first_k_dense_replace on (Solar Open's all); GLM-4.7-Flash's where mlp_layer_types
    says "sparse" (by default all but the first), as transformers reads each."""
    if hf["model_type"] == "solar_open":  # every layer's, whatever its file says
        return tuple(range(num_layers))
    if hf["model_type"] != "glm4_moe_lite":
        first = hf["first_k_dense_replace"]
        if type(first) is not int or first < 0:
            raise ValueError(
                f"config.json: first_k_dense_replace must be a layer number, got {first!r}"
            )
        return tuple(range(first, num_layers))
    kinds = hf.get("mlp_layer_types", ["dense"] + ["sparse"] * (num_layers - 1))
    if (
        not isinstance(kinds, list)
        or len(kinds) != num_layers
        or any(k not in ("dense", "sparse") for k in kinds)
    ):
        raise ValueError(
            f"config.json: mlp_layer_types must say dense or sparse for each of the "
            f"{num_layers} layers, got {kinds!r}"
        )
    return tuple(i for i, kind in enumerate(kinds) if kind == "sparse")


def _yarn_mscale(hf: dict[str, Any]) -> float:
    """DeepSeek's YaRN scales its attention's scores by this squared (mscale_all_dim's),
    as transformers' yarn_apply_mscale."""
    rope = {**mapping(hf, "rope_parameters"), **mapping(hf, "rope_scaling")}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return 1.0
    all_dim = rope.get("mscale_all_dim") or 0
    factor = positive(rope, "factor", 1.0)
    if not all_dim or factor <= 1:
        return 1.0
    return 0.1 * positive(rope, "mscale_all_dim", 1.0) * math.log(factor) + 1.0


def _classifier(hf: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's labels: as transformers counts them (its id2label's, else
    num_labels, else 2), or its ``classifier_from_token`` (below); none unless config.json's
    architecture is a ``*ForSequenceClassification``."""
    architectures = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return {}
    tokens = hf.get("classifier_from_token")
    if tokens is None:
        labels = hf.get("id2label")
        return {
            "num_labels": len(labels)
            if isinstance(labels, dict) and labels
            else count(hf, "num_labels", 2)
        }
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"config.json: classifier_from_token must be tokens, got {tokens!r}")
    method = hf.get("method")
    two_way = flag(hf, "is_original_qwen3_reranker") or method == "from_2_way_softmax"
    if method not in (None, "from_2_way_softmax", "no_post_processing") or (
        two_way and len(tokens) != 2
    ):
        raise ValueError(
            f"config.json: classifier_from_token {tokens} with method {method!r} is not read "
            "(Weir reads from_2_way_softmax of two tokens and no_post_processing)"
        )
    return {
        "num_labels": 1 if two_way else len(tokens),
        "classifier_from_token": tuple(tokens),
        "two_way_softmax": two_way,
    }


def read_model_config(
    model_dir: str | os.PathLike[str], overrides: str | None = None
) -> ModelConfig:
    """``model_dir/config.json``, checked, with ``overrides`` (vLLM's ``--hf-overrides``: a
    JSON object whose keys replace the file's) over it; ValueError names the file and the
    problem."""
    try:
        return ModelConfig.from_hf(read_hf_config(model_dir, overrides))
    except ValueError as exc:
        raise ValueError(f"{model_dir}: {exc}") from None


def check_drafts(cfg: ModelConfig) -> None:
    """ValueError where speculative decoding cannot serve the model: its linear-attention
    layers' state (Qwen 3.5's) cannot take back rejected drafts."""
    if cfg.linear_layers:
        raise ValueError(
            f"speculative decoding of a {cfg.model_type} model is not supported: its "
            "linear-attention layers' state cannot take back rejected drafts; serve it without "
            "--speculative-method"
        )


def check_new_weights(
    model_dir: str | os.PathLike[str], served: ModelConfig, overrides: str | None = None
) -> None:
    """ValueError unless ``model_dir`` holds safetensors weights for the ``served`` model: its
    config.json (``overrides`` over it) describes the same architecture (its weights may be
    quantized otherwise)."""
    config = read_model_config(model_dir, overrides)
    if dataclasses.replace(config, checkpoint_quantization=None) != dataclasses.replace(
        served, checkpoint_quantization=None
    ):
        raise ValueError(f"{model_dir}: config.json describes another model than the one served")
    if not any(Path(model_dir).glob("*.safetensors")):
        raise ValueError(f"{model_dir}: no *.safetensors weights")


def read_hf_config(model_dir: str | os.PathLike[str], overrides: str | None = None) -> Any:
    """``model_dir/config.json`` as JSON, ``overrides``' keys over it (a JSON object's text,
    ``--hf-overrides``), its quantization_config from the file older AutoGPTQ, AutoAWQ and
    ModelOpt checkpoints keep it in where it has none (`_QUANTIZATION_FILES`); ValueError
    names a file that is missing, unreadable or not JSON."""
    path = Path(model_dir) / "config.json"
    if "\x00" in str(path):  # open() would raise a ValueError, read below as the JSON's
        raise ValueError(f"{str(path)!r}: a path holds no NUL character")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    except OSError as exc:  # missing, unreadable, a directory
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if overrides is not None and isinstance(hf, dict):
        hf = {**hf, **json.loads(overrides)}
    if isinstance(hf, dict) and "quantization_config" not in hf:
        for name, method in _QUANTIZATION_FILES.items():
            if (Path(model_dir) / name).is_file():
                quantization = read_json(Path(model_dir) / name)
                hf = {**hf, "quantization_config": {"quant_method": method, **quantization}}
                break
    return hf


# The files older AutoGPTQ and AutoAWQ checkpoints and NVIDIA's ModelOpt ones keep their
# quantization in, beside a config.json without one, and the method each holds (as vLLM
# reads them).
_QUANTIZATION_FILES = {
    "quantize_config.json": "gptq",
    "quant_config.json": "awq",
    "hf_quant_config.json": "modelopt",
}


def eos_token_ids(
    model_dir: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str] | None = None
) -> tuple[int, ...]:
    """Every token that ends a sequence: ``eos_token_id`` of config.json and of
    generation_config.json, and the tokenizer's ``eos_token`` (tokenizer_config.json, its id
    from tokenizer.json), the tokenizer's read from ``tokenizer_dir`` where one is given
    (``--tokenizer``; vLLM's end token is its tokenizer's, and the model's generation config
    adds its own). The scheduler stops on these and the executor bans them before
    ``min_tokens``: both read them here, or a stop token could be sampled too early."""
    model_dir = Path(model_dir)
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        eos = read_json(model_dir / name).get("eos_token_id")
        found = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(type(t) is int for t in found):  # bool is an int subclass
            raise ValueError(f"{model_dir / name}: eos_token_id must be token ids, got {eos!r}")
        ids += found
    tokenizer_dir = model_dir if tokenizer_dir is None else Path(tokenizer_dir)
    token = read_json(tokenizer_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # a serialized AddedToken
        token = token.get("content")
    if isinstance(token, str) and (token_id := vocab_id(tokenizer_dir, token)) is not None:
        ids.append(token_id)
    return tuple(dict.fromkeys(ids))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when there is none; ValueError names a malformed one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{path}: not valid JSON ({exc}); repair or remove the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object; repair or remove the file")
    return data


def vocab_id(model_dir: Path, token: str) -> int | None:
    # What the tokenizers library's token_to_id answers, without importing it here: an
    # added token first, else the model's vocabulary.
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
        added = tokenizer.get("added_tokens", [])
        vocab = tokenizer.get("model", {}).get("vocab")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: cannot be read: {exc}") from None
    for entry in added:
        if entry.get("content") == token:
            return int(entry["id"])
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        return vocab.get(token)
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs in id order
        return next((i for i, (piece, _) in enumerate(vocab) if piece == token), None)
    return None
