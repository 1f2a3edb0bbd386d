"""What reading a quantized checkpoint costs: `load_model` of the default model as it is
(float32 safetensors) against its FP8 (E4M3, a scale per 128 x 128 block, as Qwen's FP8
releases) and compressed-tensors W4A16 (4-bit, a scale per 64 columns) copies, each
dequantized as it loads. The copies are written once into DIR (compressed-tensors, a dev
dependency, writes the W4A16 one). Reported per checkpoint: its size on disk and the
median, min and max of the load times (ms).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/checkpoint_load.py [--dir /tmp/quantized]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weir.services.executor.weights import load_model
from weir.shared.model_store import resolve_model

BLOCK = 128


def fp8_copy(source: Path, out: Path) -> None:
    """Every projection E4M3 with a float32 scale per 128 x 128 block (the last blocks cut
    short where the shape is no multiple), quant_method fp8."""
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        weight = tensors[name].float()
        rows, columns = weight.shape
        grid = (-(-rows // BLOCK), -(-columns // BLOCK))
        padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
        padded[:rows, :columns] = weight
        tiles = padded.reshape(grid[0], BLOCK, grid[1], BLOCK)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        codes = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:rows, :columns]
        tensors[name] = codes.to(torch.float8_e4m3fn).contiguous()
        tensors[name + "_scale_inv"] = scale
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (out / "config.json").write_text(json.dumps(config))


def w4a16_copy(source: Path, out: Path) -> None:
    """compressed-tensors' W4A16 (4-bit, symmetric, a scale per 64 columns), written by the
    library from transformers' model of ``source``."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = 64
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            if is_module_quantized(module):
                groups = module.weight.reshape(module.weight.shape[0], -1, 64)
                scale, _ = calculate_qparams(
                    groups.amin(2), groups.amax(2), module.quantization_scheme.weights
                )
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def timed(model_dir: Path, repeats: int) -> list[float]:
    load_model(model_dir)  # warm: the files in the page cache, torch's first-call work done
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        load_model(model_dir)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/weir-quantized"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    source = Path(resolve_model(None))
    copies = {"float32 (as converted)": source}
    for name, write in (("fp8 blocks of 128", fp8_copy), ("w4a16 groups of 64", w4a16_copy)):
        out = args.dir / name.split()[0]
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            write(source, out)
        copies[name] = out
    print(f"{'checkpoint':<24} {'MB':>6} {'median ms':>10} {'min':>7} {'max':>7}")
    for name, path in copies.items():
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        times = timed(path, args.repeats)
        print(
            f"{name:<24} {size:>6.0f} {statistics.median(times):>10.0f} "
            f"{min(times):>7.0f} {max(times):>7.0f}"
        )


if __name__ == "__main__":
    main()
