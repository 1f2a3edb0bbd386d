"""weir.shared.images against transformers' Idefics3 / SmolVLM processors (the PIL backend, the
one transformers picks without torchvision), on the configs SmolVLM's checkpoints ship: the
tiles of generated images (noise over gradients, encoded as PNG and JPEG, each side decoding the
same bytes: transformers is given Pillow's image as Image.open returns it), their pixel values
bit for bit, the text that stands for them, and the refusals of bad images and configs."""

import base64
import io
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from image_models import png_header
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from weir.shared.images import (
    ImageProcessing,
    image_size,
    read_image,
)

# HuggingFaceTB/SmolVLM-256M-Instruct's preprocessor_config.json (model type idefics3) ...
SMOLVLM = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 2048},
}
# ... and SmolVLM2-256M-Video-Instruct's (model type smolvlm); both with image_seq_len 64.
SMOLVLM2 = {
    **SMOLVLM,
    "image_processor_type": "SmolVLMImageProcessor",
    "processor_class": "SmolVLMProcessor",
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}},
}
PROCESSOR = {"image_seq_len": 64, "processor_class": "Idefics3Processor"}
# Image splitting off: every image squashed to one 512 x 512 tile.
UNSPLIT = {**SMOLVLM2, "do_image_splitting": False}
# No first resize (the image's own size goes to the tiles), another filter, CLIP's per-channel
# mean and std (a channel mixed up shows).
UNRESIZED = {
    **SMOLVLM,
    "do_resize": False,
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# A longest edge over transformers' cap of 4096 (capped after its even rounding), tiles that do
# not divide it, nearest-neighbour, and the byte values themselves (no rescale, no normalize).
OVERSIZED = {
    **SMOLVLM,
    "size": {"longest_edge": 5000},
    "max_image_size": {"longest_edge": 1024},
    "resample": 0,
    "do_rescale": False,
    "do_normalize": False,
}
CONFIGS = {"smolvlm": SMOLVLM, "smolvlm2": SMOLVLM2, "unsplit": UNSPLIT}
CONFIGS |= {"unresized": UNRESIZED, "oversized": OVERSIZED}


@cache
def reference(config: str) -> Idefics3ImageProcessorPil | SmolVLMImageProcessorPil:
    preprocessor = CONFIGS[config]
    if preprocessor["image_processor_type"] == "SmolVLMImageProcessor":
        return SmolVLMImageProcessorPil.from_dict(preprocessor)
    return Idefics3ImageProcessorPil.from_dict(preprocessor)


def processing(config: str) -> ImageProcessing:
    return ImageProcessing.from_dicts(CONFIGS[config], PROCESSOR)


def picture(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """Noise over a gradient, for Lanczos' overshoot and clipping, in ``mode``; RGBA's alpha
    goes from opaque to clear and back."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 150, height), np.linspace(0, 100, width))
    noise = rng.integers(0, 106, (height, width, 4))
    pixels = (ramp[..., None] + noise).astype(np.uint8)
    pixels[..., 3] = np.abs(np.linspace(-255, 255, width)).astype(np.uint8)[None, :]
    image = Image.fromarray(pixels, "RGBA")
    if mode == "P":
        # a palette with a transparent entry, as a GIF or an 8-bit PNG has
        image = image.convert("RGB").quantize(64)
        image.info["transparency"] = 0
        return image
    return image if mode == "RGBA" else image.convert(mode)


def encoded(image: Image.Image, format: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format)
    return out.getvalue()


def processed(config: str, image: Image.Image) -> dict[str, Any]:
    return dict(reference(config)(image, return_row_col_info=True, return_tensors="pt"))


# (config, width, height, mode, format)
CASES = [
    pytest.param("smolvlm", 1, 1, "RGB", "PNG", id="1x1-upscaled-to-4x4-tiles"),
    pytest.param("smolvlm2", 7, 300, "L", "PNG", id="7x300-greyscale"),
    pytest.param("smolvlm", 640, 480, "RGBA", "PNG", id="640x480-rgba"),
    # 2048 * 129 / 515 = 512.99: truncated to 512, one column (rounded, 514 and two)
    pytest.param("smolvlm2", 129, 515, "P", "PNG", id="129x515-rounding-palette"),
    # 2048 / (2048 / 93) is 92.99... in floats: 92 rows where the exact ratio gives 94
    pytest.param("smolvlm", 2048, 93, "RGB", "PNG", id="2048x93-float-rounding"),
    pytest.param("smolvlm", 3000, 1000, "RGB", "JPEG", id="3000x1000-downscaled"),
    pytest.param("unsplit", 640, 480, "RGB", "JPEG", id="unsplit"),
    pytest.param("unresized", 512, 512, "RGB", "PNG", id="unresized-512-one-tile"),
    # 1024 / (700 / 500) = 731 rows: two, where the image's own 500 would make one
    pytest.param("unresized", 700, 500, "RGB", "JPEG", id="unresized-700x500"),
    pytest.param("oversized", 3, 1, "RGB", "PNG", id="oversized-edge-capped"),
]


@pytest.mark.parametrize(("config", "width", "height", "mode", "format"), CASES)
def test_as_transformers(config: str, width: int, height: int, mode: str, format: str) -> None:
    data = encoded(picture(width, height, mode), format)
    expected = processed(config, Image.open(io.BytesIO(data)))
    p = processing(config)

    assert image_size(data) == (width, height)
    rows, cols = p.tile_grid(width, height)
    assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0])
    values = p.pixel_values(read_image(data))
    assert values.shape[0] == (rows * cols + 1 if rows else 1)
    # Bit for bit: the same Pillow resizes of the same bytes, and the same float arithmetic.
    # (No rescale and no normalize leave transformers' bytes as they are: compared as floats.)
    torch.testing.assert_close(
        torch.from_numpy(values), expected["pixel_values"][0].float(), atol=0, rtol=0
    )
    # so no mask here: one image's is all ones
    assert bool(expected["pixel_attention_mask"].all())


def test_sizes_only() -> None:
    """tile_grid needs no image: where a config's rounding decides the grid, equal to the rows
    and columns transformers reports for an image of that size (all one colour: only the sizes
    matter)."""
    p = processing("smolvlm")
    for width, height in [(4000, 1001), (1001, 4000), (2048, 1537), (512, 2048), (5, 4)]:
        expected = processed("smolvlm", Image.new("RGB", (width, height), (10, 200, 30)))
        assert p.tile_grid(width, height) == (expected["rows"][0][0], expected["cols"][0][0])


def test_modes_as_transformers() -> None:
    """read_image makes RGB as transformers' convert_to_rgb does: transparency (an alpha band,
    a palette's transparent entry) composited onto white; and a GIF's first frame."""
    for mode in ["RGBA", "LA", "P", "L", "1", "CMYK"]:
        data = encoded(picture(9, 5, mode), "TIFF" if mode == "CMYK" else "PNG")
        expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
        np.testing.assert_array_equal(np.asarray(read_image(data)), expected, err_msg=mode)
    frames = [picture(9, 5, "P", seed) for seed in (1, 2)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    expected = convert_to_rgb(Image.open(io.BytesIO(gif.getvalue())), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(read_image(gif.getvalue())), expected)


def test_exif_orientation() -> None:
    """A photo whose EXIF says 'turn a quarter' is read upright, as transformers' load_image
    reads its base64, and image_size says so from the header."""
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    picture(40, 20, "RGB").save(out, "JPEG", exif=exif)
    data = out.getvalue()
    assert image_size(data) == (20, 40)
    expected = load_image(base64.b64encode(data).decode())
    assert expected.size == (20, 40)
    np.testing.assert_array_equal(np.asarray(read_image(data)), np.asarray(expected))


def test_prompt_as_transformers() -> None:
    """The text of an image is SmolVLM's get_image_prompt_string; a prompt's <image>s are
    expanded as Idefics3's processor expands them."""
    p = processing("smolvlm")
    for rows, cols in [(0, 0), (1, 2), (4, 4)]:
        assert p.image_prompt(rows, cols) == get_image_prompt_string(
            rows, cols, 64, "<fake_token_around_image>", "<image>", "<global-img>"
        )

    vocab = {"[UNK]": 0, "a": 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    processor = Idefics3Processor(
        reference("unresized"),
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]"),
        image_seq_len=64,
    )
    text = "User:<image>What differs from<image> here?"
    images = [picture(700, 300, "RGB"), picture(100, 100, "RGB")]  # 1 x 2 tiles, and one
    out = processor(images=images, text=text, return_text_replacement_offsets=True)
    expected, end = "", 0
    for replaced in out["text_replacement_offsets"][0]:
        start, stop = replaced["span"]
        expected += text[end:start] + replaced["replacement"]
        end = stop
    expected += text[end:]
    sizes = [image.size for image in images]
    assert processing("unresized").expand_image_tokens(text, sizes) == expected
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        p.expand_image_tokens(text, sizes[:1])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"GIF89a, not quite", "not a PNG, JPEG", id="garbage"),
        pytest.param(b"", "not a PNG, JPEG", id="empty"),
        pytest.param(png_header(0, 10), "not a PNG, JPEG", id="zero-width"),
        # 10^10 pixels, 30 GB decoded: Pillow's own limit, refused as ours
        pytest.param(png_header(100_000, 100_000), "more than 67108864 pixels", id="bomb"),
        # under Pillow's limits (no warning either), over ours
        pytest.param(png_header(9000, 9000), "9000x9000, 81000000 pixels", id="over-max"),
    ],
)
def test_refused(data: bytes, message: str) -> None:
    for read in (read_image, image_size):
        with pytest.raises(ValueError, match=message):
            read(data)


