"""How fast a quantized checkpoint's weights dequantize as they load, per format.

    .venv/bin/python benchmarks/dequantize.py [--rows 14336] [--columns 4096] [--repeats 3]

One projection of each format (Llama-3-8B's MLP shape by default) is written to a
safetensors file of random codes and scales, then read whole through
`quantized_checkpoint.dequantized_tensors`, as the loader reads every quantized weight; the
best of ``--repeats`` reads is printed per format, in ms and ns per weight. Formats a tree
does not read are skipped, so the same script times an older tree (PYTHONPATH).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weir.services.executor.dequantized_weight import DequantizedWeight
from weir.services.executor.quantized_checkpoint import dequantized_tensors
from weir.shared.checkpoint_quantization import read_checkpoint_quantization

GROUP = 128


def _words(*shape: int) -> torch.Tensor:
    """Random int32 words: any bits are valid packed codes."""
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32)


def _scales(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) + 0.5


def _formats(rows: int, columns: int) -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """Each format's quantization_config and tensors of one [rows, columns] weight "m"."""
    groups = columns // GROUP
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": GROUP}
    in_order = (torch.arange(columns) // GROUP).to(torch.int32)
    shuffled = in_order[torch.randperm(columns)]
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [rows, columns]}
    nf4_state = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    int4_group = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": GROUP}
    fp4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
    return {
        **{
            name: (
                gptq,
                {
                    "m.qweight": _words(columns // 8, rows),
                    "m.qzeros": _words(groups, rows // 8),
                    "m.scales": _scales(groups, rows).half(),
                    "m.g_idx": g_idx,
                },
            )
            for name, g_idx in (("gptq int4", in_order), ("gptq int4 desc_act", shuffled))
        },
        "awq int4": (
            {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"},
            {
                "m.qweight": _words(columns, rows // 8),
                "m.qzeros": _words(groups, rows // 8),
                "m.scales": _scales(groups, rows).half(),
            },
        ),
        "bitsandbytes nf4": (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            {
                "m.weight": torch.randint(0, 256, (rows * columns // 2, 1), dtype=torch.uint8),
                "m.weight.absmax": _scales(rows * columns // 64),
                "m.weight.quant_map": torch.linspace(-1, 1, 16),
                "m.weight.quant_state.bitsandbytes__nf4": nf4_state,
            },
        ),
        "fp8 128x128 blocks": (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            {
                "m.weight": torch.randn(rows, columns).to(torch.float8_e4m3fn),
                "m.weight_scale_inv": _scales(rows // 128, columns // 128),
            },
        ),
        "compressed-tensors w4a16": (
            _compressed_tensors("pack-quantized", int4_group),
            {
                "m.weight_packed": _words(rows, columns // 8),
                "m.weight_scale": _scales(rows, groups),
                "m.weight_shape": torch.tensor([rows, columns]),
            },
        ),
        "compressed-tensors nvfp4": (
            _compressed_tensors("nvfp4-pack-quantized", fp4),
            {
                "m.weight_packed": torch.randint(0, 256, (rows, columns // 2), dtype=torch.uint8),
                "m.weight_scale": _scales(rows, columns // 16).to(torch.float8_e4m3fn),
                "m.weight_global_scale": torch.tensor([400.0]),
            },
        ),
    }


def _compressed_tensors(fmt: str, weights: dict) -> dict:
    group = {"format": fmt, "targets": ["Linear"], "weights": weights}
    return {"quant_method": "compressed-tensors", "config_groups": {"g": group}, "format": fmt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--columns", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"one [{args.rows}, {args.columns}] weight, best of {args.repeats} reads")
    with tempfile.TemporaryDirectory() as directory:
        for name, (config, tensors) in _formats(args.rows, args.columns).items():
            try:
                quantization = read_checkpoint_quantization(
                    {"quantization_config": config}, "llama"
                )
            except ValueError:
                print(f"{name:>26}: not read by this tree")
                continue
            assert quantization is not None
            path = Path(directory) / f"{name.replace(' ', '-')}.safetensors"
            save_file(tensors, str(path))
            best = float("inf")
            for _ in range(args.repeats):
                with safe_open(str(path), framework="pt", device="cpu") as opened:
                    start = time.perf_counter()
                    for _, tensor in dequantized_tensors([opened], quantization):
                        if isinstance(tensor, DequantizedWeight):
                            tensor[(slice(None),)]
                    best = min(best, time.perf_counter() - start)
            per_weight = best / (args.rows * args.columns) * 1e9
            print(f"{name:>26}: {best * 1e3:8.1f} ms  {per_weight:5.2f} ns/weight")


if __name__ == "__main__":
    main()
