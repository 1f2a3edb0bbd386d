"""The images of InternVL's ``-hf`` checkpoints (transformers' model type ``internvl``: InternVL3,
InternVL3.5): the image processing of transformers' InternVLProcessor and the GotOcr2 image
processor it holds (its PIL backend) done here: the tiles an image is cut into, the text that
stands for it in the prompt, and its pixel values.

The processor picks, among the grids of ``min_patches`` to ``max_patches`` tiles, the one whose
shape (columns / rows) is nearest the image's aspect ratio, resizes the image to that grid of
tiles and cuts it row by row; where that makes more than one tile, the whole image resized to
one tile (the thumbnail) comes last. Every resize is Pillow's, with the config's filter, from
the 8-bit RGB image as given to 8-bit RGB, as transformers does it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from PIL import Image

from weir.shared.images import ConfigReader, processor_configs, to_rgb, value_table

# The processor reads these from its tokenizer (start_image_token, end_image_token,
# context_image_token): every -hf checkpoint's tokenizer_config.json names these, as
# transformers' converter writes them. Its chat template renders an image part as the context
# token (then a newline), which the processor expands.
START_IMAGE_TOKEN = "<img>"
END_IMAGE_TOKEN = "</img>"
CONTEXT_IMAGE_TOKEN = "<IMG_CONTEXT>"


@dataclass(slots=True, frozen=True)
class InternVLImageProcessing:
    """What a checkpoint's ``preprocessor_config.json`` and ``processor_config.json`` say of its
    images; the defaults are transformers' (the GotOcr2 image processor's, and
    InternVLProcessor's image_seq_length).

    ``crop_to_patches`` is not read: InternVLProcessor passes crop_to_patches=True to its image
    processor on every call, over the file's value and the image processor's default (false),
    so an image is cut wherever max_patches allows. Nor ``do_convert_rgb`` (``read_image``
    always makes RGB: the vision tower takes three channels)."""

    min_patches: int = 1
    max_patches: int = 12
    tile_height: int = 384  # size["height"]: a tile's, and the vision tower's, height
    tile_width: int = 384
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # CLIP's
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    image_seq_length: int = 256  # processor_config.json: the context tokens of each tile

    @classmethod
    def from_dicts(
        cls, preprocessor: dict[str, Any], processor: dict[str, Any] | None = None
    ) -> InternVLImageProcessing:
        """From the two files' JSON objects (``processor`` None where there is none). A key
        left out, or null, keeps the default (as in transformers); one of the wrong type is a
        ValueError naming the file and the key."""
        pre = ConfigReader("preprocessor_config.json", preprocessor)
        proc = ConfigReader("processor_config.json", processor or {})
        default = cls()
        max_patches = pre.count("max_patches", default.max_patches)
        # With max_patches 1 transformers resizes an image to one tile only where do_resize
        # says so: unresized, it would not be the tile the vision tower takes.
        if not pre.flag("do_resize", True) and max_patches < 2:
            raise ValueError(
                "preprocessor_config.json: do_resize false leaves an image of max_patches 1 at "
                "its own size; the vision tower takes tiles of size's"
            )
        tile_height, tile_width = pre.height_width(
            "size", (default.tile_height, default.tile_width)
        )
        return cls(
            min_patches=pre.count("min_patches", default.min_patches),
            max_patches=max_patches,
            tile_height=tile_height,
            tile_width=tile_width,
            resample=pre.resample("resample", default.resample),
            do_rescale=pre.flag("do_rescale", default.do_rescale),
            rescale_factor=pre.number("rescale_factor", default.rescale_factor),
            do_normalize=pre.flag("do_normalize", default.do_normalize),
            image_mean=pre.per_channel("image_mean", default.image_mean),
            image_std=pre.per_channel("image_std", default.image_std, positive=True),
            image_seq_length=proc.count("image_seq_length", default.image_seq_length),
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> InternVLImageProcessing | None:
        """A checkpoint directory's (its files as ``processor_configs`` finds them), or None
        where it has no image processor config."""
        preprocessor, processor = processor_configs(path)
        return None if preprocessor is None else cls.from_dicts(preprocessor, processor)

    @property
    def placeholder(self) -> str:
        """What a chat template renders for one image part, and ``expand_image_tokens``
        expands."""
        return CONTEXT_IMAGE_TOKEN

    def num_tiles(self, width: int, height: int) -> int:
        """The tiles of an image of that size: its grid's, and the thumbnail where the grid
        has more than one."""
        columns, rows = self._grid(width, height)
        return 1 if columns * rows == 1 else columns * rows + 1

    def num_image_tokens(self, width: int, height: int) -> int:
        """The context tokens of ``image_prompt`` (its start and end tokens not counted)."""
        return self.image_seq_length * self.num_tiles(width, height)

    def image_prompt(self, width: int, height: int) -> str:
        """The text that stands for an image of that size in a prompt, as the processor
        writes it: its start token, image_seq_length context tokens a tile, its end token."""
        context = CONTEXT_IMAGE_TOKEN * self.num_image_tokens(width, height)
        return f"{START_IMAGE_TOKEN}{context}{END_IMAGE_TOKEN}"

    def expand_image_tokens(self, text: str, sizes: list[tuple[int, int]]) -> str:
        """``text`` (a rendered prompt) with its n-th placeholder replaced by the prompt of the
        image of the n-th (width, height) in ``sizes``, as the processor's ``__call__`` does.
        ValueError where the counts differ."""
        parts = text.split(CONTEXT_IMAGE_TOKEN)
        if len(parts) - 1 != len(sizes):
            raise ValueError(
                f"the prompt has {len(parts) - 1} {CONTEXT_IMAGE_TOKEN} placeholders but "
                f"{len(sizes)} images were given"
            )
        prompts = [self.image_prompt(width, height) for width, height in sizes]
        return "".join(part + prompt for part, prompt in zip(parts, prompts)) + parts[-1]

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """The image's float32 ``[tiles, 3, tile_height, tile_width]`` (NumPy: the scheduler
        reads this module without torch): its grid's tiles row by row, then the thumbnail,
        equal to transformers' ``pixel_values`` for this one image. ``image`` is RGB as
        ``read_image`` makes it (another mode is converted as it converts)."""
        rgb = image if image.mode == "RGB" else to_rgb(image)
        columns, rows = self._grid(*rgb.size)
        height, width = self.tile_height, self.tile_width
        grid = np.asarray(rgb.resize((columns * width, rows * height), self.resample))
        # [rows, height, columns, width, 3] -> [rows * columns, height, width, 3]: row by row
        frames = grid.reshape(rows, height, columns, width, 3).swapaxes(1, 2)
        frames = frames.reshape(rows * columns, height, width, 3)
        if rows * columns > 1:
            thumbnail = np.asarray(rgb.resize((width, height), self.resample))
            frames = np.concatenate([frames, thumbnail[None]])
        values = value_table(
            self.rescale_factor if self.do_rescale else None,
            (self.image_mean, self.image_std) if self.do_normalize else None,
        )
        # [frames, height, width, channel] bytes -> [frames, channel, height, width] values
        return np.stack([values[c][frames[..., c]] for c in range(3)], axis=1)

    def _grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of the tiles an image of that size is resized to: transformers'
        ``get_optimal_tiled_canvas``, in its float arithmetic. The grid whose shape (columns /
        rows, whatever the tiles' own shape) is nearest the image's aspect ratio; a tie goes to
        the grid of more tiles while the image's area is over half of theirs. A tie is one in
        floats: 7:6, exactly between 1:1 and 4:3, is nearer 4:3 by a rounding, so a 700 x 600
        image is cut into 4 x 3 tiles where exact arithmetic leaves it whole. (1, 1) where
        max_patches is 1: transformers resizes an image it does not cut to one tile."""
        if self.max_patches < 2:
            return 1, 1
        aspect_ratio = width / height
        area = width * height
        best, best_diff = (1, 1), math.inf
        half_tile = 0.5 * self.tile_height * self.tile_width
        for grid in _grids(self.min_patches, self.max_patches):
            diff = abs(aspect_ratio - grid[0] / grid[1])
            if diff < best_diff:
                best, best_diff = grid, diff
            elif diff == best_diff and area > half_tile * grid[0] * grid[1]:
                best = grid
        return best


@cache
def _grids(min_patches: int, max_patches: int) -> tuple[tuple[int, int], ...]:
    """The grids (columns, rows) of ``min_patches`` to ``max_patches`` tiles in the order
    transformers tries them (which decides ties): fewest tiles first, then by columns and rows.
    none where min_patches is over max_patches (then every image is resized to one tile)."""
    grids = [
        (columns, rows)
        for columns in range(1, max_patches + 1)
        for rows in range(1, max_patches + 1)
        if min_patches <= columns * rows <= max_patches
    ]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))
