"""A GGUF file's key/value metadata, and the error for a file the converter cannot rebuild."""

from typing import Any

from gguf import GGUFReader


class UnsupportedGGUFError(ValueError):
    """The GGUF file is unreadable, or describes a model or tokenizer this converter cannot rebuild."""


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise UnsupportedGGUFError(f"GGUF file has no {key!r} metadata")
        return self._fields[key].contents()
