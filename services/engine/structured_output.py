"""Structured outputs (vLLM's): a request's output held to a JSON schema, any JSON object, a
regular expression, a list of choices or an EBNF grammar.

xgrammar compiles the constraint against the model's vocabulary once per distinct spec (its
compiler caches them) and gives each request a matcher: before a step that samples for the
request, the matcher's bitmask of the tokens allowed next travels in the step plan and the
executor masks every other token; after the step, the sampled token advances the matcher.
The end tokens are allowed only where the constraint is complete, so a request ends, on its
end token, with an output the constraint accepts (unless ``max_tokens`` cuts it short).
Speculative drafts are cut to the longest prefix the constraint allows (``allowed_drafts``),
and a step that verifies them carries a mask per position: after each draft, as if it were
accepted (the matcher advances through them and rolls back).
With a ``reasoning_end`` token (a thinking model's ``</think>``), the output is free until
that token and held to the constraint after it, as vLLM treats reasoning models.
xgrammar is imported on the first such request (a few seconds, in the tokenizer thread).
A JSON schema is checked first for what xgrammar 0.2.9 would drop without a word
(``check_json_schema``): such a request is refused, as vLLM's xgrammar backend refuses it,
rather than answered with output the schema does not accept.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from itertools import takewhile
from typing import Any

from weir.shared.sampling import STRUCTURED_OUTPUT_KINDS
from weir.shared.tokenizer import Tokenizer

_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class RequestGrammar:
    """One request's place in its constraint (see ``Scheduler``: ``allowed_drafts`` for the
    drafts proposed, ``bitmask`` before a step that samples for it, ``accept`` for each token
    sampled)."""

    __slots__ = ("_matcher", "_bitmask", "_reasoning_end")

    def __init__(self, matcher: Any, bitmask: Any, reasoning_end: int | None = None) -> None:
        self._matcher, self._bitmask = matcher, bitmask
        self._reasoning_end = reasoning_end  # None once the constraint holds

    def bitmask(self, drafts: Sequence[int] = ()) -> bytes | None:
        """The tokens allowed next, bit ``t % 32`` of little-endian int32 word ``t // 32``,
        and for a step that verifies ``drafts`` (``allowed_drafts``' own) the tokens allowed
        after each of them, one such mask a position, concatenated; None while the model
        reasons (any token: its drafts then hold no reasoning end)."""
        if self._reasoning_end is not None:
            return None
        masks = [self._next_mask()]
        for token in drafts:
            if not self._matcher.accept_token(token):
                raise ValueError(f"draft token {token} breaks the structured output")
            masks.append(self._next_mask())
        if drafts:
            self._matcher.rollback(len(drafts))
        return b"".join(masks)

    def allows_any(self, token_ids: Sequence[int]) -> bool:
        """Whether one of ``token_ids`` may come next (any may while the model reasons)."""
        mask = self.bitmask()
        if mask is None:
            return True
        return any(
            int.from_bytes(mask[t // 32 * 4 : t // 32 * 4 + 4], "little") >> (t % 32) & 1
            for t in token_ids
        )

    def allowed_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of ``drafts`` the constraint allows from here, short of an end
        token (after which no position has a mask); while the model reasons, the drafts
        before its reasoning end."""
        if self._reasoning_end is not None:
            return list(takewhile(self._reasoning_end.__ne__, drafts))
        matcher = self._matcher
        accepted, ended = 0, False
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                ended = True  # an end token: the step samples one itself where allowed
                break
        if accepted:
            matcher.rollback(accepted)
        return list(drafts[: accepted - ended])

    def _next_mask(self) -> bytes:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return bytes(self._bitmask.numpy().astype("<i4", copy=False).tobytes())

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the constraint does not allow it there."""
        if self._reasoning_end is not None:
            if token_id == self._reasoning_end:
                self._reasoning_end = None
            return True
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """Whether an end token completed the output."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles requests' constraints for one model (thread-safe; built on first use)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._xgr: Any = None

    def matcher(self, spec: dict[str, Any]) -> RequestGrammar:
        """A new matcher for ``spec`` (``SamplingParams.structured_output``); ValueError
        says what xgrammar could not compile."""
        [(kind, value)] = [(k, v) for k, v in spec.items() if k in STRUCTURED_OUTPUT_KINDS]
        if kind == "json":
            check_json_schema(value)
        compiler, xgr = self._ready()
        any_whitespace = not spec.get("disable_any_whitespace", False)
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(value, any_whitespace=any_whitespace)
            elif kind == "json_object":
                # An object, as OpenAI's JSON mode promises (xgrammar's built-in JSON grammar
                # takes any value: an array too).
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(value)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(value))
            else:
                compiled = compiler.compile_grammar(value)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) for a bad spec
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            # Its messages begin with a time and its source file: "[20:50:13] x.cc:94: ".
            message = _XGRAMMAR_PREFIX.sub("", lines[0])
            raise ValueError(f"structured_output.{kind}: cannot compile it: {message}") from None
        reasoning_end = None
        if "reasoning_end" in spec:
            reasoning_end = self._tokenizer.backend.token_to_id(spec["reasoning_end"])
            if reasoning_end is None:
                raise ValueError(
                    f"structured_output.reasoning_end: {spec['reasoning_end']!r} is not a token "
                    "of this model (a reasoning model's tag is one token)"
                )
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        return RequestGrammar(matcher, bitmask, reasoning_end)

    def _ready(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)  # type: ignore[no-untyped-call]
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler, self._xgr = xgr.GrammarCompiler(info, max_threads=1), xgr
            return self._compiler, self._xgr


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are
    xgrammar's too)."""
    # Characters as they are: xgrammar reads \u escapes one UTF-16 unit at a time, so an
    # escaped character past U+FFFF would become two unpaired surrogates.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# What xgrammar 0.2.9 compiles and then drops (it logs a warning, or nothing), so the output
