"""Write a model directory of a mixture-of-experts shape, for `--load-format dummy`.

    python benchmarks/moe_shape.py /tmp/moe-small [--shape small|qwen3-30b-a3b]

The directory holds a Qwen3-MoE `config.json` and the default model's tokenizer, no weights:
`weir bench throughput --model DIR --load-format dummy --baseline hf-static,hf-cb` then
measures Weir and transformers on random weights of that shape. `small` (8 layers, hidden
1024, 32 experts of 512 columns, 4 a token: ~0.5 B parameters, ~90 M active) fits a CPU;
`qwen3-30b-a3b` is that model's shape (48 layers, 128 experts, 8 a token), for a GPU.
"""

import argparse
import json
import shutil
from pathlib import Path

from weir.shared.model_store import resolve_model

SHAPES = {
    "small": dict(
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
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = parser.parse_args()
    tokenizer_dir = resolve_model(None)
    eos = json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"]
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 49152,  # the default model's tokenizer
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "eos_token_id": eos,
        **SHAPES[args.shape],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, args.out / name)
    print(args.out)


if __name__ == "__main__":
    main()
