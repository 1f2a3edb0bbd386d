"""Write a model directory of a given shape, for `--load-format dummy`.

    python benchmarks/model_shape.py DIR [--shape moe-small|qwen3-30b-a3b|gemma3-270m|gemma3-1b|phi4-mini|gpt-oss-small|gpt-oss-20b|deepseek-small|deepseek-v2-lite]

The directory holds a `config.json` and the default model's tokenizer, no weights:
`weir bench throughput --model DIR --load-format dummy --baseline hf-static,hf-cb` then
measures Weir and transformers on random weights of that shape.
- `moe-small`: a Qwen3-MoE (8 layers, hidden 1024, 32 experts of 512 columns, 4 a token:
  ~0.5 B parameters, ~90 M active) that fits a CPU; `qwen3-30b-a3b` is that model's shape
  (48 layers, 128 experts, 8 a token), for a GPU.
- `gemma3-270m`, `gemma3-1b`: Gemma 3's shapes (local layers with a 512-token window, one
  global layer in six) with the default model's vocabulary; `--no-window` makes every
  layer global, to measure what the window saves.
- `phi4-mini`: Phi-4-mini's shape (3.8 B parameters with this vocabulary), LongRoPE and its
  partial rotation, for a GPU.
- `gpt-oss-20b`: gpt-oss-20b's shape (24 layers of 32 experts, 4 a token; windows of 128
  on every other layer, attention sinks, YaRN; ~20 B parameters), in bfloat16 for a GPU;
  `gpt-oss-small` that architecture at `moe-small`'s size (8 layers, hidden 1024, 32 experts
  of 512 columns, 4 a token), for a CPU.
- `deepseek-v2-lite`: DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads of latent
  attention, 64 experts of 1408 columns, 6 a token, 2 shared; ~16 B parameters), for a GPU;
  `deepseek-small` that architecture at `moe-small`'s size (8 layers, hidden 1024, 32
  experts of 512 columns, 4 a token), for a CPU.
"""

import argparse
import json
import shutil
from pathlib import Path

from weir.shared.model_store import resolve_model

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
}
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
}
# DeepSeek-V2-Lite's architecture: latent attention (a 512-channel latent and 64 rotated
# channels cached a token, the query projected directly), YaRN with DeepSeek's mscale, a dense
# first layer, two shared experts beside the routed ones.
DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "topk_method": "greedy",
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "tie_word_embeddings": False,
}
SHAPES = {
    "moe-small": dict(
        QWEN3_MOE,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        tie_word_embeddings=True,
    ),
    "qwen3-30b-a3b": dict(
        QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    ),
    "gemma3-270m": dict(
        GEMMA3,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
    ),
    "gemma3-1b": dict(
        GEMMA3,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
    ),
    # Phi-4-mini's shape: LongRoPE from 4096 positions, three quarters of each head rotating
    # (its factors here are made up: they change no cost).
    "phi4-mini": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.02 * i for i in range(48)],
            "long_factor": [1.0 + 0.5 * i for i in range(48)],
        },
        "tie_word_embeddings": True,
    },
    "gpt-oss-20b": dict(
        GPT_OSS,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        layer_types=["sliding_attention", "full_attention"] * 12,
    ),
    "deepseek-v2-lite": dict(
        DEEPSEEK_V2,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        n_routed_experts=64,
        num_experts_per_tok=6,
    ),
    "deepseek-small": dict(
        DEEPSEEK_V2,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        n_routed_experts=32,
        num_experts_per_tok=4,
    ),
    "gpt-oss-small": dict(
        GPT_OSS,
        hidden_size=1024,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        layer_types=["sliding_attention", "full_attention"] * 4,
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="moe-small")
    parser.add_argument("--no-window", action="store_true", help="no sliding window anywhere")
    args = parser.parse_args()
    tokenizer_dir = resolve_model(None)
    eos = json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"]
    config = {
        **SHAPES[args.shape],
        "vocab_size": 49152,  # the default model's tokenizer
        "eos_token_id": eos,
    }
    if args.no_window:
        config["sliding_window"] = None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, args.out / name)
    print(args.out)


if __name__ == "__main__":
    main()
