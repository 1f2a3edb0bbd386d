"""How a model that reads images has them read, by its vision tower's kind: Idefics3's and
SmolVLM's processing (``images.py``) or InternVL's (``internvl_images.py``). The front end
expands a prompt's images with it, and the executors cut them into tiles with it."""

from __future__ import annotations

import os

from weir.shared.images import ImageProcessing
from weir.shared.internvl_images import InternVLImageProcessing
from weir.shared.internvl_vision_config import InternVLVisionConfig
from weir.shared.vision_config import VisionConfig

ImageProcessor = ImageProcessing | InternVLImageProcessing


def image_processor(
    model_dir: str | os.PathLike[str], vision: VisionConfig | InternVLVisionConfig
) -> ImageProcessor:
    """The processor files of ``model_dir``, else the defaults of its kind at its vision
    tower's tile (Idefics3's: four tiles along an image's longer side). One whose tiles are
    not the tower's is refused: its prompts would hold other counts of image tokens than the
    tower makes features."""
    tile, tokens = vision.image_size, vision.tokens_per_tile
    processor: ImageProcessor | None
    if isinstance(vision, InternVLVisionConfig):
        processor = InternVLImageProcessing.from_model_dir(model_dir)
        if processor is None:
            return InternVLImageProcessing(
                tile_height=tile, tile_width=tile, image_seq_length=tokens
            )
        cut = (processor.tile_height, processor.tile_width, processor.image_seq_length)
    else:
        processor = ImageProcessing.from_model_dir(model_dir)
        if processor is None:
            return ImageProcessing(longest_edge=4 * tile, tile_size=tile, image_seq_len=tokens)
        cut = (processor.tile_size, processor.tile_size, processor.image_seq_len)
    if cut != (tile, tile, tokens):
        raise ValueError(
            f"{model_dir}: the processor cuts tiles of {cut[1]}x{cut[0]} pixels into {cut[2]} "
            f"image tokens, but the vision tower (config.json) takes tiles of {tile}x{tile} and "
            f"makes {tokens} features of each"
        )
    return processor
