"""InternVL (the -hf checkpoints' InternVLForConditionalGeneration) served with its images,
against transformers: a small random one (``image_models``: InternViT, the pixel shuffle and
projector, a Qwen2 language model) whose chats with images decode as transformers decodes
them from its own processor's inputs (GotOcr2's tiles and thumbnail), the images' tokens
split over chunks, several requests in one batch, each again from the prefix cache."""

import json

import pytest
from image_models import (
    INTERNVL_PREPROCESSOR,
    assert_decoded_then_cached,
    chats_and_greedy,
    save_internvl,
)

from weir.services.llm import LLM
from weir.shared.image_processors import image_processor
from weir.shared.internvl_images import InternVLImageProcessing
from weir.shared.model_config import read_model_config
from weir.shared.sampling import SamplingParams

CASES = [
    ("What is in the picture?", [(1, 150, 90)]),  # 3 x 2 tiles and the thumbnail
    ("Describe it.", [(2, 30, 30)]),  # one tile
    ("Compare them.", [(3, 200, 40), (4, 40, 120)]),
]


@pytest.fixture(scope="module")
def internvl(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("internvl")
    return (path, *save_internvl(path, default_model_dir))


def test_chats_with_images_decode_as_transformers(internvl):
    path, hf, processor = internvl
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chats, expected = chats_and_greedy(hf, processor, CASES, 6)
    with LLM(
        model=str(path),
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=512,
        device="cpu",
        enable_prefix_caching=True,
    ) as llm:
        first = llm.chat(chats, params, use_tqdm=False)
        again = llm.chat(chats, params, use_tqdm=False)
    assert_decoded_then_cached(first, again, expected, 4)


def test_a_processor_whose_tiles_are_not_the_towers_is_refused(internvl, tmp_path):
    """Tiles of 64 pixels for a tower of 56, or 5 tokens a tile for its 4: refused, naming
    both; without processor files, tiles of the tower's size."""
    path = internvl[0]
    vision = read_model_config(path).vision
    for name in ("config.json", "processor_config.json"):
        (tmp_path / name).write_text((path / name).read_text())
    assert image_processor(tmp_path, vision) == InternVLImageProcessing(
        tile_height=56, tile_width=56, image_seq_length=4
    )
    for preprocessor, processor in (
        ({**INTERNVL_PREPROCESSOR, "size": {"height": 64, "width": 64}}, 4),
        (INTERNVL_PREPROCESSOR, 5),
    ):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": processor}))
        with pytest.raises(ValueError, match="but the vision tower .* takes tiles of 56x56"):
            image_processor(tmp_path, vision)
