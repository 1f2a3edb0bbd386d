"""Idefics3 (SmolVLM's architecture) served with its images, against transformers: a small
random model (``image_models``) whose prompts with images decode as transformers decodes
them from its own processor's inputs, with the images' tokens split over chunks, several
requests with different images in one batch, and a repeated image found in the prefix
cache (only for the same image)."""

import io
import shutil

import pytest
import tp_workload
from image_models import (
    assert_decoded_then_cached,
    chat_of,
    chats_and_greedy,
    image_starts,
    png,
    png_header,
    save_idefics3,
    transformers_greedy,
)
from PIL import Image

from weir.services.llm import LLM
from weir.shared.client import WeirError
from weir.shared.sampling import SamplingParams


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory, default_model_dir):
    """The model's directory, transformers' model and processor loaded from it."""
    path = tmp_path_factory.mktemp("idefics3")
    return (path, *save_idefics3(path, default_model_dir))


CASES = [
    ("What is in the picture?", [(1, 80, 50)]),  # split into 2 x 2 tiles and the whole
    ("Describe it.", [(2, 20, 30)]),  # smaller than a tile: the whole only
    ("Compare them.", [(3, 70, 20), (4, 10, 64)]),
]


def test_chats_with_images_decode_as_transformers(idefics3):
    """Concurrent chats with one or two images each, their image tokens split across
    chunks of 24 tokens; each again, the second time every whole block from the prefix
    cache; the first chat's text with another image of the same size (the same token ids):
    only the blocks before the image's first token are reused."""
    path, hf, processor = idefics3
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chats, expected = chats_and_greedy(hf, processor, CASES, 6)
    other = png(9, 80, 50)
    with LLM(
        model=str(path),
        max_num_batched_tokens=24,
        block_size=4,
        max_model_len=512,
        device="cpu",
        enable_prefix_caching=True,
    ) as llm:
        first = llm.chat(chats, params, use_tqdm=False)
        again = llm.chat(chats, params, use_tqdm=False)
        swapped = llm.chat(chat_of(CASES[0][0], [other]), params, use_tqdm=False)[0]
    assert_decoded_then_cached(first, again, expected, 4)
    start = image_starts(processor, expected[0][0], [other])[0]
    assert start >= 4 and swapped.num_cached_tokens == start // 4 * 4
    assert swapped.token_ids == transformers_greedy(hf, processor, CASES[0][0], [other], 6)[1]