# would not be held to it: each was seen by compiling a schema and having the matcher accept
# a text that breaks it.
# Standard formats it does not hold a string to (it holds the others; a format the standard
# does not define is an annotation, as JSON Schema has it, and asserts nothing).
_UNHELD_FORMATS = frozenset(("regex", "idn-email", "idn-hostname", "iri", "iri-reference"))
# Keywords it ignores wherever they stand.
_UNHELD_KEYWORDS = {
    "not": "'not'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
    "contains": "'contains' (and minContains/maxContains)",
    "$dynamicRef": "'$dynamicRef'",
    "$recursiveRef": "'$recursiveRef'",
}
# Keywords it holds a value to alone: it ignores any other keyword beside them that asserts
# something (annotations such as title, description or default are free).
_SOLE_KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
# Keywords of one type, ignored in a schema with no type (unless one of _TYPE_HINTS, from
# which it tells an object or an array, stands there).
_TYPED_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("minItems", "maxItems", "uniqueItems", "unevaluatedItems"),
    "object": (
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "unevaluatedProperties",
    ),
}
_TYPE_HINTS = ("properties", "patternProperties", "additionalProperties", "items", "prefixItems")
_ASSERTIONS = frozenset(
    ("type", "if", "then", "else", *_UNHELD_KEYWORDS, *_SOLE_KEYWORDS, *_TYPE_HINTS)
    + tuple(keyword for keywords in _TYPED_KEYWORDS.values() for keyword in keywords)
)
# Where a schema holds schemas (those under a keyword refused above are never reached; enum,
# const, default and examples hold data): one, a map of them, a list of them.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}


