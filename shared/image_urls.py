"""A chat's images as OpenAI's clients send them (``image_url`` parts holding ``data:``
URLs), taken out into the protocol's form: an ``{"type": "image"}`` part in the message
and the encoded image beside the prompt, in order."""

from __future__ import annotations

import base64
import binascii
from typing import Any

_DATA_URL = "data:"


def decode_image_url(url: str) -> bytes:
    """The encoded image of a ``data:[TYPE];base64,DATA`` URL; ValueError otherwise (this
    client fetches no remote URL: the image travels in the request)."""
    if not url.startswith(_DATA_URL):
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise ValueError(
            f"image_url: a {scheme!r} URL is not read; send the image itself as a data URL "
            "(data:image/png;base64,...)"
        )
    header, comma, data = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError("image_url: a data URL of an image must be base64 (data:TYPE;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL's base64 is not valid") from None


def chat_images(prompt: Any) -> tuple[Any, list[bytes]]:
    """A chat's messages with each ``image_url`` part an image part, and those parts'
    images in order; any other prompt as it is, with none."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
        return prompt, []
    images: list[bytes] = []
    messages = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(_is_image_url(part) for part in content):
            parts = []
            for part in content:
                if _is_image_url(part):
                    images.append(decode_image_url(_url_of(part["image_url"])))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        messages.append(message)
    return messages, images


def _is_image_url(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _url_of(image_url: Any) -> str:
    """OpenAI's ``{"url": URL, "detail"?: ...}`` (``detail`` is OpenAI's resolution
    choice; the model's processor decides here), or a bare URL as some clients send it."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ValueError('an image_url part must hold {"url": "data:..."}')
    return url
