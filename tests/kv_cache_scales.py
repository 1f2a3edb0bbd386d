"""A served model's checkpoint with an fp8 KV cache's scales, as llm-compressor saves a
KV-cache-only recipe: compressed-tensors' config with a ``kv_cache_scheme`` and no weight
groups, the model's weights as they are, each layer's ``k_scale`` and ``v_scale`` in a file of
their own."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_with_kv_scales(
    model_dir: Path, path: Path, scales: dict[str, torch.Tensor], strategy: str = "tensor"
) -> None:
    """``model_dir`` (a config.json and one model.safetensors) linked into ``path`` with
    ``scales`` ({checkpoint name: tensor}) beside its weights, by ``strategy``."""
    path.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (path / f.name).symlink_to(f.resolve())
    # Without a model.safetensors every *.safetensors file of the directory is read.
    (path / "weights.safetensors").symlink_to((model_dir / "model.safetensors").resolve())
    save_file(scales, path / "kv_scales.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "kv_cache_scheme": {
            "type": "float",
            "num_bits": 8,
            "strategy": strategy,
            "dynamic": False,
            "symmetric": True,
        },
    }
    (path / "config.json").write_text(json.dumps(config))
