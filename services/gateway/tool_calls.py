"""OpenAI's tool calls over the chat API: the output each ``tool_choice`` holds the model to,
and the calls read back out of its text, whole or as it streams.

* a named function: the output is that function's arguments, a JSON object of its
  parameters' schema (a structured output);
* ``required``: a JSON array of one or more ``{"name", "parameters"}`` objects, one per call
  (a structured output, vLLM's);
* ``auto``: free text in which the model's own format marks its calls; the parser the
  gateway was started with finds them. ``hermes``: ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, as Qwen2.5, Qwen3 and Hermes models write them; ``llama3_json``:
  an output that is ``{"name": ..., "parameters": {...}}`` objects, as Llama 3.1-3.3 write;
  ``pythonic``: an output that is a Python list of calls, ``[f(a=1), g(b="x")]``, as Llama 3.2
  and 4 write (vLLM's parser of the name); ``qwen3_coder``: Qwen3-Coder's ``<tool_call>
  <function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`` blocks, each
  value read by its parameter's type in the tool's schema (the format's tags in it text, as
  vLLM's parser tells them); ``mistral``: Mistral's
  ``[TOOL_CALLS]`` and a JSON array of calls (its tokenizers before v11) or ``NAME[ARGS]{...}``
  per ``[TOOL_CALLS]`` (v11 on); ``glm45``: GLM-4.5's to 4.7's ``<tool_call>NAME<arg_key>KEY
  </arg_key><arg_value>VALUE</arg_value>...</tool_call>`` blocks; ``openai``: gpt-oss'
  harmony messages (read whole by ``harmony.py``); ``deepseek_v3`` and ``deepseek_v31``:
  DeepSeek's ``<｜tool▁calls▁begin｜>`` calls, V3's and R1's (``function<｜tool▁sep｜>NAME``
  and a fenced JSON block) and V3.1's (``NAME<｜tool▁sep｜>{...}``), either read by both;
  ``kimi_k2``: Kimi K2's ``<|tool_calls_section_begin|>`` calls, ``functions.NAME:N`` (its
  call id) then ``<|tool_call_argument_begin|>{...}``; ``minimax_m2``: MiniMax-M2's ``<minimax:tool_call>`` blocks of one or more ``<invoke
  name="NAME">`` and their ``<parameter name="KEY">VALUE</parameter>``s, read as
  qwen3_coder's; ``granite``: Granite 3's ``<|tool_call|>`` (or 3.0's ``<tool_call>``) and a
  JSON array of ``{"name", "arguments"}`` objects, the whole output; ``phi4_mini_json``:
  Phi-4-mini's ``functools[{"name": ..., "arguments": {...}}, ...]``; ``xlam``: xLAM's JSON
  array of calls, the whole output or in a ```json fence, a ``[TOOL_CALLS]`` line or a
  ``<tool_call>`` block; ``olmo3``: OLMo 3's ``<function_calls>`` blocks, one Python call a
  line, ``f(a=1)``, its values Python's or JSON's literals (``true``, ``null``);
  ``seed_oss``: Seed-OSS' ``<seed:tool_call>`` blocks of qwen3_coder's ``<function=NAME>``,
  read as its (a ``<seed:think>`` thought left in the content holds none); ``hunyuan_a13b``: Hunyuan's ``<tool_calls>`` block of a JSON array of
  ``{"name": ..., "arguments": {...}}`` calls; ``ernie45``: ERNIE 4.5's ``<tool_call>``
  blocks, read as hermes'; ``functiongemma``: FunctionGemma's ``<start_function_call>call:NAME
  {KEY:VALUE,...}<end_function_call>``, a string value between ``<escape>`` tokens, others
  bare. ``qwen3_xml`` and ``glm47`` are vLLM's other names of qwen3_coder and glm45.

A reader takes a choice's text as it streams and returns, per piece, the content to send
and the tool-call deltas (OpenAI's chunk form); reading the whole text at once gives what
the streamed deltas add up to.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "mistral",
    "glm45",
    "glm47",
    "deepseek_v3",
    "deepseek_v31",
    "minimax_m2",
    "kimi_k2",
    "granite",
    "phi4_mini_json",
    "xlam",
    "olmo3",
    "seed_oss",
    "hunyuan_a13b",
    "ernie45",
    "functiongemma",
    "openai",
)
# (qwen3_xml and glm47: vLLM's other names of qwen3_coder's and glm45's; openai: harmony.py)

ToolChoiceKind = Literal["named", "required", "auto"]


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


def _arguments_text(arguments: Any) -> str:
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
            return ToolCall(call["name"], _arguments_text(arguments))
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


class HermesReader:
    """``<tool_call>...</tool_call>`` blocks (or ``tags``') in free text, each read by
    ``parse`` as a call or calls (hermes': ``{"name": ..., "arguments": {...}}``;
    Qwen3-Coder's: `xml_call`). Text before the first call streams as content (less what may
    begin a tag); text between and after calls is content unless it is only whitespace; a
    block that is not such a call, or is cut short, is content as written. With ``nested``
    (Qwen3-Coder's), a start tag opening a line in a block begins one written out in a value
    (a coding agent writing a parser's test), and the end tag that closes it is text of it."""

    def __init__(
        self,
        parse: Callable[[str], ToolCall | list[ToolCall] | None] | None = None,
        tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
        nested: bool = False,
    ) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""
        self._inside = False
        self._parse = parse or json_call
        self._start, self._end = tags
        self._nested = nested
        self._searched = 0  # the block's end tags before this closed blocks in it

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while True:
            if self._inside:
                end = self._block_end()
                if end < 0:
                    break
                self._read(end, content, deltas)
                continue
            start = self._pending.find(self._start)
            if start >= 0:
                content.append(self._outside(self._pending[:start]))
                self._pending = self._pending[start + len(self._start) :]
                self._inside = True
            elif not self.calls:  # stream what cannot begin a tag
                keep = tag_prefix_at_end(self._pending, self._start)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            else:
                break
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest: a last block whose end tag never came (the output ended on its end
        token, or on the end tag as a stop string) is still a call if it holds one; a block
        whose end tags all closed blocks in it (``nested``) is, or else ends at its first."""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._inside and self._end in self._pending and not self._calls(self._pending):
            self._read(self._pending.find(self._end), content, deltas)
            more, found = self.feed("")
            content.append(more)
            deltas += found
        pending, self._pending = self._pending, ""
        if not self._inside:
            return "".join(content) + self._outside(pending), deltas
        calls = self._calls(pending)
        if not calls:
            return "".join(content) + self._start + pending, deltas
        deltas += [call.delta(len(self.calls) + i) for i, call in enumerate(calls)]
        self.calls += calls
        return "".join(content), deltas

    def _block_end(self) -> int:
        """Where the block's end tag is, -1 until it comes (with ``nested``: the first that
        closes no block written out in it)."""
        end = self._pending.find(self._end, self._searched)
        while end >= 0 and self._nested and self._opened(end):
            end = self._pending.find(self._end, end + 1)
        self._searched = end if end >= 0 else max(len(self._pending) - len(self._end) + 1, 0)
        return end

    def _opened(self, end: int) -> bool:
        """Whether a block opening a line before ``end`` in the pending one is still open."""
        opened = self._pending.count("\n" + self._start, 0, end)
        return opened > self._pending.count(self._end, 0, end)

    def _read(self, end: int, content: list[str], deltas: list[dict[str, Any]]) -> None:
        """The block that ends at ``end``: its calls' deltas, or itself as content."""
        block, self._pending = self._pending[:end], self._pending[end + len(self._end) :]
        self._inside, self._searched = False, 0
        calls = self._calls(block)
        if not calls:
            content.append(self._start + block + self._end)
        for call in calls:
            deltas.append(call.delta(len(self.calls)))
            self.calls.append(call)

    def _calls(self, block: str) -> list[ToolCall]:
        found = self._parse(block)
        return [] if found is None else [found] if isinstance(found, ToolCall) else found

    def _outside(self, text: str) -> str:
        return "" if self.calls and not text.strip() else text


class AfterThought:
    """Calls after a thought left in the content: an output that opens (whitespace aside)
    with ``start`` is content up to its ``end``, a call written out in the thought no call
    (vLLM's seed_oss parser reads Seed-OSS' ``<seed:think>`` so, where no reasoning parser
    took it out); the rest, and any other output, is read by ``reader``."""

    def __init__(self, reader: ToolCallReader, start: str, end: str) -> None:
        self._reader = reader
        self.calls = reader.calls  # the one list, which the reader fills
        self._start, self._end = start, end
        self._pending = ""
        self._state = "open"  # then "thought" or "calls"

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._state == "calls":
            return self._reader.feed(text)
        self._pending += text
        if self._state == "open":
            head = self._pending.lstrip()
            if head.startswith(self._start):
                self._state = "thought"
            elif self._start.startswith(head):
                return "", []
            else:
                self._state = "calls"
                pending, self._pending = self._pending, ""
                return self._reader.feed(pending)
        end = self._pending.find(self._end)
        if end < 0:
            keep = tag_prefix_at_end(self._pending, self._end)
            thought = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            return thought, []
        end += len(self._end)
        thought, rest = self._pending[:end], self._pending[end:]
        self._pending, self._state = "", "calls"
        content, deltas = self._reader.feed(rest)
        return thought + content, deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        pending, self._pending = self._pending, ""
        if self._state == "thought":  # cut short in the thought
            return pending, []
        content, deltas = self._reader.feed(pending)
        rest, more = self._reader.finish()
        return content + rest, deltas + more


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
        arguments = _object_or_text(arguments)
    try:
        return ToolCall(call["name"], _arguments_text(arguments))
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


def hunyuan_calls(block: str) -> list[ToolCall] | None:
    """A Hunyuan ``<tool_calls>`` block's calls: a JSON array of ``{"name": ..., "arguments":
    {...}}`` objects (`value_call`); as vLLM's parser, an item that is no call is passed over
    and its siblings kept. None where the block holds no call."""
    try:
        items = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    return [call for item in items if (call := value_call(item)) is not None] or None


def _object_or_text(text: str) -> Any:
    """The JSON object ``text`` is, else ``text`` itself (any other string stays one)."""
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return found if isinstance(found, dict) else text


_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
# A parameter whose </parameter> the model left out ends where the next one begins (vLLM's).
_XML_PARAMETER = re.compile(
    r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
)
_XML_KEY = re.compile(r"\s*<parameter=([^>\s]+)>")
# The tags in a value that pair up: a <parameter=KEY> opening a line (a call written out in
# it, as a coding agent writes a parser's test) and the </parameter> after it.
_XML_VALUE_TAGS = re.compile(r"^<parameter=([^>\s]+)>|</parameter>", re.MULTILINE)


def xml_call(properties: dict[str, Any], block: str) -> ToolCall | None:
    """A Qwen3-Coder block's call: ``<function=NAME>`` and its ``<parameter=KEY>VALUE
    </parameter>``s (each value to its first ``</parameter>``, or where that leaves text
    outside them, to its end as `_xml_parameters` finds it; None where it finds none), each
    value (less the newline that opens and the one that closes it) read by the types
    ``properties[NAME][KEY]`` gives it (`_value_types`), as vLLM's parser reads it: a number
    or boolean by its text, an object or array as JSON or a Python literal (or a JSON string
    of either), ``null`` as null but for a string, anything else (no type given, or a text
    that is of none of its types) as the string written."""
    match = _XML_FUNCTION.fullmatch(block)
    if match is None:
        return None
    name, body = match.groups()
    parameters: list[tuple[str, str]] | None = _XML_PARAMETER.findall(body)
    if _XML_PARAMETER.sub("", body).strip():  # text outside them: a value's own tags, or no call
        parameters = _xml_parameters(body, _xml_keys(properties, name))
    return None if parameters is None else _schema_typed_call(properties, name, parameters)


def _xml_keys(properties: dict[str, Any], name: str) -> set[str] | None:
    """The parameters ``name``'s schema lists; None where it lists none."""
    schema = properties.get(name)
    return set(schema) if isinstance(schema, dict) and schema else None


def _xml_parameters(body: str, keys: set[str] | None) -> list[tuple[str, str]] | None:
    """A function body's (key, text) parameters where a value may hold the format's own
    tags as text, as vLLM's parser reads them: a value ends at its first ``</parameter>``
    that closes no ``<parameter=KEY>`` opening a line in it and is followed by the body's
    end or a parameter of ``keys`` (any, where None); where none does, at the next line that
    opens a parameter of ``keys`` not yet read (its ``</parameter>`` left out). None where a
    value has no end, or there is text outside the parameters."""
    parameters: list[tuple[str, str]] = []
    at = 0
    while body[at:].strip():
        key = _XML_KEY.match(body, at)
        if key is None:
            return None
        read = {k for k, _ in parameters} | {key[1]}
        end, at = _xml_value_end(body, key.end(), keys, read)
        if end < 0:
            return None
        parameters.append((key[1], body[key.end() : end]))
    return parameters


def _xml_value_end(body: str, start: int, keys: set[str] | None, read: set[str]) -> tuple[int, int]:
    """Where the value from ``start`` ends and the text after it begins (`_xml_parameters`);
    -1s where it does not end."""
    depth = 0
    for tag in _XML_VALUE_TAGS.finditer(body, start):
        if tag[1]:
            depth += 1
        elif depth:
            depth -= 1
        else:
            after = _XML_KEY.match(body, tag.end())
            if not body[tag.end() :].strip() or after and (keys is None or after[1] in keys):
                return tag.start(), tag.end()
    for tag in _XML_VALUE_TAGS.finditer(body, start):
        if tag[1] and tag[1] not in read and (keys is None or tag[1] in keys):
            return tag.start(), tag.start()
    return -1, -1


def _schema_typed_call(
    properties: dict[str, Any], name: str, parameters: list[tuple[str, str]]
) -> ToolCall | None:
    """A call of ``name`` with the (key, text) ``parameters``, read as `xml_call` says."""
    # The request's schema, as its client wrote it: any JSON where an object is expected
    # leaves the values untyped.
    schema = properties.get(name)
    arguments = {}
    for key, raw in parameters:
        value = raw.removeprefix("\n").removesuffix("\n")
        spec = schema.get(key) if isinstance(schema, dict) else None
        arguments[key] = _typed(value, _value_types(spec))
    try:
        return ToolCall(name, _arguments_text(arguments))
    except ValueError:  # an object's number past JSON's range
        return None


def _value_types(spec: Any) -> list[str]:
    """The types, null too, a parameter's schema lets its value be, in its order:
    ``type`` (a name or a list of names) and each of ``anyOf``'s or ``oneOf``'s options, as
    Pydantic writes an ``Optional[...]`` field (``{"anyOf": [{"type": "integer"}, {"type":
    "null"}]}``)."""
    if not isinstance(spec, dict):
        return []
    kind = spec.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    for union in ("anyOf", "oneOf"):
        options = spec.get(union)
        for option in options if isinstance(options, list) else []:
            kinds += _value_types(option)
    return [k for k in kinds if isinstance(k, str)]


def _typed(value: str, kinds: list[str]) -> Any:
    """``value`` read as the first of ``kinds`` it is text of, else the text as written;
    ``null`` is null but for a string that cannot be null, and Python's ``None`` is too
    where null may be (Qwen3.5's and 3.6's way of writing it), as vLLM reads them."""
    word = value.strip()
    nullable = "null" in kinds
    if word == "None" and nullable:
        return None
    if word.lower() == "null" and (nullable or kinds[:1] != ["string"]):
        return None
    for kind in kinds:
        try:
            return _as_type(value, kind)
        except (ValueError, RecursionError):
            continue
    return value


def _as_type(value: str, kind: str) -> Any:
    """``value`` read as a ``kind`` (a JSON schema type, or "float" and "int" as some
    clients write them); ValueError where it is not one, or the type is not known."""
    if kind == "string":
        return value
    if kind in ("integer", "int"):
        return int(value.strip())
    if kind in ("number", "float"):
        number = float(value.strip())
        if not math.isfinite(number):
            raise ValueError(value)
        return int(number) if number.is_integer() and "." not in value else number
    if kind == "boolean":
        return value.strip().lower() == "true"
    if kind in ("object", "array"):
        try:
            found = json.loads(value)
        except ValueError:  # a Python literal, {'k': 'v'}, as vLLM reads it too
            found = _literal_value(value.strip())
        if not isinstance(found, str):
            return found
        try:  # its text written as a string (a template's json.dumps of it)
            return _literal_value(found)
        except ValueError:
            return found
    raise ValueError(kind)


_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>\s*', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def minimax_calls(properties: dict[str, Any], block: str) -> list[ToolCall] | None:
    """A MiniMax-M2 block's calls: ``<invoke name="NAME">`` and its ``<parameter
    name="KEY">VALUE</parameter>``s each, the values read as `xml_call` reads them; None
    where the block holds anything else, or no call."""
    invokes = list(_MINIMAX_INVOKE.finditer(block))
    if not invokes or "".join(m.group(0) for m in invokes) != block:
        return None
    calls = []
    for invoke in invokes:
        name, body = invoke.groups()
        if _MINIMAX_PARAMETER.sub("", body).strip():
            return None  # text outside the parameters: not a call
        call = _schema_typed_call(properties, name, _MINIMAX_PARAMETER.findall(body))
        if call is None:
            return None
        calls.append(call)
    return calls


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm_call(properties: dict[str, Any], block: str) -> ToolCall | None:
    """A GLM-4.5 to 4.7 block's call: the function's name, then ``<arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>`` pairs (4.5 and 4.6 write newlines between, 4.7 none),
    each value read as vLLM's glm45 parser reads it: as written, its whitespace too (code's
    indent), where the tool's schema says string, else (stripped) as JSON, else as a Python
    literal, else as written."""
    head, tag, rest = block.partition("<arg_key>")
    name, body = head.strip(), tag + rest
    if not name or any(c.isspace() or c == "<" for c in name):
        return None
    if _GLM_ARGUMENT.sub("", body).strip():
        return None  # text outside the arguments: not a call
    schema = properties.get(name)
    arguments = {}
    for raw_key, raw_value in _GLM_ARGUMENT.findall(body):
        key = raw_key.strip()
        spec = schema.get(key) if isinstance(schema, dict) else None
        string = isinstance(spec, dict) and spec.get("type") == "string"
        arguments[key] = raw_value if string else _literal(raw_value.strip())
    return ToolCall(name, _arguments_text(arguments))


def _literal(value: str) -> Any:
    """`_literal_value`, else the text itself."""
    try:
        return _literal_value(value)
    except ValueError:
        return value


def _literal_value(value: str) -> Any:
    """``value`` as JSON, else as a Python literal (``True``, ``None``, ``'single quoted'``),
    if what it reads as has a JSON text; ValueError where it is neither."""
    for read in (json.loads, ast.literal_eval):
        try:
            found = read(value)
            _arguments_text(found)
            return found
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    raise ValueError(value)


_GEMMA_CALL = re.compile(r"\s*call:([\w.-]+)(\{.*\})\s*", re.DOTALL)
_GEMMA_ESCAPE = "<escape>"  # FunctionGemma's string delimiter, a token of its own


def functiongemma_call(properties: dict[str, Any], block: str) -> ToolCall | None:
    """A FunctionGemma block's call: ``call:NAME{KEY:VALUE,...}``, the values in its chat
    template's notation: a string between ``<escape>`` tokens, a number, boolean or null
    bare, an object ``{KEY:VALUE,...}``, an array ``[VALUE,...]``. A string argument whose
    parameter the tool's schema types otherwise (a number the model escaped) is read by
    those types, as `xml_call` reads its values. None where the block is other text."""
    match = _GEMMA_CALL.fullmatch(block)
    if match is None:
        return None
    name, body = match.groups()
    try:
        arguments, end = _gemma_value(body, 0)
    except (ValueError, RecursionError):
        return None
    if end != len(body):
        return None
    schema = properties.get(name)
    for key, value in arguments.items():
        spec = schema.get(key) if isinstance(schema, dict) else None
        kinds = _value_types(spec)
        if isinstance(value, str) and kinds:
            arguments[key] = _typed(value, kinds)
    try:
        return ToolCall(name, _arguments_text(arguments))
    except ValueError:
        return None


def _gemma_value(text: str, at: int) -> tuple[Any, int]:
    """The value FunctionGemma's notation (`functiongemma_call`) writes at ``text[at:]``, and
    where it ends; ValueError where none is."""
    at = _gemma_space_end(text, at)
    if text.startswith(_GEMMA_ESCAPE, at):
        start = at + len(_GEMMA_ESCAPE)
        end = text.find(_GEMMA_ESCAPE, start)
        if end < 0:
            raise ValueError("a string never closed")
        return text[start:end], end + len(_GEMMA_ESCAPE)
    if text.startswith(("{", "["), at):
        keyed = text[at] == "{"
        close = "}" if keyed else "]"
        items: list[tuple[str | None, Any]] = []
        at = _gemma_space_end(text, at + 1)
        while not text.startswith(close, at):
            if items:
                if not text.startswith(",", at):
                    raise ValueError("no separator")
                at += 1
            key = None
            if keyed:
                key, at = _gemma_key(text, at)
            value, at = _gemma_value(text, at)
            items.append((key, value))
            at = _gemma_space_end(text, at)
        if keyed:
            return {key: value for key, value in items}, at + 1
        return [value for _, value in items], at + 1
    end = at
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[at:end].strip()
    if not word or _GEMMA_ESCAPE in word:
        raise ValueError("no value")
    return _literal(word), end  # a bare word that is no literal is a string as written


def _gemma_key(text: str, at: int) -> tuple[str, int]:
    """An object's key, bare (as calls write them) or between ``<escape>`` tokens (as
    declarations do), and where its ``:`` ends."""
    if text.startswith(_GEMMA_ESCAPE, _gemma_space_end(text, at)):
        key, at = _gemma_value(text, at)
        at = _gemma_space_end(text, at)
        if not text.startswith(":", at):
            raise ValueError("a key without its value")
        return key, at + 1
    colon = text.find(":", at)
    key = text[at:colon].strip() if colon >= 0 else ""
    if not key or any(c in key for c in ",{}[]<"):
        raise ValueError("no key")
    return key, colon + 1


def _gemma_space_end(text: str, at: int) -> int:
    """Where the whitespace at ``text[at:]`` ends."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class LeadingListReader:
    """An output that is calls as a whole: one that begins with ``[`` (after any of
    ``OPENERS``, the markers its format may put first, in their order) is held until the
    output ends, then read by the subclass's ``_calls`` (each call one delta then); one in
    which ``_calls`` finds none, and any other output, is content as written."""

    OPENERS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""
        self._is_content = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._is_content:
            return text, []
        self._text += text
        rest = self._after_openers(self._text)
        if not rest or rest.startswith("[") or any(o.startswith(rest) for o in self.OPENERS):
            return "", []  # held until the end, when the list is read whole
        self._is_content = True
        text, self._text = self._text, ""
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._text = self._text, ""
        calls = None if self._is_content else self._calls(self._after_openers(text))
        if calls is None:
            return text, []
        self.calls += calls
        return "", [call.delta(i) for i, call in enumerate(calls)]

    def _after_openers(self, text: str) -> str:
        """``text`` less its leading whitespace and the openers it begins with."""
        rest = text.lstrip()
        for opener in self.OPENERS:
            if rest.startswith(opener):
                rest = rest[len(opener) :].lstrip()
        return rest

    @classmethod
    def _calls(cls, source: str) -> list[ToolCall] | None:
        raise NotImplementedError


class GraniteReader(LeadingListReader):
    """Granite 3's calls: an output that is ``<|tool_call|>`` (a special token from 3.1 on)
    or ``<tool_call>`` (3.0) and a JSON array of ``{"name", "arguments"}`` objects, or the
    array alone; as vLLM's parser, an array with an item that is no call, or cut short, and
    text before the marker or after the array make the output content as written."""

    OPENERS = ("<|tool_call|>", "<tool_call>")

    @classmethod
    def _calls(cls, source: str) -> list[ToolCall] | None:
        try:
            return array_calls(json.loads(source))
        except (ValueError, RecursionError):
            return None


class PythonicReader(LeadingListReader):
    """Llama 3.2's and 4's calls: an output that begins with ``[`` (or Llama 4's
    ``<|python_start|>``) is a Python list of calls with keyword arguments of literal values,
    read when the output ends (each call one delta then); one that does not parse so, and
    any other output, is content as written."""

    OPENERS, END = ("<|python_start|>",), "<|python_end|>"

    # Where one call in the list is not Python (a broken quote), the list is cut into its
    # calls at each ")," that a name and "(" follow, each then read alone.
    _CALL_BOUNDARY = re.compile(r"\)\s*,\s*(?=[A-Za-z_]\w*\s*\()")

    @classmethod
    def _calls(cls, source: str) -> list[ToolCall] | None:
        """The list's calls; as vLLM's parser, a call with no JSON text for its arguments
        (bytes, an infinite number, positional ones) or that is no Python is passed over
        and its siblings kept. None where no call is left, or the text is no list of calls."""
        source = source.strip().removesuffix(cls.END).strip()
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            nodes = cls._parsable_calls(source)
        else:
            if not isinstance(tree, ast.List) or not all(
                isinstance(n, ast.Call) for n in tree.elts
            ):
                return None
            nodes = tree.elts
        calls = [call for node in nodes if (call := cls._call(node)) is not None]
        return calls or None

    @classmethod
    def _parsable_calls(cls, source: str) -> list[ast.expr]:
        """The calls of a list that is no Python as a whole which are, each alone."""
        if not (source.startswith("[") and source.endswith("]")):
            return []
        pieces = cls._CALL_BOUNDARY.split(source[1:-1])
        nodes: list[ast.expr] = []
        for i, piece in enumerate(pieces):
            try:
                node = ast.parse(piece if i == len(pieces) - 1 else piece + ")", mode="eval")
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                continue
            if isinstance(node.body, ast.Call):
                nodes.append(node.body)
        return nodes

    @staticmethod
    def _call(node: ast.expr) -> ToolCall | None:
        """The call ``node`` is, of keyword arguments of literal values that have JSON text."""
        if (
            not isinstance(node, ast.Call)
            or not isinstance(node.func, ast.Name)
            or node.args
            or any(kw.arg is None for kw in node.keywords)
        ):
            return None
        try:
            arguments = {kw.arg: _python_literal(kw.value) for kw in node.keywords}
            return ToolCall(node.func.id, _arguments_text(arguments))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id not in _JSON_NAMES:
            return node
        return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)


def _python_literal(node: ast.expr) -> Any:
    """The value of a literal, JSON's ``true``, ``false`` and ``null`` read too: OLMo 3 writes
    them in its calls, and vLLM's pythonic parsers read them so."""
    return ast.literal_eval(_JsonNames().visit(node))


def olmo3_calls(block: str) -> list[ToolCall] | None:
    """An OLMo 3 ``<function_calls>`` block's calls: one Python call a line, read as the
    items of a pythonic list (`PythonicReader`), so a call that is no Python or has no JSON
    text for its arguments is passed over and the others kept; None where no call is left,
    or a line is other text."""
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    return PythonicReader._calls("[" + ", ".join(lines) + "]") if lines else None


class CallsAfterTag:
    """The part of a reader whose calls follow a first ``TAG``: text before it streams as
    content (less what may begin it); everything after it waits in ``_tail`` for the
    subclass's ``finish`` to read when the output ends."""

    TAG = ""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""  # content that may begin the tag
        self._tail: str | None = None  # the text after the first tag

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._tail is not None:
            self._tail += text
            return "", []
        self._pending += text
        at = self._pending.find(self.TAG)
        if at >= 0:
            content, self._tail = self._pending[:at], self._pending[at + len(self.TAG) :]
            self._pending = ""
            return content, []
        keep = tag_prefix_at_end(self._pending, self.TAG)
        content = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return content, []

    def _unread(self) -> str:
        """What was held back as maybe the tag's start, when the output ends without it."""
        pending, self._pending = self._pending, ""
        return pending


class MistralReader(CallsAfterTag):
    """Mistral's calls, after its ``[TOOL_CALLS]`` token: a JSON array of ``{"name",
    "arguments"}`` objects, as its tokenizers before v11 have the model write them, or
    ``NAME[ARGS]{...}``, one call per ``[TOOL_CALLS]``, as v11 and later (Mistral Small 3.2,
    Devstral, Magistral). Text before the first tag streams as content (less what may begin
    it); what follows is read when the output ends, each call one delta then; from the first
    tag whose text is no call (cut short by ``max_tokens``), the rest is content: as written
    for v11's form, less the tag and the whitespace around for the JSON form (vLLM's). Each
    call's id is 9 letters and digits, the only ids Mistral's chat templates take back."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._tail is None:
            return self._unread(), []
        segments = self._tail.split(self.TAG)
        for i, segment in enumerate(segments):
            calls = self._segment_calls(segment)
            if calls is None:  # cut short (max_tokens) or not a call: content from here
                deltas = [call.delta(n) for n, call in enumerate(self.calls)]
                rest = self.TAG.join(segments[i:])
                return (self.TAG + rest if self.ARGS in segment else rest.strip()), deltas
            self.calls += calls
        return "", [call.delta(n) for n, call in enumerate(self.calls)]

    @classmethod
    def _segment_calls(cls, segment: str) -> list[ToolCall] | None:
        """The calls of the text after one tag: v11's ``NAME[ARGS]{...}``, or a JSON array
        (or object) of calls; None if it holds none."""
        name, args, arguments = segment.partition(cls.ARGS)
        try:
            if args:
                items = [{"name": name.strip(), "arguments": json.loads(arguments)}]
            else:
                items = _leading_json(segment)
                items = items if isinstance(items, list) else [items]
            calls = []
            for item in items:
                if (
                    not isinstance(item, dict)
                    or not isinstance(item.get("name"), str)
                    or not item["name"]
                    or not isinstance(item.get("arguments", {}), dict)
                ):
                    return None
                arguments_text = _arguments_text(item.get("arguments", {}))
                calls.append(ToolCall(item["name"], arguments_text, _mistral_call_id()))
        except (ValueError, RecursionError):
            return None
        return calls or None


class Phi4MiniReader(CallsAfterTag):
    """Phi-4-mini's calls: ``functools`` and a JSON array of ``{"name", "arguments"}`` (or
    ``"parameters"``) objects, as vLLM's phi4_mini_json chat template asks for them. Text
    before the marker streams as content (less what may begin it); the array is read when
    the output ends, each call one delta then, text after it passed over (vLLM's); an
    array with an item that is no call, or cut short, leaves the rest content as written."""

    TAG = "functools["

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._tail is None:
            return self._unread(), []
        try:
            calls = array_calls(_leading_json("[" + self._tail), ("arguments", "parameters"))
        except (ValueError, RecursionError):
            calls = None
        if calls is None:
            return self.TAG + self._tail, []
        self.calls += calls
        return "", [call.delta(n) for n, call in enumerate(calls)]


class XlamReader:
    """xLAM's calls: a JSON array of ``{"name", "arguments"}`` objects, the whole output
    (as xLAM-2's chat template writes them), or in a block: a json code fence (or a bare
    fence the array opens), a ``[TOOL_CALLS]`` line or a ``<tool_call>...</tool_call>``;
    after a ``</think>`` (the thought left in the content) the text is read anew. Text
    before the first block streams as content (less what may begin one); from there the
    output is held and read when it ends, as vLLM's xlam parser reads it: the first block
    that is JSON, the kinds tried in that order, gives the calls (items that are no call
    passed over) and the text around the blocks of its kind, stripped, the content; where
    no call is found, the rest is content as written."""

    STARTS = ("```json", "```\n[", "[TOOL_CALLS]", "<tool_call>")
    THINK_END = "</think>"
    BLOCKS = (
        re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL),
        re.compile(r"\[TOOL_CALLS\](.*?)(?=\n|$)", re.DOTALL),
        re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL),
    )

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pending = ""  # content that may begin a block or a </think>
        self._at_start = True  # at the output's start, or just after a </think>
        self._tail: str | None = None  # from where calls may stand to the end

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._tail is not None:
            self._tail += text
            return "", []
        self._pending += text
        content = []
        while True:
            if self._at_start:
                head = self._pending.lstrip()
                if not head:
                    break
                self._at_start = False
                if head.startswith("["):
                    self._tail, self._pending = self._pending, ""
                    break
            marks = (*self.STARTS, self.THINK_END)
            found = [(at, mark) for mark in marks if (at := self._pending.find(mark)) >= 0]
            if not found:
                keep = max(tag_prefix_at_end(self._pending, mark) for mark in marks)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            at, mark = min(found)
            if mark != self.THINK_END:
                content.append(self._pending[:at])
                self._tail, self._pending = self._pending[at:], ""
                break
            end = at + len(mark)
            content.append(self._pending[:end])
            self._pending, self._at_start = self._pending[end:], True
        return "".join(content), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        pending, self._pending = self._pending, ""
        if self._tail is None:
            return pending, []
        calls, rest = self._read(self._tail)
        if not calls:
            return self._tail, []
        self.calls += calls
        return rest, [call.delta(n) for n, call in enumerate(calls)]

    @classmethod
    def _read(cls, tail: str) -> tuple[list[ToolCall], str]:
        """The calls ``tail`` holds, and the text around them."""
        found = cls._block(tail)
        if found is None:
            try:
                found = json.loads(tail), ""
            except (ValueError, RecursionError):
                return [], ""
        items, rest = found
        if not isinstance(items, list):
            return [], ""
        return [call for item in items if (call := value_call(item)) is not None], rest.strip()

    @classmethod
    def _block(cls, tail: str) -> tuple[Any, str] | None:
        """The JSON value of the first block (of the first kind, in order) that is JSON,
        and the text less the blocks of its kind; None where no block is."""
        for block in cls.BLOCKS:
            for match in block.finditer(tail):
                try:
                    return json.loads(match.group(1)), block.sub("", tail)
                except (ValueError, RecursionError):
                    continue
        return None


def _leading_json(text: str) -> Any:
    """The JSON value ``text`` begins with, text after it passed over; else the widest
    ``[{...}]`` in it (vLLM's pre-v11 Mistral parser reads the calls so). ValueError where
    neither is JSON."""
    text = text.strip()
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        start, end = text.find("[{"), text.rfind("}]")
        if start < 0 or end < start + 2:
            raise
        return json.loads(text[start : end + 2])


class MarkedCallsReader(CallsAfterTag):
    """Calls in a section that opens with ``TAG`` (and may close with an end marker), one
    ``CALL`` ... ``CALL_END`` block per call, each read by the subclass's ``_call``; the
    markers are special tokens. Text before the section streams as content (less what may
    begin it); the calls are read when the output ends, each one delta then. As vLLM's
    parsers, a block that is no call (or is cut short by ``max_tokens``) is passed over, and
    the content is the text before the section: what follows it, its end marker too, is
    not; a section without a call is content as written."""

    CALL = CALL_END = ""

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._tail is None:
            return self._unread(), []
        for block in self._blocks(self._tail):
            call = self._call(block)
            if call is not None:
                self.calls.append(call)
        if not self.calls:
            return self.TAG + self._tail, []
        return "", [call.delta(n) for n, call in enumerate(self.calls)]

    @classmethod
    def _blocks(cls, section: str) -> list[str]:
        """The text of each ``CALL`` ... ``CALL_END`` block; one that another ``CALL`` or
        the output's end cuts short is none."""
        cut = [piece.partition(cls.CALL_END) for piece in section.split(cls.CALL)[1:]]
        return [block for block, end, _ in cut if end]

    @classmethod
    def _call(cls, block: str) -> ToolCall | None:
        raise NotImplementedError


class DeepSeekReader(MarkedCallsReader):
    """DeepSeek's calls: after ``<｜tool▁calls▁begin｜>``, one ``<｜tool▁call▁begin｜>...
    <｜tool▁call▁end｜>`` per call, V3's and R1's ``function<｜tool▁sep｜>NAME`` then a fenced
    JSON block of arguments, V3.1's ``NAME<｜tool▁sep｜>{...}``."""

    TAG = "<｜tool▁calls▁begin｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _V3 = re.compile(r"function" + SEP + r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)

    @classmethod
    def _call(cls, block: str) -> ToolCall | None:
        v3 = cls._V3.fullmatch(block)
        name, _, arguments = block.partition(cls.SEP)
        if v3 is not None:
            name, arguments = v3.groups()
        elif not _:
            return None
        name = name.strip()
        return _object_call(name, arguments) if name else None


class KimiK2Reader(MarkedCallsReader):
    """Kimi K2's calls: after ``<|tool_calls_section_begin|>``, one ``<|tool_call_begin|>
    functions.NAME:N<|tool_call_argument_begin|>{...}<|tool_call_end|>`` per call. The call's
    id is the text before its arguments, ``functions.NAME:N``, which Kimi's chat template
    writes back in the call and in the tool's answer."""

    TAG = "<|tool_calls_section_begin|>"
    CALL, CALL_END, ARGS = (
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        "<|tool_call_argument_begin|>",
    )

    _ID = re.compile(r"(?:functions\.)?(.+):\d+")

    @classmethod
    def _call(cls, block: str) -> ToolCall | None:
        """The block's call; arguments that are no JSON object are kept as written (vLLM's
        parser passes them on), a call whose id is not ``NAME:N`` is none."""
        call_id, args, arguments = block.partition(cls.ARGS)
        call_id = call_id.strip()
        valid = cls._ID.fullmatch(call_id)
        if not args or valid is None:
            return None
        name = valid.group(1)
        return _object_call(name, arguments, call_id) or ToolCall(name, arguments.strip(), call_id)


def _object_call(name: str, arguments: str, call_id: str | None = None) -> ToolCall | None:
    """A call of ``name`` whose arguments are the JSON object ``arguments`` holds; None where
    it holds none: malformed, nested past the parser's depth, or with a number JSON has no
    text for (a model may write any of them)."""
    try:
        parsed = json.loads(arguments)
        if not isinstance(parsed, dict):
            return None
        text = _arguments_text(parsed)
    except (ValueError, RecursionError):
        return None
    return ToolCall(name, text) if call_id is None else ToolCall(name, text, call_id)


def _mistral_call_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How a chat request's output holds tool calls."""

    kind: ToolChoiceKind
    name: str | None = None  # the named function's
    parser: str | None = None  # auto's: one of TOOL_CALL_PARSERS (None: the server has none)
    # Each tool's parameters' schemas by name, which qwen3_coder (seed_oss, minimax_m2),
    # glm45 and functiongemma read values by.
    properties: dict[str, Any] = field(default_factory=dict)

    def reader(self) -> ToolCallReader:
        if self.kind == "named":
            assert self.name is not None
            return NamedCallReader(self.name)
        if self.kind == "required":
            return JsonCallReader(2)
        if self.parser in ("hermes", "ernie45"):
            return HermesReader()
        if self.parser in ("qwen3_coder", "qwen3_xml"):
            return self._xml_reader(("<tool_call>", "</tool_call>"))
        if self.parser == "seed_oss":
            calls = self._xml_reader(("<seed:tool_call>", "</seed:tool_call>"))
            return AfterThought(calls, "<seed:think>", "</seed:think>")
        if self.parser == "hunyuan_a13b":
            return HermesReader(hunyuan_calls, ("<tool_calls>", "</tool_calls>"))
        if self.parser in ("glm45", "glm47"):
            return HermesReader(functools.partial(glm_call, self.properties))
        if self.parser == "olmo3":
            return HermesReader(olmo3_calls, ("<function_calls>", "</function_calls>"))
        if self.parser == "functiongemma":
            tags = ("<start_function_call>", "<end_function_call>")
            return HermesReader(functools.partial(functiongemma_call, self.properties), tags)
        if self.parser == "minimax_m2":
            tags = ("<minimax:tool_call>", "</minimax:tool_call>")
            return HermesReader(functools.partial(minimax_calls, self.properties), tags)
        if self.parser == "mistral":
            return MistralReader()
        if self.parser in ("deepseek_v3", "deepseek_v31"):
            return DeepSeekReader()
        if self.parser == "kimi_k2":
            return KimiK2Reader()
        if self.parser == "granite":
            return GraniteReader()
        if self.parser == "phi4_mini_json":
            return Phi4MiniReader()
        if self.parser == "xlam":
            return XlamReader()
        return PythonicReader() if self.parser == "pythonic" else Llama3JsonReader()

    def _xml_reader(self, tags: tuple[str, str]) -> HermesReader:
        """Qwen3-Coder's blocks in ``tags``."""
        return HermesReader(functools.partial(xml_call, self.properties), tags, nested=True)

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (not when a named function
        was forced), unless the output was cut short."""
        if reason == "stop" and calls and self.kind != "named":
            return "tool_calls"
        return reason
