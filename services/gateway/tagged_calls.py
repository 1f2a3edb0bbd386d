"""Calls in blocks between a format's tags, read once a block's end tag arrives: hermes'
``<tool_call>{...}</tool_call>`` and the formats of the same shape (ERNIE's, Hunyuan's,
OLMo 3's tags), Qwen3-Coder's and Seed-OSS' ``<function=NAME><parameter=KEY>`` blocks,
MiniMax-M2's ``<invoke>`` blocks, GLM's ``<arg_key>``/``<arg_value>`` pairs and FunctionGemma's
``call:NAME{...}``, the last four's values typed by the tool's schema, and Gemma 4's
``call:NAME{...}`` in FunctionGemma's notation with its own string token."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weir.services.gateway.json_calls import (
    ToolCall,
    ToolCallReader,
    arguments_text,
    json_call,
    tag_prefix_at_end,
    value_call,
)


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
        return ToolCall(name, arguments_text(arguments))
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
    return ToolCall(name, arguments_text(arguments))


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
            arguments_text(found)
            return found
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    raise ValueError(value)


_GEMMA_CALL = re.compile(r"\s*call:([\w.-]+)(\{.*\})\s*", re.DOTALL)


def _gemma4_bare(word: str) -> Any:
    """A value Gemma 4 writes bare, as vLLM's gemma4 parser reads it: ``true`` or ``false``,
    a null (``null``, ``none`` or ``nil``, in any case), a number (a float where it holds a
    ".", else an integer), else the text as written."""
    if word in ("true", "false"):
        return word == "true"
    if word.lower() in ("null", "none", "nil"):
        return None
    try:
        return float(word) if "." in word else int(word)
    except ValueError:
        return word


@dataclass(frozen=True, slots=True)
class GemmaNotation:
    """The notation Gemma's templates write a call in, ``call:NAME{KEY:VALUE,...}``: a
    string between two ``quote`` tokens, a number, boolean or null bare (read by ``bare``),
    an object ``{KEY:VALUE,...}``, an array ``[VALUE,...]``."""

    quote: str
    bare: Callable[[str], Any]

    def call(self, block: str) -> tuple[str, dict[str, Any]] | None:
        """A block's function name and arguments; None where the block is other text."""
        match = _GEMMA_CALL.fullmatch(block)
        if match is None:
            return None
        name, body = match.groups()
        try:
            arguments, end = self._value(body, 0)
        except (ValueError, RecursionError):
            return None
        return (name, arguments) if end == len(body) else None

    def _value(self, text: str, at: int) -> tuple[Any, int]:
        """The value written at ``text[at:]``, and where it ends; ValueError where none is."""
        at = _space_end(text, at)
        if text.startswith(self.quote, at):
            start = at + len(self.quote)
            end = text.find(self.quote, start)
            if end < 0:
                raise ValueError("a string never closed")
            return text[start:end], end + len(self.quote)
        if text.startswith(("{", "["), at):
            keyed = text[at] == "{"
            close = "}" if keyed else "]"
            items: list[tuple[str | None, Any]] = []
            at = _space_end(text, at + 1)
            while not text.startswith(close, at):
                if items:
                    if not text.startswith(",", at):
                        raise ValueError("no separator")
                    at += 1
                key = None
                if keyed:
                    key, at = self._key(text, at)
                value, at = self._value(text, at)
                items.append((key, value))
                at = _space_end(text, at)
            if keyed:
                return {key: value for key, value in items}, at + 1
            return [value for _, value in items], at + 1
        end = at
        while end < len(text) and text[end] not in ",}]":
            end += 1
        word = text[at:end].strip()
        if not word or self.quote in word:
            raise ValueError("no value")
        return self.bare(word), end

    def _key(self, text: str, at: int) -> tuple[str, int]:
        """An object's key, bare (as calls write them) or quoted (as declarations do), and
        where its ``:`` ends."""
        if text.startswith(self.quote, _space_end(text, at)):
            key, at = self._value(text, at)
            at = _space_end(text, at)
            if not text.startswith(":", at):
                raise ValueError("a key without its value")
            return key, at + 1
        colon = text.find(":", at)
        key = text[at:colon].strip() if colon >= 0 else ""
        if not key or any(c in key for c in ",{}[]<"):
            raise ValueError("no key")
        return key, colon + 1


# FunctionGemma's string delimiter is its <escape> token, a bare word read as `_literal`.
FUNCTIONGEMMA = GemmaNotation("<escape>", _literal)
# Gemma 4's is its <|"|> token.
GEMMA4 = GemmaNotation('<|"|>', _gemma4_bare)


def functiongemma_call(properties: dict[str, Any], block: str) -> ToolCall | None:
    """A FunctionGemma block's call, in its chat template's notation (`FUNCTIONGEMMA`). A
    string argument whose parameter the tool's schema types otherwise (a number the model
    escaped) is read by those types, as `xml_call` reads its values. None where the block
    is other text."""
    found = FUNCTIONGEMMA.call(block)
    if found is None:
        return None
    name, arguments = found
    schema = properties.get(name)
    for key, value in arguments.items():
        spec = schema.get(key) if isinstance(schema, dict) else None
        kinds = _value_types(spec)
        if isinstance(value, str) and kinds:
            arguments[key] = _typed(value, kinds)
    return _gemma_tool_call(name, arguments)


def gemma4_call(block: str) -> ToolCall | None:
    """A Gemma 4 block's call, in its notation (`GEMMA4`), each string as written whatever
    the tool's schema says (vLLM's gemma4 parser reads no schema). None where the block is
    other text."""
    found = GEMMA4.call(block)
    return None if found is None else _gemma_tool_call(*found)


def _gemma_tool_call(name: str, arguments: dict[str, Any]) -> ToolCall | None:
    try:
        return ToolCall(name, arguments_text(arguments))
    except ValueError:  # a number past JSON's range
        return None


def _space_end(text: str, at: int) -> int:
    """Where the whitespace at ``text[at:]`` ends."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at
