"""Chats with images through `weir serve` and the official openai and anthropic clients:
OpenAI's ``image_url`` parts (data URLs), the Responses API's ``input_image`` parts and
Anthropic's base64 image blocks read by a small random Idefics3 (``image_models``) as
transformers reads them, concurrent requests of different images; what is not an image, or
not sent, refused with a 400 that names it while the server goes on serving."""

import base64
import concurrent.futures
import re

import anthropic
import openai
import pytest
from image_models import chat_of, png, save_idefics3, transformers_greedy
from serving_helpers import small_server


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir):
    """The server, an openai client of it, and transformers' model and processor."""
    path = tmp_path_factory.mktemp("models") / "tiny-idefics3"
    hf, processor = save_idefics3(path, default_model_dir)
    with small_server(path, "tiny-idefics3") as server:
        client = openai.OpenAI(base_url=server.info["http_address"] + "/v1", api_key="unused")
        yield client, hf, processor, server.info["http_address"]


def _answer(client: openai.OpenAI, messages: list[dict], max_tokens: int = 5) -> str:
    reply = client.chat.completions.create(
        model="tiny-idefics3",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].message.content


def test_openai_clients_get_what_transformers_reads_of_their_images(served):
    client, hf, processor, _ = served
    cases = [
        ("What is this?", [png(11, 90, 60)]),
        ("And these?", [png(12, 30, 30), png(13, 64, 20)]),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: _answer(client, chat_of(*case)), cases))
    for (text, images), answer in zip(cases, answers, strict=True):
        tokens = transformers_greedy(hf, processor, text, images, 5)[1]
        assert answer == processor.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("data:image/png;base64,bm90IGFuIGltYWdl", "images[0]"),  # "not an image"
        ("data:image/png;base64,%%%", "base64"),
        ("https://example.com/cat.png", "data URL"),
    ],
)
def test_what_is_not_an_image_is_refused_and_the_server_serves_on(served, url, named):
    client, hf, processor, _ = served
    message = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Hi"},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError, match=re.escape(named)):
        _answer(client, message)
    image = png(14, 40, 40)
    tokens = transformers_greedy(hf, processor, "Hi", [image], 3)[1]
    assert _answer(client, chat_of("Hi", [image]), 3) == processor.tokenizer.decode(
        tokens, skip_special_tokens=True
    )


def _until_end(processor, tokens: list[int]) -> str:
    """The text of greedy tokens up to the model's end token (these APIs stop there)."""
    end = processor.tokenizer.eos_token_id
    return processor.tokenizer.decode(
        tokens[: tokens.index(end)] if end in tokens else tokens, skip_special_tokens=True
    )


def test_responses_and_anthropic_messages_read_their_images(served):
    """The Responses API's input_image (a data URL) and Anthropic's base64 image block, each
    before the text, read as the chat of the same image and text."""
    client, hf, processor, http = served
    image = png(15, 50, 70)
    expected = _until_end(processor, transformers_greedy(hf, processor, "What?", [image], 5)[1])
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    response = client.responses.create(
        model="tiny-idefics3",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url},
                    {"type": "input_text", "text": "What?"},
                ],
            }
        ],
        max_output_tokens=5,
        temperature=0.0,
    )
    assert response.output_text == expected
    message = anthropic.Anthropic(base_url=http, api_key="-").messages.create(
        model="tiny-idefics3",
        max_tokens=5,
        extra_body={"temperature": 0},  # not among the SDK's arguments any more
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(image).decode(),
                        },
                    },
                    {"type": "text", "text": "What?"},
                ],
            }
        ],
    )
    assert "".join(block.text for block in message.content) == expected
