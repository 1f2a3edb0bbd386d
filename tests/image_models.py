"""Small random models that read images, with SmolLM2's vocabulary and the image tokens
their families add, saved with the processor files they ship: an Idefics3 (SmolVLM's
architecture) and an InternVL (a Qwen2 language model); images and chats of them as
clients send them; transformers' greedy decoding of such a chat, from its processor."""

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from spread_weights import spread_weights_
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

# SmolVLM's chat template (its chat_template.json): every content a list of parts.
TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
TILE = 32  # pixels of a tile: 4 x 4 patches of 8, 4 tokens after the pixel shuffle
IMAGE_SEQ_LEN = 4
PREPROCESSOR = {
    "image_processor_type": "Idefics3ImageProcessor",
    "do_resize": True,
    "size": {"longest_edge": 2 * TILE},
    "max_image_size": {"longest_edge": TILE},
    "do_image_splitting": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 1,
    "do_pad": True,
}


def save_idefics3(path: Path, tokenizer_dir: Path):
    """The Idefics3 saved under ``path``; transformers' copy loaded back, and its processor."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)  # in place of SmolLM2's
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": IMAGE_SEQ_LEN}))
    torch.manual_seed(0)
    config = transformers.Idefics3Config(
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": TILE,
            "patch_size": 8,
        },
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    model = transformers.Idefics3ForConditionalGeneration(config)
    spread_weights_(model)
    model.save_pretrained(path)
    hf = transformers.Idefics3ForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.Idefics3Processor(
        transformers.Idefics3ImageProcessorPil(**PREPROCESSOR),
        tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=TEMPLATE,
    )
    return hf, processor


def png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat_of(text: str, images: list[bytes]) -> list[dict]:
    """One user message of OpenAI's parts: the images (as data URLs), then the text."""
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
        for b64 in (base64.b64encode(image).decode() for image in images)
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def transformers_greedy(
    hf, processor, text: str, images: list[bytes], num_tokens: int, chat: bool = True
):
    """transformers' prompt ids and greedy tokens for the chat of the images then the text
    (or, not ``chat``, for the text alone, its <image>s the images'), from its processor."""
    messages = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}],
        }
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True) if chat else text
    pil = [Image.open(io.BytesIO(image)) for image in images]
    inputs = processor(text=rendered, images=[pil] if pil else None, return_tensors="pt")
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    prompt = ids[0].tolist()
    with torch.no_grad():  # a full forward pass per token, argmax, no end token
        for _ in range(num_tokens):
            token = hf(input_ids=ids, **inputs).logits[0, -1].argmax()
            ids = torch.cat((ids, token.view(1, 1)), dim=1)
    return prompt, ids[0, len(prompt) :].tolist()


def image_starts(processor, prompt_ids: list[int], images: list[bytes]) -> list[int]:
    """Where each image's tokens begin in ``prompt_ids``, by the tile grids transformers'
    image processor cuts the images into."""
    pil = [Image.open(io.BytesIO(image)) for image in images]
    grid = processor.image_processor([pil], return_row_col_info=True)
    positions = [i for i, t in enumerate(prompt_ids) if t == processor.image_token_id]
    starts, taken = [], 0
    for rows, cols in zip(grid["rows"][0], grid["cols"][0], strict=True):
        starts.append(positions[taken])
        taken += (rows * cols + 1) * IMAGE_SEQ_LEN
    return starts


# The chat template transformers' converter gives InternVL's -hf checkpoints: an image part
# is the context token and a newline.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",  # InternVLProcessor reads it, images or not
}
# Tiles of 56 pixels: 4 x 4 patches of 14, 4 tokens after the pixel shuffle; up to six
# tiles and the thumbnail.
INTERNVL_PREPROCESSOR = {
    "image_processor_type": "GotOcr2ImageProcessor",
    "size": {"height": 56, "width": 56},
    "min_patches": 1,
    "max_patches": 6,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
}


class _InternVLProcessor(transformers.InternVLProcessor):
    """InternVLProcessor without a video processor: transformers cannot name the video
    processor's class without torchvision (not installed here), so its check of that
    argument fails even for None. Images do not reach it."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def save_internvl(path: Path, tokenizer_dir: Path):
    """The InternVL saved under ``path``; transformers' copy loaded back, and its processor."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir, extra_special_tokens=INTERNVL_TOKENS
    )
    tokenizer.add_special_tokens(
        {"extra_special_tokens": list(INTERNVL_TOKENS.values())},
        replace_extra_special_tokens=False,
    )
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(INTERNVL_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(INTERNVL_PREPROCESSOR))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    torch.manual_seed(0)
    config = transformers.InternVLConfig(
        text_config=transformers.Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            eos_token_id=tokenizer.eos_token_id,
        ).to_dict(),
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [56, 56],
            "patch_size": [14, 14],
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        tie_word_embeddings=False,
    )
    model = transformers.InternVLForConditionalGeneration(config)
    spread_weights_(model)
    model.save_pretrained(path)
    hf = transformers.InternVLForConditionalGeneration.from_pretrained(path).eval()
    processor = _InternVLProcessor(
        GotOcr2ImageProcessorPil.from_dict(INTERNVL_PREPROCESSOR),
        tokenizer,
        None,
        image_seq_length=4,
        chat_template=INTERNVL_TEMPLATE,
    )
    return hf, processor


def chats_and_greedy(hf, processor, cases, num_tokens: int):
    """For each (text, [(seed, width, height), ...]) case: the chat of its images (PNGs)
    and its text, and transformers' (prompt ids, greedy tokens) for it."""
    chats, expected = [], []
    for text, specs in cases:
        images = [png(*spec) for spec in specs]
        chats.append(chat_of(text, images))
        expected.append(transformers_greedy(hf, processor, text, images, num_tokens))
    return chats, expected


def assert_decoded_then_cached(first, again, expected, block_size: int) -> None:
    """Both runs' completions are transformers' prompt ids and tokens; the second run found
    every whole block of each prompt (but the one of its last token) in the prefix cache."""
    for out in (first, again):
        assert [(c.prompt_token_ids, c.token_ids) for c in out] == expected
    whole = [(len(prompt) - 1) // block_size * block_size for prompt, _ in expected]
    assert [c.num_cached_tokens for c in again] == whole


def png_header(width: int, height: int) -> bytes:
    """A PNG of only its header, no pixel data: decoding it fails, so a refusal that names its
    size came before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
