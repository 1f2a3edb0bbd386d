"""The msgpack envelope every Weir message travels in, and the one protocol version.

Two shapes share it: step messages (plan, result) are arrays
``[tag, PROTOCOL_VERSION, *fields]`` because their hot columns are positional;
client messages are maps ``{"v": PROTOCOL_VERSION, "type": tag, ...}`` because
clients in any language write them by hand; executor control frames are maps
too (their kind travels in the ZeroMQ frame before them). Never pickle.
"""

from __future__ import annotations

from typing import Any

import msgpack

PROTOCOL_VERSION = 2


class ProtocolError(ValueError):
    """A message that cannot be decoded: bad msgpack, wrong version, wrong types."""


def unpack_msgpack(data: Any, what: str, **limits: int) -> Any:
    """``data`` as Python values; ``ProtocolError`` (naming ``what``) for anything that is not
    msgpack, whatever error msgpack raised. ``limits`` are msgpack's ``max_array_len`` and
    ``max_map_len``, for messages from untrusted peers."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **limits)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"{what}: not valid msgpack ({type(exc).__name__}: {exc})") from None


def check_version(version: Any, what: str) -> None:
    # ``True == 1`` and ``1.0 == 1``: only the int itself is this version.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{what}: unsupported protocol version {version!r} "
            f"(this side speaks {PROTOCOL_VERSION})"
        )


def pack_array(tag: str, fields: list[Any]) -> bytes:
    try:
        packed: bytes = msgpack.packb([tag, PROTOCOL_VERSION, *fields])
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{tag}: cannot encode ({encoding_problem(exc)})") from None
    return packed


def unpack_array(data: Any, tag: str, num_fields: int) -> list[Any]:
    """The fields of a ``[tag, version, *fields]`` message (the list itself, fields from
    index 2)."""
    msg = unpack_msgpack(data, tag)
    if type(msg) is not list or len(msg) < 2:
        raise ProtocolError(f"{tag}: expected a [type, version, ...] array")
    if msg[0] != tag:
        raise ProtocolError(f"expected a {tag} message, got type tag {msg[0]!r}")
    check_version(msg[1], tag)
    if len(msg) != num_fields + 2:
        raise ProtocolError(f"{tag}: expected {num_fields} fields, got {len(msg) - 2}")
    return msg


def pack_map(body: dict[str, Any]) -> bytes:
    try:
        packed: bytes = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode ({encoding_problem(exc)})") from None
    return packed


def encoding_problem(exc: Exception) -> str:
    if isinstance(exc, UnicodeEncodeError):
        return f"text holds {exc.object[exc.start : exc.end]!r}, a lone surrogate, not Unicode"
    if isinstance(exc, OverflowError):
        return "an integer outside msgpack's 64-bit range"
    return str(exc)


def unpack_map(data: Any, what: str, **limits: int) -> dict[str, Any]:
    value = unpack_msgpack(data, what, **limits)
    if type(value) is not dict:
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(value).__name__}")
    return value