def test_refused_when_decoded() -> None:
    data = encoded(picture(64, 48, "RGB"), "PNG")
    assert image_size(data[: len(data) // 2]) == (64, 48)  # its header is whole
    with pytest.raises(ValueError, match="corrupt: image file is truncated"):
        read_image(data[: len(data) // 2])
    for read in (read_image, image_size):
        with pytest.raises(ValueError, match="64x48, 3072 pixels: over the limit of 3000"):
            read(data, max_pixels=3000)
    # Ghostscript's formats are not opened at all
    with pytest.raises(ValueError, match="not a PNG, JPEG"):
        read_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")


def test_defaults_as_transformers() -> None:
    """Keys left out (or null) are the Idefics3 and SmolVLM image processors' defaults (the
    same), and processor_config.json's image_seq_len the processors' 169."""
    p = ImageProcessing.from_dicts({"size": None}, None)
    for default in (Idefics3ImageProcessorPil(), SmolVLMImageProcessorPil()):
        assert p.longest_edge == default.size.longest_edge
        assert p.tile_size == default.max_image_size["longest_edge"]
        assert p.resample == default.resample
        assert p.rescale_factor == default.rescale_factor
        assert p.image_mean == tuple(default.image_mean)
        assert p.image_std == tuple(default.image_std)
        flags = ("do_resize", "do_rescale", "do_normalize", "do_image_splitting")
        assert all(getattr(p, flag) is getattr(default, flag) for flag in flags)
    assert p.image_seq_len == 169


@pytest.mark.parametrize(
    ("preprocessor", "processor", "message"),
    [
        ({"do_image_splitting": "yes"}, {}, "preprocessor_config.json: do_image_splitting"),
        ({"size": 2048}, {}, "preprocessor_config.json: size must be an object"),
        ({"max_image_size": {"longest_edge": "512"}}, {}, "json: max_image_size must be"),
        ({"resample": "lanczos"}, {}, "preprocessor_config.json: resample must be"),
        ({"image_mean": [0.5, 0.5]}, {}, "preprocessor_config.json: image_mean must be"),
        ({"image_std": 0}, {}, "preprocessor_config.json: image_std must be positive"),
        ({"rescale_factor": "1/255"}, {}, "preprocessor_config.json: rescale_factor must"),
        ({}, {"image_seq_len": 64.0}, "processor_config.json: image_seq_len must be"),
    ],
)
def test_config_refused(
    preprocessor: dict[str, Any], processor: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ImageProcessing.from_dicts(preprocessor, processor)


def test_from_model_dir(tmp_path: Path) -> None:
    assert ImageProcessing.from_model_dir(tmp_path) is None
    (tmp_path / "processor_config.json").write_text(json.dumps(PROCESSOR))
    assert ImageProcessing.from_model_dir(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(SMOLVLM2))
    assert ImageProcessing.from_model_dir(tmp_path) == processing("smolvlm2")
    # transformers 5 saves the image processor inside processor_config.json, read first
    nested = {**PROCESSOR, "image_processor": UNSPLIT}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert ImageProcessing.from_model_dir(tmp_path) == processing("unsplit")
