"""What an image costs before the language model reads it, at SmolVLM-256M-Instruct's shapes.

    .venv/bin/python benchmarks/image_inputs.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--repeats 5]

Stages, each the best of ``--repeats``, for a 1024 x 768 JPEG: the front end's (the scheduler
process's tokenizer thread) decoding of it and expansion of its ``<image>``
(``read_image`` + ``expand_image_tokens``), the executor's decoding and tiling of it
(``read_image`` + ``pixel_values``: SmolVLM's processor scales it to 2048 x 1536, 12 tiles of
512 and the global image), and its vision tower on those 13 tiles (random weights of the real
shapes: 12 layers of width 768 over 1024 patches a tile, 64 features of width 576 out).
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import torch
from PIL import Image

from weir.services.executor.vision import VisionTower
from weir.shared.images import (
    ImageProcessing,
    read_image,
)
from weir.shared.vision_config import VisionConfig

SMOLVLM_256M = {
    "model_type": "idefics3",
    "scale_factor": 4,
    "text_config": {"model_type": "llama", "hidden_size": 576},
    "vision_config": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 512,
        "patch_size": 16,
    },
}
PROCESSING = ImageProcessing(longest_edge=2048, tile_size=512, image_seq_len=64)


def _best(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    pixels = np.random.default_rng(0).integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
    data = encoded.getvalue()

    def expand() -> str:
        return PROCESSING.expand_image_tokens("<image>Describe it.", [read_image(data).size])

    tiles = PROCESSING.pixel_values(read_image(data))
    torch.manual_seed(0)
    tower = VisionTower(VisionConfig.from_hf(SMOLVLM_256M), dtype, device)
    for param in tower.parameters():
        param.data.normal_(0.0, 0.02)
    batch = torch.from_numpy(tiles).to(device, dtype)

    def encode() -> None:
        with torch.inference_mode():
            tower(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()

    encode()  # warm-up
    rows = [
        ("front end: decode + <image> expansion", _best(expand, args.repeats), 1),
        (
            f"executor: decode + {len(tiles)} tiles of 512",
            _best(lambda: PROCESSING.pixel_values(read_image(data)), args.repeats),
            1,
        ),
        (
            f"vision tower, {args.dtype}, {len(tiles)} tiles",
            _best(encode, args.repeats),
            len(tiles),
        ),
    ]
    print(f"one 1024 x 768 JPEG ({len(data)} bytes) -> {len(tiles) * 64} image tokens")
    for name, seconds, tiles_in in rows:
        per_tile = f"  ({seconds * 1e3 / tiles_in:.1f} ms a tile)" if tiles_in > 1 else ""
        print(f"  {name:<40} {seconds * 1e3:10.2f} ms{per_tile}")


if __name__ == "__main__":
    main()
