"""Calls after a marker that opens them, read when the output ends: Mistral's
``[TOOL_CALLS]``, Phi-4-mini's ``functools[...]``, xLAM's JSON array (bare, fenced or tagged),
and DeepSeek's and Kimi K2's sections of special-token-delimited calls."""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from weir.services.gateway.json_calls import (
    ToolCall,
    arguments_text,
    array_calls,
    tag_prefix_at_end,
    value_call,
)


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
                arguments = arguments_text(item.get("arguments", {}))
                calls.append(ToolCall(item["name"], arguments, _mistral_call_id()))
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
        text = arguments_text(parsed)
    except (ValueError, RecursionError):
        return None
    return ToolCall(name, text) if call_id is None else ToolCall(name, text, call_id)


def _mistral_call_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
