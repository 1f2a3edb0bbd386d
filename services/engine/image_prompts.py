"""Prompts with images, as the front end tokenizes them for a model that takes images.

A chat's image parts render (by the model's template) as one placeholder each (Idefics3's
``<image>``), as does a text prompt's own; each is expanded into the tokens of its image's tiles, as
the model's processor does, from the image's size. Each image is decoded whole here (on a
tokenizer thread), so that one the executors could not decode is refused before it is
accepted: they decode it again to compute the features its tokens stand for, and a step
that failed on it would fail every request in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from weir.shared.image_processors import ImageProcessor
from weir.shared.images import DEFAULT_MAX_PIXELS, image_size, read_image

T = TypeVar("T")


def _named(index: int, read: Callable[[bytes], T], image: bytes) -> T:
    """``read(image)``, its ValueError naming the image."""
    try:
        return read(image)
    except ValueError as exc:
        raise ValueError(f"images[{index}]: {exc}") from None


class ImagePrompts:
    def __init__(self, processing: ImageProcessor, image_token_id: int) -> None:
        self.processing = processing
        self.image_token_id = image_token_id

    @staticmethod
    def chat(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as such models' templates read them: every content a list of
        parts (a string is one text part; these templates iterate over the parts)."""
        return [
            message
            if type(message["content"]) is list
            else {**message, "content": [{"type": "text", "text": message["content"]}]}
            for message in prompt
        ]

    def expand(self, text: str, images: list[bytes]) -> str:
        """``text`` with each placeholder replaced by its image's tokens, in order;
        ValueError names an image that is not one (or cannot be decoded whole), images whose
        pixels add up past what one request may have decoded (checked from their headers
        first), or a count that differs."""
        sizes = [_named(i, image_size, image) for i, image in enumerate(images)]
        total = sum(width * height for width, height in sizes)
        if total > DEFAULT_MAX_PIXELS:  # one request holds a tokenizer thread this long
            raise ValueError(
                f"the {len(images)} images hold {total} pixels, over the limit of "
                f"{DEFAULT_MAX_PIXELS} for one request: send fewer or smaller images"
            )
        for i, image in enumerate(images):
            _named(i, read_image, image)
        return self.processing.expand_image_tokens(text, sizes)

    def starts(self, ids: list[int], images: list[bytes]) -> list[int]:
        """The position of each image's first token in ``ids`` (checked by ``check``)."""
        positions = [i for i, token in enumerate(ids) if token == self.image_token_id]
        starts, taken = [], 0
        for image in images:
            starts.append(positions[taken])
            taken += self.processing.num_image_tokens(*image_size(image))
        return starts

    def check(self, ids: list[int], images: list[bytes], expanded: str | None) -> None:
        """A prompt's image tokens are its images' (ValueError otherwise): a prompt of
        token ids, or a text whose placeholders were not all expanded, may hold others."""
        placeholder = self.processing.placeholder
        found = ids.count(self.image_token_id)
        wanted = 0 if expanded is None else expanded.count(placeholder)
        if found != wanted:
            sent = f"{len(images)} images" if images else "no images"
            raise ValueError(
                f"the prompt holds {found} image tokens where its {sent} take {wanted}: "
                f"send an image for each {placeholder} (or each image part of a chat), and "
                "no image tokens of its own"
            )
