"""weir.shared.internvl_images against transformers' InternVLProcessor and the GotOcr2 image
processor it holds (the PIL backend, the one transformers picks without torchvision), on the
configs InternVL3-1B-hf ships and variations of them: the tiles of generated images (noise over
gradients, encoded as PNG and JPEG, each side decoding the same bytes: transformers is given
Pillow's image as Image.open returns it), their pixel values bit for bit, the text that stands
for them, and the refusals of bad configs and prompts."""

import io
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.internvl.processing_internvl import InternVLProcessor

from weir.shared.images import read_image
from weir.shared.internvl_images import InternVLImageProcessing

# OpenGVLab/InternVL3-1B-hf's preprocessor_config.json, written from memory and from
# transformers' converter (convert_internvl_weights_to_hf), which sets all but crop_to_patches,
# min_patches, max_patches and resample: those it leaves at the GotOcr2 image processor's
# defaults (false, 1, 12, bicubic). The processor cuts images whatever crop_to_patches says
# (test_crop_to_patches_not_read).
INTERNVL3 = {
    "crop_to_patches": False,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_processor_type": "GotOcr2ImageProcessorFast",
    "image_std": [0.229, 0.224, 0.225],
    "max_patches": 12,
    "min_patches": 1,
    "processor_class": "InternVLProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 448, "width": 448},
}
PROCESSOR = {"image_seq_length": 256, "processor_class": "InternVLProcessor"}
# Grids of at most 4 tiles, where a 3:2 image is as near 1:1 as 2:1 and 2:2 (its area decides).
MAX4 = {**INTERNVL3, "max_patches": 4}
# Not cut: every image resized to one tile, here bilinear.
UNCUT = {**INTERNVL3, "max_patches": 1, "resample": 2}
# Oblong tiles, two to six of them, nearest-neighbour, and the byte values themselves (no
# rescale, no normalize: transformers' pixel values stay bytes).
BYTES = {
    **INTERNVL3,
    "size": {"height": 112, "width": 168},
    "min_patches": 2,
    "max_patches": 6,
    "resample": 0,
    "do_rescale": False,
    "do_normalize": False,
}
# Exactly two tiles, 1 x 2 or 2 x 1: between them a tie (5:4 is as far from either) goes to
# the one transformers tries first, 1 x 2, where the area does not decide.
PAIR = {**INTERNVL3, "min_patches": 2, "max_patches": 2}
CONFIGS = {"internvl3": INTERNVL3, "max4": MAX4, "uncut": UNCUT, "bytes": BYTES, "pair": PAIR}
CONTEXT = "<IMG_CONTEXT>"

# The chat template transformers' converter gives the -hf checkpoints: an image part is the
# context token and a newline.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


class _Processor(InternVLProcessor):
    """InternVLProcessor without a video processor: transformers cannot name the video
    processor's class without torchvision (not installed here), so its check of that argument
    fails even for None. Images do not reach it."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@cache
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the -hf checkpoints' named image tokens, as their
    tokenizer_config.json's extra_special_tokens name them."""
    words = ["[UNK]", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    named = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    fast = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", extra_special_tokens=named
    )
    fast.add_special_tokens({"extra_special_tokens": words[1:]}, replace_extra_special_tokens=False)
    return fast


def internvl_processor(preprocessor: dict[str, Any]) -> InternVLProcessor:
    return _Processor(
        GotOcr2ImageProcessorPil.from_dict(preprocessor),
        tokenizer(),
        None,
        image_seq_length=PROCESSOR["image_seq_length"],
        chat_template=CHAT_TEMPLATE,
    )


@cache
def reference(config: str) -> InternVLProcessor:
    return internvl_processor(CONFIGS[config])


def processing(config: str) -> InternVLImageProcessing:
    return InternVLImageProcessing.from_dicts(CONFIGS[config], PROCESSOR)