def check_json_schema(text: str) -> None:
    """ValueError naming the first keyword of the JSON schema ``text`` that xgrammar would
    not hold the output to, and where it sits (a JSON pointer); text that is not JSON passes
    (the compiler names its fault)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return
    # Each schema, where it sits, and whether it holds a property's name (a string, with or
    # without a type). A stack, not recursion: the nesting is capped, but not so low.
    stack: list[tuple[Any, str, bool]] = [(schema, "", False)]
    while stack:
        node, path, names = stack.pop()
        if not isinstance(node, dict):
            continue
        reason = _unheld(node, names)
        if reason is not None:
            raise ValueError(
                f"structured_output.json: {reason} (at {path or '/'}) is not supported: "
                "the output would not be held to it"
            )
        stack.extend((node.get(key), f"{path}/{key}", False) for key in _SUBSCHEMA)
        stack.append((node.get("propertyNames"), f"{path}/propertyNames", True))
        for key in _SUBSCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, dict):
                stack.extend(
                    (child, f"{path}/{key}/{_escape(name)}", names)
                    for name, child in children.items()
                )
        for key in _SUBSCHEMA_LISTS:
            children = node.get(key)
            if isinstance(children, list):
                stack.extend(
                    (child, f"{path}/{key}/{i}", names) for i, child in enumerate(children)
                )


def _unheld(node: dict[str, Any], names: bool) -> str | None:
    """What in this one schema xgrammar would drop, or None (``names``: it holds property
    names, strings whether it says so or not)."""
    for key, name in _UNHELD_KEYWORDS.items():
        if key in node:
            return name
    if "if" in node and ("then" in node or "else" in node):
        return "'if' with 'then'/'else'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if "multipleOf" in node and not (
        node.get("type") == "integer" and type(node["multipleOf"]) is int
    ):
        return "'multipleOf' but for an integer multiple of an integer"
    format_ = node.get("format")
    if isinstance(format_, str) and format_ in _UNHELD_FORMATS:
        return f"format {format_!r}"
    # A string is held to one of its pattern, its format and its length.
    if "pattern" in node and "format" in node:
        return "'pattern' beside 'format'"
    for key in ("pattern", "format"):
        if key in node and ("minLength" in node or "maxLength" in node):
            return f"'minLength'/'maxLength' beside {key!r}"
    for key in ("anyOf", "oneOf", "type"):
        if node.get(key) == []:
            return f"an empty {key!r}"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and required:
        listed = properties if isinstance(properties, dict) else {}
        unlisted = [n for n in required if isinstance(n, str) and n not in listed]
        if unlisted:
            return f"'required' naming {str(unlisted[0])[:100]!r}, not in 'properties'"
    asserted = node.keys() & _ASSERTIONS
    for key in _SOLE_KEYWORDS:
        if key in node and len(asserted) > 1:
            return _beside(node, key, asserted - {key})
    if "type" not in node and not names and not asserted.intersection(_TYPE_HINTS):
        for type_, keywords in _TYPED_KEYWORDS.items():
            for key in keywords:
                if key in node:
                    return f"{key!r} in a schema of no 'type' (give it {type_!r})"
    return None


def _beside(node: dict[str, Any], key: str, others: set[str]) -> str | None:
    """The keyword beside ``key`` that xgrammar drops, or None: beside enum or const a type
    all their values have is no constraint."""
    if others == {"type"} and key in ("enum", "const"):
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        values = node["enum"] if key == "enum" else [node["const"]]
        if isinstance(values, list) and all(_has_type(v, types) for v in values):
            return None
    return f"{sorted(others)[0]!r} beside {key!r}"


def _has_type(value: Any, types: list[Any]) -> bool:
    """Whether a JSON value is of one of ``types`` (JSON's true is no number, 1.0 is an
    integer)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return any(
        isinstance(value, _JSON_TYPES.get(name, ()))
        and isinstance(value, bool) == (name == "boolean")
        for name in types
        if isinstance(name, str)
    )


def _escape(name: str) -> str:
    """A name as a JSON pointer writes it."""
    return name.replace("~", "~0").replace("/", "~1")
