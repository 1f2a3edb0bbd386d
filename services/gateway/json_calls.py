"""A tool call, and the calls written as JSON: a named function's arguments and
``required``'s array of calls (the structured outputs ``tool_choice`` holds a model to),
Llama 3's ``{"name": ..., "parameters": {...}}`` objects, and the JSON value a call is, which
the other formats' readers build on (``tool_calls.py`` says which reads what)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def delta(self, index: int) -> dict[str, Any]:
        """The call whole, as the one chunk delta that announces it."""
        return {"index": index, **self.to_dict()}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments: an object (OpenAI's rule), of its parameters' schema where
    it gives one (a schema without a type, ``{}`` too, would take any JSON value)."""
    if parameters is None or "type" in parameters:
        return parameters or {"type": "object"}
    return {"type": "object", **parameters}


def required_schema(
    tools: list[tuple[str, dict[str, Any] | None]], parallel: bool
) -> dict[str, Any]:
    """The JSON schema of one or more calls (one if not ``parallel``) of the ``(name,
    parameters)`` tools."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": parameters_schema(parameters),
                    },
                    "required": ["name", "parameters"],
                }
                for name, parameters in tools
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def arguments_text(arguments: Any) -> str:
    """JSON text; ValueError for a value JSON has no text for (an infinite number)."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


class ToolCallReader(Protocol):
    calls: list[ToolCall]

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas ``text`` (the next piece) completes."""
        ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What the text held back at its end: content, and deltas."""
        ...


class NamedCallReader:
    """The whole answer is one call's arguments, streamed as they come. The call begins with
    the answer's first text: an output cut off before any (``max_tokens`` in a thought) holds
    no call, as vLLM streams it, rather than one whose arguments are no JSON."""

    def __init__(self, name: str) -> None:
        self.calls: list[ToolCall] = []
        self._name = name

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not text:
            return "", []
        if not self.calls:
            self.calls.append(ToolCall(self._name, text))
            return "", [self.calls[0].delta(0)]
        self.calls[0].arguments += text
        return "", [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []


class JsonCallReader:
    """JSON objects of ``{"name", "parameters"}`` (or ``"arguments"``) at ``depth``: 2 for the
    items of vLLM's array under ``required``, 1 for calls written one after another (Llama 3's,
    ``;`` between). Each is a call once its object closes (strings and depth are tracked,
    not the prefix parsed again each token); an object that is no call, text outside the
    objects unless it is only separators, and an object cut short (``max_tokens``) are
    content, as written."""

    _SEPARATORS = frozenset(" \t\r\n,;[]")

    def __init__(self, depth: int, calls: list[ToolCall] | None = None) -> None:
        self.calls: list[ToolCall] = [] if calls is None else calls
        self._item_depth = depth
        self._item: list[str] = []  # the characters of the object being read
        self._gap: list[str] = []  # separators since the last object, held back
        self._prose = False  # whether the text since the last object is content
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas = []
        item_depth = self._item_depth
        for char in text:
            inside = self._depth >= item_depth
            if inside:
                self._item.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                if not inside:
                    content.append(char)  # a string outside the objects: prose already
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == item_depth:
                    self._item = [char]
                    self._gap, self._prose = [], False
                    continue
            elif char in "]}" and (inside or self._depth > 0):
                self._depth -= 1
                if self._depth == item_depth - 1:
                    item, self._item = "".join(self._item), []
                    call = self._call(item)
                    if call is None:
                        content.append(item)
                    else:
                        deltas.append(call.delta(len(self.calls)))
                        self.calls.append(call)
                    continue
            if inside:
                continue
            if self._prose or char not in self._SEPARATORS:
                self._prose = True
                content += self._gap
                self._gap = []
                content.append(char)
            else:
                self._gap.append(char)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "".join(self._item), []

    @staticmethod
    def _call(item: str) -> ToolCall | None:
        """The call an object holds (a format holds the model to one, but it can be left:
        an output that reaches the end token of a complete one ends there)."""
        try:
            call = json.loads(item)
            arguments = call["parameters"] if "parameters" in call else call["arguments"]
            return ToolCall(call["name"], arguments_text(arguments))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None


class Llama3JsonReader:
    """Llama 3.1-3.3's calls: an output that begins with a JSON object (or the
    ``<|python_tag|>`` its template may put first) is calls, ``{"name": ...,
    "parameters": {...}}`` one after another; any other output is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._head = ""  # the output's start, until it tells which it is
        self._json: JsonCallReader | None = None
        self._is_content = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._json is not None:
            return self._json.feed(text)
        if self._is_content:
            return text, []
        self._head += text
        start = self._head.lstrip()
        if start.startswith(("{", self.TAG)):
            self._json = JsonCallReader(1, self.calls)
            return self._json.feed(start.removeprefix(self.TAG))
        if not start or self.TAG.startswith(start):
            return "", []
        self._is_content = True
        head, self._head = self._head, ""
        return head, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._json is not None:
            return self._json.finish()
        head, self._head = self._head, ""
        return head, []


def json_call(block: str) -> ToolCall | None:
    """A hermes block's call: ``{"name": ..., "arguments": {...}}`` (`value_call`)."""
    try:
        return value_call(json.loads(block))
    except (ValueError, RecursionError):  # nested past the parser's depth: a model may write it
        return None


def value_call(call: Any, keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call a JSON value is: ``{"name": ..., "arguments": {...}}`` (the first of ``keys``
    it holds; none: no arguments); arguments written as a JSON string holding an object
    (Granite 4 writes them so) are that object, as vLLM reads them, where encoding them
    again would give clients a string, not a mapping."""
    if not isinstance(call, dict) or type(call.get("name")) is not str:
        return None
    arguments: Any = next((call[key] for key in keys if key in call), {})
    if isinstance(arguments, str):
        arguments = object_or_text(arguments)
    try:
        return ToolCall(call["name"], arguments_text(arguments))
    except (ValueError, RecursionError):
        return None


def array_calls(items: Any, keys: tuple[str, ...] = ("arguments",)) -> list[ToolCall] | None:
    """The calls of a JSON array each item of which is a call (`value_call`); None where
    ``items`` is no such array, or an empty one."""
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        call = value_call(item, keys)
        if call is None:
            return None
        calls.append(call)
    return calls


def object_or_text(text: str) -> Any:
    """The JSON object ``text`` is, else ``text`` itself (any other string stays one)."""
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return found if isinstance(found, dict) else text


def tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