def picture(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """Noise over a gradient (bicubic's overshoot clips), in ``mode``; RGBA's alpha goes from
    clear to opaque across."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 150, height), np.linspace(0, 100, width))
    pixels = (ramp[..., None] + rng.integers(0, 106, (height, width, 4))).astype(np.uint8)
    pixels[..., 3] = np.linspace(0, 255, width).astype(np.uint8)[None, :]
    image = Image.fromarray(pixels, "RGBA")
    return image if mode == "RGBA" else image.convert(mode)


def encoded(image: Image.Image, format: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format)
    return out.getvalue()


def expanded(out: dict[str, Any], text: str) -> str:
    """The text the processor made of ``text``, from the replacements it reports."""
    result, end = "", 0
    for replaced in out["text_replacement_offsets"][0]:
        start, stop = replaced["span"]
        result += text[end:start] + replaced["replacement"]
        end = stop
    return result + text[end:]


# (config, width, height, mode, format, tiles)
CASES = [
    pytest.param("internvl3", 1, 1, "RGB", "PNG", 1, id="1x1"),
    # 5:3 is nearest 3:2: a tiny image is upscaled to six tiles
    pytest.param("internvl3", 5, 3, "L", "PNG", 7, id="5x3-greyscale"),
    pytest.param("internvl3", 448, 448, "RGB", "JPEG", 1, id="448x448-one-tile"),
    pytest.param("internvl3", 2000, 300, "RGB", "JPEG", 8, id="2000x300-wide-7x1"),
    pytest.param("internvl3", 300, 2000, "RGBA", "PNG", 8, id="300x2000-tall-rgba"),
    pytest.param("internvl3", 1500, 1500, "RGB", "JPEG", 10, id="1500x1500-3x3"),
    # exactly between 1:1 and 4:3, nearer 4:3 in floats
    pytest.param("internvl3", 700, 600, "RGB", "PNG", 13, id="700x600-float-tie-4x3"),
    # a tie of 1:1 and 2:2 broken by the area: 634^2 is over half of 2 x 2 tiles, 633^2 not
    pytest.param("internvl3", 634, 634, "RGB", "PNG", 5, id="634x634-area-tie-2x2"),
    pytest.param("internvl3", 633, 633, "RGB", "PNG", 1, id="633x633-area-tie-1x1"),
    # 3:2 with at most 4 tiles: as near 1:1, 2:1 and 2:2; the area picks 2:1 here
    pytest.param("max4", 600, 400, "RGB", "PNG", 3, id="max4-600x400-2x1"),
    pytest.param("max4", 900, 600, "RGB", "JPEG", 5, id="max4-900x600-2x2"),
    pytest.param("uncut", 640, 480, "RGB", "JPEG", 1, id="uncut-640x480"),
    # a grid's shape is columns / rows whatever its tiles' shape: 5:1 here is 5 x 1 tiles
    pytest.param("bytes", 1000, 200, "RGB", "PNG", 6, id="bytes-oblong-tiles-5x1"),
    pytest.param("bytes", 100, 100, "RGB", "PNG", 5, id="bytes-min-2-tiles-2x2"),
    pytest.param("pair", 50, 40, "RGB", "PNG", 3, id="pair-50x40-tie-1x2"),
]


@pytest.mark.parametrize(("config", "width", "height", "mode", "format", "tiles"), CASES)
def test_as_transformers(
    config: str, width: int, height: int, mode: str, format: str, tiles: int
) -> None:
    data = encoded(picture(width, height, mode), format)
    text = f"Look:{CONTEXT}\nwhat is it?"
    out = reference(config)(
        images=[Image.open(io.BytesIO(data))],
        text=text,
        return_tensors="np",
        return_text_replacement_offsets=True,
    )
    p = processing(config)

    assert p.num_tiles(width, height) == tiles == len(out["pixel_values"])
    values = p.pixel_values(read_image(data))
    assert values.dtype == np.float32
    # Bit for bit: the same Pillow resizes of the same bytes, and the same float arithmetic.
    # (No rescale and no normalize leave transformers' bytes as they are: compared as floats.)
    np.testing.assert_array_equal(values, out["pixel_values"].astype(np.float32))
    assert p.expand_image_tokens(text, [(width, height)]) == expanded(out, text)
    assert p.num_image_tokens(width, height) == 256 * tiles


# Sizes whose grid a float rounding decides (their aspect ratio exactly between two grids',
# nearer one in floats), sizes about the area's tie-break (896 x 1008 is exactly half of 3 x 3
# tiles of 448: not over it), and extremes.
EDGES = [(7, 6), (14, 12), (17, 24), (11, 60), (110, 600), (7, 12), (633, 633), (634, 634)]
EDGES += [(950, 950), (951, 951), (896, 1008), (1008, 896), (1024, 882), (899, 600)]
EDGES += [(1, 10_000), (10_000, 1), (8000, 7999)]


@pytest.mark.parametrize("config", CONFIGS)
def test_tiles_as_transformers(config: str) -> None:
    """num_tiles needs no image: equal to the patches the processor counts for an image of
    that size, and num_image_tokens to its tokens but the start and end tokens, over every size
    up to 40 x 40 and a spread up to 3000 (the float ties, e.g. 7 x 6, are small)."""
    sizes = [(w, h) for w in range(1, 41) for h in range(1, 41)]
    sizes += [(w, h) for w in range(41, 3000, 37) for h in range(41, 3000, 41)] + EDGES
    expected = reference(config)._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    p = processing(config)
    assert [p.num_tiles(w, h) for w, h in sizes] == expected.num_image_patches
    assert [p.num_image_tokens(w, h) + 2 for w, h in sizes] == expected.num_image_tokens


def test_prompt_as_transformers() -> None:
    """A chat rendered by the checkpoints' template holds the placeholder for each image part;
    expanded as the processor expands it, each image's text its image_prompt."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What differs from"},
                {"type": "image"},
                {"type": "text", "text": " here?"},
            ],
        }
    ]
    processor = reference("internvl3")
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p = processing("internvl3")
    assert text.count(p.placeholder) == 2
    images = [picture(700, 600, "RGB"), picture(100, 100, "RGB")]  # 4 x 3 tiles and one
    out = processor(images=images, text=text, return_text_replacement_offsets=True)
    sizes = [image.size for image in images]
    assert p.expand_image_tokens(text, sizes) == expanded(out, text)
    replacements = [replaced["replacement"] for replaced in out["text_replacement_offsets"][0]]
    assert [p.image_prompt(*size) for size in sizes] == replacements
    assert p.image_prompt(1, 1) == "<img>" + CONTEXT * 256 + "</img>"
    with pytest.raises(ValueError, match="2 <IMG_CONTEXT> placeholders but 1 images"):
        p.expand_image_tokens(text, sizes[:1])
    with pytest.raises(ValueError, match="0 <IMG_CONTEXT> placeholders but 2 images"):
        p.expand_image_tokens("no image", sizes)