def test_images_that_do_not_fit_their_prompt_are_refused(idefics3):
    """More images than --limit-mm-per-prompt, garbage bytes, a PNG cut short (its header
    whole: refused before the executors would fail to decode it), images whose pixels add
    up past one request's limit (refused by their headers, before decoding), a URL to
    fetch, a text without its <image>, token ids of image tokens: each refused by name, and
    the server goes on serving (images, and chats of text only)."""
    path, hf, processor = idefics3
    params = SamplingParams(max_tokens=2, temperature=0.0)
    good = png(1, 40, 40)
    with LLM(
        model=str(path), max_model_len=512, device="cpu", limit_mm_per_prompt={"image": 2}
    ) as llm:
        with pytest.raises(WeirError, match="at most 2 images to this server"):
            llm.chat(chat_of("Hi", [good] * 3), params, use_tqdm=False)
        with pytest.raises(WeirError, match=r"images\[0\]: the data is not a PNG"):
            llm.chat(chat_of("Hi", [b"not a png"]), params, use_tqdm=False)
        with pytest.raises(WeirError, match=r"images\[0\]: the image data is corrupt"):
            llm.chat(chat_of("Hi", [good[: len(good) // 2]]), params, use_tqdm=False)
        huge = png_header(6000, 6000)  # each under the limit of one image, not both
        with pytest.raises(WeirError, match="over the limit of 67108864 for one request"):
            llm.chat(chat_of("Hi", [huge, huge]), params, use_tqdm=False)
        with pytest.raises(WeirError, match="data URL"):
            llm.chat(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ],
                params,
                use_tqdm=False,
            )
        with pytest.raises(WeirError, match="1 <image> placeholders but 0 images"):
            llm.generate("A text with an <image> but none sent", params, use_tqdm=False)
        image_token = hf.config.image_token_id
        with pytest.raises(WeirError, match="holds 2 image tokens where its no images take 0"):
            llm.generate([[5, image_token, image_token]], params, use_tqdm=False)
        out = llm.chat(chat_of("Hi", [good]), params, use_tqdm=False)[0]
        text_only = llm.chat(chat_of("Hi", []), params, use_tqdm=False)[0]
    assert out.token_ids == transformers_greedy(hf, processor, "Hi", [good], 2)[1]
    assert text_only.token_ids == transformers_greedy(hf, processor, "Hi", [], 2)[1]


def test_two_ranks_read_the_images_as_one(idefics3):
    """A tensor-parallel group of two: each rank runs the (unsplit) vision tower, and the
    split language model reads its features as transformers does."""
    path, hf, processor = idefics3
    text, specs = CASES[2]
    images = [png(*spec) for spec in specs]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(
        model=str(path),
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        max_model_len=512,
        device="cpu",
    ) as llm:
        out = llm.chat(chat_of(text, images), params, use_tqdm=False)[0]
    assert out.token_ids == transformers_greedy(hf, processor, text, images, 4)[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_read_their_images_again(idefics3, async_scheduling):
    """transformers' processor's prompt ids with their images, through the engine core in
    steps of 16 tokens and too few blocks for all: requests preempted (their images' features
    computed again with their prompts), in lockstep and with the next step planned before
    the last one's tokens are known."""
    path, hf, processor = idefics3
    cases = [(text, [png(*spec) for spec in specs]) for text, specs in CASES]
    expected = [transformers_greedy(hf, processor, text, images, 8) for text, images in cases]
    report = tp_workload.run(
        tp_workload.Workload(
            str(path),
            [prompt for prompt, _ in expected],
            max_tokens=8,
            num_blocks=24,
            async_scheduling=async_scheduling,
            images=[images for _, images in cases],
            image_starts=[
                image_starts(processor, prompt, images)
                for (prompt, _), (_, images) in zip(expected, cases, strict=True)
            ],
        )
    )
    assert report.chunked and report.preempted
    assert [report.outputs[f"r{i}"] for i in range(len(cases))] == [out for _, out in expected]


def test_vllm_prompt_dicts_bring_their_images(idefics3):
    """vLLM's offline form: a text's <image>s and multi_modal_data's images (a PIL image, or
    encoded bytes in a list), as transformers' processor reads the same text and images."""
    path, hf, processor = idefics3
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one, two = png(5, 50, 40), png(6, 33, 70)
    prompts = [
        {"prompt": "<image>What?", "multi_modal_data": {"image": Image.open(io.BytesIO(one))}},
        {"prompt": "A <image> and <image>.", "multi_modal_data": {"image": [one, two]}},
    ]
    with LLM(model=str(path), max_model_len=512, device="cpu") as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [c.token_ids for c in outs] == [
        transformers_greedy(hf, processor, "<image>What?", [one], 4, chat=False)[1],
        transformers_greedy(hf, processor, "A <image> and <image>.", [one, two], 4, chat=False)[1],
    ]


def test_dummy_weights_of_its_shape_read_images(idefics3, tmp_path):
    """--load-format dummy (how GPU benchmarks get real shapes): a directory of the config,
    tokenizer and processor files alone serves chats with images."""
    path = idefics3[0]
    for name in path.iterdir():
        if name.suffix != ".safetensors":
            shutil.copy(name, tmp_path / name.name)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(model=str(tmp_path), load_format="dummy", max_model_len=512, device="cpu") as llm:
        out = llm.chat(chat_of("Hi", [png(7, 90, 40)]), params, use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
