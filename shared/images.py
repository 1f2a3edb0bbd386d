"""The images of SmolVLM and Idefics3 (transformers' model types ``idefics3`` and ``smolvlm``):
a request's encoded image read into RGB, and the image processing of transformers' Idefics3 /
SmolVLM processors (their PIL backend) done here: the tiles an image splits into, the text that
stands for it in the prompt, and its pixel values.

The processor upscales or downscales every image so that its longest edge is ``size``'s
``longest_edge`` (both sides rounded as transformers rounds them, the short one up to even),
resizes that to whole tiles of ``max_image_size``'s ``longest_edge``, cuts it into those tiles
row by row and adds the whole image resized to one tile (the "global" image). Every resize is
Pillow's, with the config's filter, from 8-bit RGB to 8-bit RGB, as transformers does it.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

import numpy as np
from PIL import ExifTags, Image, ImageFile

# Pillow's warning threshold (Image.MAX_IMAGE_PIXELS, 89.5 M) is above this, so Pillow never
# warns about an image accepted here. 64 Mi pixels holds a 64 MP phone photo; decoded, it is
# 192 MiB of RGB.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024

# Decoded in-process by Pillow's own plugins; EPS (which runs Ghostscript) and the rarer formats
# are refused.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_FORMAT_NAMES = f"{', '.join(_FORMATS[:-1])} or {_FORMATS[-1]}"

# What Pillow raises on data it cannot decode (struct.error: some plugins' short reads).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)

# EXIF orientation -> the transpose that makes the picture upright (Pillow's exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_QUARTER_TURNS = {
    Image.Transpose.TRANSPOSE,
    Image.Transpose.ROTATE_270,
    Image.Transpose.TRANSVERSE,
    Image.Transpose.ROTATE_90,
}

# transformers' MAX_IMAGE_SIZE: the longest edge after the first resize, whatever ``size`` says.
_MAX_EDGE = 4096

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


def read_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """An encoded image (PNG, JPEG, WebP, GIF's first frame, BMP, TIFF) as an RGB image, upright
    by its EXIF orientation as transformers' ``load_image`` turns it (a PNG's where its EXIF
    chunk comes before its pixels, as its header), and in RGB as its
    processors' ``convert_to_rgb`` makes it: a transparent image (an alpha band, or a palette's
    or a PNG's transparent colour) composited onto white, any other mode converted by Pillow.

    ValueError (for the client): not such an image, corrupt or truncated, or over
    ``max_pixels`` by its header, refused before a pixel is decoded. Pillow refuses a header of
    zero width or height as not an image."""
    image, upright = _open(data, max_pixels)
    with image:
        try:
            rgb = to_rgb(image)
        except _DECODE_ERRORS as exc:
            raise ValueError(f"the image data is corrupt: {exc}") from None
    return rgb if upright is None else rgb.transpose(upright)


def image_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of the image ``read_image`` makes of ``data``, read from its header
    alone (its EXIF orientation included); ``read_image``'s refusals but for corrupt pixel
    data, which only decoding finds."""
    image, upright = _open(data, max_pixels)
    with image:
        width, height = image.size
    return (height, width) if upright in _QUARTER_TURNS else (width, height)


def _open(data: bytes, max_pixels: int) -> tuple[ImageFile.ImageFile, Image.Transpose | None]:
    """The image with its header parsed (nothing decoded yet) and its size checked, and the
    transpose that makes it upright."""
    try:
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
        upright = _upright(image)
    except Image.DecompressionBombError:
        # Pillow's own limit, met before ours only where max_pixels is above it
        raise ValueError(f"the image has more than {max_pixels} pixels") from None
    except _DECODE_ERRORS:
        raise ValueError(f"the data is not a {_FORMAT_NAMES} image") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ValueError(
            f"the image is {width}x{height}, {width * height} pixels: over the limit of "
            f"{max_pixels}"
        )
    return image, upright


