"""One mixture-of-experts layer on the CPU: the grouped matmul against the experts packed
one by one (what `packed_weights.pack_model` makes of them), at several token counts.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/moe_layer.py [--model DIR] [--repeats 5]

DIR is a MoE model directory (default: `benchmarks/model_shape.py`'s `moe-small` shape, written to
a temporary directory); its weights are random (`--load-format dummy`), the layer's input
is random, so tokens spread over the experts as a trained router spreads them.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from weir.services.executor.packed_weights import pack_model
from weir.services.executor.weights import load_model


def _time(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512])
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp()) / "moe-small"
        script = Path(__file__).with_name("model_shape.py")
        subprocess.run([sys.executable, str(script), str(model_dir)], check=True)
    # Two copies of the model: one left with stacked experts (the grouped matmul), one packed.
    os.environ["WEIR_PACK_CPU_WEIGHTS"] = "0"
    grouped = load_model(model_dir, load_format="dummy")
    packed = load_model(model_dir, load_format="dummy")
    pack_model(packed)
    layer = next(i for i, layer in enumerate(grouped.layers) if layer.moe is not None)
    a, b = grouped.layers[layer].moe, packed.layers[layer].moe
    print(f"threads {torch.get_num_threads()}; layer {layer} of {model_dir}")
    print("| tokens | grouped matmul ms | packed experts ms | grouped ÷ packed |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, grouped.config.hidden_size)
            torch.testing.assert_close(a(x), b(x), atol=1e-3, rtol=1e-3)
            # alternate, twice each, so drift on a shared machine hits both
            times = [_time(f, x, args.repeats) for f in (a, b, a, b)]
            g, p = min(times[0], times[2]), min(times[1], times[3])
            print(f"| {tokens} | {g:.1f} | {p:.1f} | {g / p:.2f}× |")


if __name__ == "__main__":
    main()