def test_crop_to_patches_not_read() -> None:
    """The processor cuts an image whether its image processor's config says crop_to_patches
    or not (the -hf checkpoints' say false): so does Weir, which does not read it."""
    data = encoded(picture(900, 300, "RGB"), "PNG")
    outs = []
    for crop in (False, True):
        config = {**INTERNVL3, "crop_to_patches": crop}
        out = internvl_processor(config)(images=[Image.open(io.BytesIO(data))], text=CONTEXT)
        outs.append(out["pixel_values"])
        p = InternVLImageProcessing.from_dicts(config, PROCESSOR)
        assert p == processing("internvl3")
    assert len(outs[0]) == len(outs[1]) == 4  # 3 x 1 and the thumbnail
    np.testing.assert_array_equal(outs[0], outs[1])


def test_defaults_as_transformers() -> None:
    """Keys left out (or null) are the GotOcr2 image processor's defaults, and
    processor_config.json's image_seq_length the processor's 256."""
    p = InternVLImageProcessing.from_dicts({"size": None}, None)
    default = GotOcr2ImageProcessorPil()
    assert (p.min_patches, p.max_patches) == (default.min_patches, default.max_patches)
    assert (p.tile_height, p.tile_width) == (default.size.height, default.size.width)
    assert p.resample == default.resample
    assert p.rescale_factor == default.rescale_factor
    assert p.image_mean == tuple(default.image_mean)
    assert p.image_std == tuple(default.image_std)
    assert (p.do_rescale, p.do_normalize) == (default.do_rescale, default.do_normalize)
    assert p.image_seq_length == 256 == _Processor(default, tokenizer(), None).image_seq_length


@pytest.mark.parametrize(
    ("preprocessor", "processor", "message"),
    [
        ({"max_patches": "12"}, {}, "preprocessor_config.json: max_patches must be a positive"),
        ({"min_patches": 0}, {}, "preprocessor_config.json: min_patches must be a positive"),
        ({"size": 448}, {}, 'preprocessor_config.json: size must be an object {"height"'),
        ({"size": {"height": 448}}, {}, "preprocessor_config.json: size must be an object"),
        ({"size": {"height": 448, "width": True}}, {}, "json: size must be an object"),
        ({"resample": "bicubic"}, {}, "preprocessor_config.json: resample must be"),
        ({"image_mean": [0.5, 0.5]}, {}, "preprocessor_config.json: image_mean must be"),
        ({"image_std": [0.2, 0, 0.2]}, {}, "preprocessor_config.json: image_std must be positive"),
        ({"do_normalize": 1}, {}, "preprocessor_config.json: do_normalize must be true or false"),
        ({"do_resize": False, "max_patches": 1}, {}, "do_resize false leaves an image of max"),
        ({}, {"image_seq_length": 256.0}, "processor_config.json: image_seq_length must be"),
    ],
)
def test_config_refused(
    preprocessor: dict[str, Any], processor: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        InternVLImageProcessing.from_dicts(preprocessor, processor)


def test_unresized_image_cut() -> None:
    """do_resize false counts only where an image is not cut: otherwise it is accepted, as
    transformers ignores it."""
    p = InternVLImageProcessing.from_dicts({**INTERNVL3, "do_resize": False}, PROCESSOR)
    assert p == processing("internvl3")


def test_from_model_dir(tmp_path: Path) -> None:
    assert InternVLImageProcessing.from_model_dir(tmp_path) is None
    (tmp_path / "processor_config.json").write_text(json.dumps(PROCESSOR))
    assert InternVLImageProcessing.from_model_dir(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(INTERNVL3))
    assert InternVLImageProcessing.from_model_dir(tmp_path) == processing("internvl3")
    # transformers 5 saves the image processor inside processor_config.json, read first
    nested = {**PROCESSOR, "image_processor": MAX4}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert InternVLImageProcessing.from_model_dir(tmp_path) == processing("max4")