def _upright(image: Image.Image) -> Image.Transpose | None:
    """The transpose of the image's EXIF orientation, as far as its header holds it.
    Image.getexif, not PngImageFile's: that one decodes the whole image to look for an EXIF
    chunk after the pixels. image_size and read_image both read the orientation here, so that
    they agree on the size."""
    orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation)
    return _UPRIGHT.get(orientation) if isinstance(orientation, int) else None


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb``: transparency composited onto opaque white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(slots=True, frozen=True)
class ImageProcessing:
    """What a checkpoint's ``preprocessor_config.json`` and ``processor_config.json`` say of its
    images; the defaults are transformers' Idefics3 / SmolVLM image processor's and
    processor's (the two are the same). Its ``do_convert_rgb`` is not read (``read_image``
    always makes RGB: the vision tower takes three channels) nor its ``do_pad`` (one image's
    tiles all have the tile's size)."""

    do_resize: bool = True
    longest_edge: int = 4 * 364  # size["longest_edge"]: the first resize's longest edge
    do_image_splitting: bool = True
    tile_size: int = 364  # max_image_size["longest_edge"]: a tile's (and the vision tower's) side
    resample: Image.Resampling = Image.Resampling.LANCZOS
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_seq_len: int = 169  # processor_config.json: the <image> tokens of each tile
    placeholder: ClassVar[str] = IMAGE_TOKEN  # what a template writes for an image part

    @classmethod
    def from_dicts(
        cls, preprocessor: dict[str, Any], processor: dict[str, Any] | None = None
    ) -> ImageProcessing:
        """From the two files' JSON objects (``processor`` None where there is none). A key
        left out, or null, keeps the default (as in transformers); one of the wrong type is a
        ValueError naming the file and the key."""
        pre = ConfigReader("preprocessor_config.json", preprocessor)
        proc = ConfigReader("processor_config.json", processor or {})
        default = cls()
        return cls(
            do_resize=pre.flag("do_resize", default.do_resize),
            longest_edge=pre.edge("size", default.longest_edge),
            do_image_splitting=pre.flag("do_image_splitting", default.do_image_splitting),
            tile_size=pre.edge("max_image_size", default.tile_size),
            resample=pre.resample("resample", default.resample),
            do_rescale=pre.flag("do_rescale", default.do_rescale),
            rescale_factor=pre.number("rescale_factor", default.rescale_factor),
            do_normalize=pre.flag("do_normalize", default.do_normalize),
            image_mean=pre.per_channel("image_mean", default.image_mean),
            image_std=pre.per_channel("image_std", default.image_std, positive=True),
            image_seq_len=proc.count("image_seq_len", default.image_seq_len),
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str]) -> ImageProcessing | None:
        """A checkpoint directory's (its files as ``processor_configs`` finds them), or None
        where it has no image processor config."""
        preprocessor, processor = processor_configs(path)
        return None if preprocessor is None else cls.from_dicts(preprocessor, processor)

    def num_image_tokens(self, width: int, height: int) -> int:
        """The image tokens an image of that size takes: image_seq_len a tile, and the
        global image's."""
        rows, cols = self.tile_grid(width, height)
        return (rows * cols + 1) * self.image_seq_len

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of the tiles an image of that size is cut into; (0, 0) where it is
        not cut (image splitting off, or the image no larger than one tile after the resizes), as
        transformers reports it. Then the image is its global image alone."""
        if not self.do_image_splitting:
            return 0, 0
        width, height = _tiled_size(self, *_resized_size(self, width, height))
        tile = self.tile_size
        if width <= tile and height <= tile:
            return 0, 0
        return height // tile, width // tile

    def image_prompt(self, rows: int, cols: int) -> str:
        """The text that stands for an image of ``rows`` x ``cols`` tiles (``tile_grid``'s) in a
        prompt: transformers' ``get_image_prompt_string`` (SmolVLM's; Idefics3's processor writes
        the same text, and SmolVLM's tokens, read from its tokenizer, are these in its checkpoints).
        Each tile is ``<fake_token_around_image><row_r_col_c>`` and image_seq_len ``<image>``, a
        row ends in a newline, and the global image, after one more, is wrapped in
        ``<fake_token_around_image>``s and tagged ``<global-img>``."""
        image = IMAGE_TOKEN * self.image_seq_len
        global_image = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{image}{FAKE_IMAGE_TOKEN}"
        if rows == 0 and cols == 0:
            return global_image
        tiles = "".join(
            "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
            + "\n"
            for r in range(rows)
        )
        return f"{tiles}\n{global_image}"

    def expand_image_tokens(self, text: str, sizes: list[tuple[int, int]]) -> str:
        """``text`` (a rendered prompt) with its n-th ``<image>`` replaced by the prompt of the
        image of the n-th (width, height) in ``sizes``, as the processors' ``__call__`` does.
        ValueError where the counts differ."""
        parts = text.split(IMAGE_TOKEN)
        if len(parts) - 1 != len(sizes):
            raise ValueError(
                f"the prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders but {len(sizes)} "
                "images were given"
            )
        prompts = [self.image_prompt(*self.tile_grid(w, h)) for w, h in sizes]
        return "".join(part + prompt for part, prompt in zip(parts, prompts)) + parts[-1]

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """The image's float32 ``[tiles, 3, tile_size, tile_size]`` (NumPy: the scheduler reads
        this module without torch): its ``tile_grid`` tiles row by
        row, then its global image (the global image alone where it is not cut), equal to
        transformers' ``pixel_values`` for this one image. transformers' ``pixel_attention_mask``
        of one image is all ones (every tile, and the global image, is a whole tile: only a batch's
        shorter images are padded, with whole empty tiles), so there is none here. ``image`` is
        RGB as ``read_image`` makes it (another mode is converted as it converts)."""
        rgb = to_rgb(image) if image.mode != "RGB" else image
        resized = _resize(self, rgb, _resized_size(self, *rgb.size))
        if self.do_image_splitting:
            tiled = _resize(self, resized, _tiled_size(self, *resized.size))
            frames = _tiles(self, tiled)
        else:
            tile = self.tile_size
            frames = np.asarray(_resize(self, resized, (tile, tile)))[None]
        values = value_table(
            self.rescale_factor if self.do_rescale else None,
            (self.image_mean, self.image_std) if self.do_normalize else None,
        )
        # [frames, height, width, channel] bytes -> [frames, channel, height, width] values
        return np.stack([values[c][frames[..., c]] for c in range(3)], axis=1)


def processor_configs(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A checkpoint directory's image processor config and its processor_config.json (each
    None where there is none). As in transformers, an ``image_processor`` object inside
    ``processor_config.json`` (how transformers 5 saves a processor) comes before
    ``preprocessor_config.json``."""
    directory = Path(path)
    processor = _read_json(directory / "processor_config.json")
    preprocessor = (processor or {}).get("image_processor")
    if not isinstance(preprocessor, dict):
        preprocessor = _read_json(directory / "preprocessor_config.json")
    return preprocessor, processor


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class ConfigReader:
    """Typed reads of one config file's keys; each ValueError names the file and the key."""

    name: str
    config: dict[str, Any]

    def _get(self, key: str) -> Any:
        return self.config.get(key)

    def _refuse(self, key: str, what: str) -> ValueError:
        return ValueError(f"{self.name}: {key} must be {what}, got {self._get(key)!r}")

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._refuse(key, "true or false")
        return value

    def count(self, key: str, default: int) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._refuse(key, "a positive integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._get(key)
        if value is None:
            return default
        if not _is_number(value) or not value > 0:
            raise self._refuse(key, "a positive number")
        return float(value)

    def edge(self, key: str, default: int) -> int:
        value = self._get(key)
        if value is None:
            return default
        edge = value.get("longest_edge") if isinstance(value, dict) else None
        if isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
            raise self._refuse(key, 'an object {"longest_edge": a positive integer}')
        return edge

    def height_width(self, key: str, default: tuple[int, int]) -> tuple[int, int]:
        value = self._get(key)
        if value is None:
            return default
        sides = value if isinstance(value, dict) else {}
        height, width = sides.get("height"), sides.get("width")
        if _is_count(height) and _is_count(width):
            return height, width
        raise self._refuse(
            key, 'an object {"height": a positive integer, "width": a positive integer}'
        )

    def resample(self, key: str, default: Image.Resampling) -> Image.Resampling:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or value not in {int(r) for r in Image.Resampling}:
            raise self._refuse(key, "one of PIL's resampling filters, 0 to 5")
        return Image.Resampling(value)

    def per_channel(
        self, key: str, default: tuple[float, float, float], positive: bool = False
    ) -> tuple[float, float, float]:
        """One number for the three channels, or a list of three."""
        value = self._get(key)
        if value is None:
            return default
        values = [value] * 3 if _is_number(value) else value
        if not isinstance(values, list) or len(values) != 3 or not all(map(_is_number, values)):
            raise self._refuse(key, "a number or a list of three")
        if positive and not all(v > 0 for v in values):
            raise self._refuse(key, "positive")
        return (float(values[0]), float(values[1]), float(values[2]))


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _resized_size(processing: ImageProcessing, width: int, height: int) -> tuple[int, int]:
    """(width, height) after the first resize: the longest edge to size's, the other by the
    aspect ratio, truncated then rounded up to even, all in transformers' float arithmetic
    (its rounding differs from the exact ratio's by a pixel or two on some sizes); then capped
    to 4096 without the even rounding."""
    if not processing.do_resize:
        return width, height
    aspect_ratio = width / height
    if width >= height:
        width = processing.longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = processing.longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    aspect_ratio = width / height
    if width >= height and width > _MAX_EDGE:
        width, height = _MAX_EDGE, int(_MAX_EDGE / aspect_ratio)
    elif height > width and height > _MAX_EDGE:
        width, height = int(_MAX_EDGE * aspect_ratio), _MAX_EDGE
    return max(width, 1), max(height, 1)


def _tiled_size(processing: ImageProcessing, width: int, height: int) -> tuple[int, int]:
    """(width, height) of the second resize, to whole tiles: the longest edge up to a multiple
    of the tile, the other edge by the aspect ratio, truncated, then up to a multiple too."""
    tile = processing.tile_size
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return width, height


def _resize(processing: ImageProcessing, image: Image.Image, size: tuple[int, int]) -> Image.Image:
    return image.resize(size, resample=processing.resample)


def _tiles(processing: ImageProcessing, image: Image.Image) -> np.ndarray:
    """[frames, tile, tile, 3] bytes: the tiles row by row, then the global image (the image
    itself where it is one tile)."""
    tile = processing.tile_size
    width, height = image.size
    if width <= tile and height <= tile:
        return np.asarray(image)[None]
    pixels = np.asarray(image)
    tiles = [
        pixels[top : top + tile, left : left + tile]
        for top in range(0, height, tile)
        for left in range(0, width, tile)
    ]
    tiles.append(np.asarray(_resize(processing, image, (tile, tile))))
    return np.stack(tiles)


def value_table(
    rescale_factor: float | None,
    mean_std: tuple[tuple[float, float, float], tuple[float, float, float]] | None,
) -> np.ndarray:
    """[3, 256] float32: each channel's value of each byte, in transformers' arithmetic (rescale
    by ``rescale_factor`` in float64 then to float32, normalize by ``mean_std`` in float32;
    None where the config leaves that step out), so that a lookup gives its values bit for
    bit, without an image-sized float64 copy."""
    values = np.tile(np.arange(256, dtype=np.float64), (3, 1))
    if rescale_factor is not None:
        values = values * rescale_factor
    values = values.astype(np.float32)
    if mean_std is not None:
        mean = np.array(mean_std[0], dtype=np.float32)[:, None]
        std = np.array(mean_std[1], dtype=np.float32)[:, None]
        values = (values - mean) / std
    return values
