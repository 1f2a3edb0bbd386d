"""Outputs that are a list of calls, read when the output ends: Llama 3.2's and 4's Python
list ``[f(a=1), g(b="x")]``, Granite 3's JSON array after ``<|tool_call|>``, and OLMo 3's
lines of Python calls (in its tagged blocks)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from weir.services.gateway.json_calls import ToolCall, arguments_text, array_calls


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
            return ToolCall(node.func.id, arguments_text(arguments))
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
