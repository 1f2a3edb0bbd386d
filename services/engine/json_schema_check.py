"""What of a JSON schema xgrammar 0.2.9 would not hold the output to.

xgrammar compiles a schema's every keyword it knows and drops the rest (with a warning, or
none): the output would then break the schema and still end ``stop``. ``check_json_schema``
refuses such a schema, naming the keyword and where it sits, as vLLM's xgrammar backend
refuses what xgrammar does not support. Each rule here was seen by compiling a schema and
having xgrammar's matcher accept a text the schema rejects (the jsonschema library's
verdict); a keyword whose grammar is the same with it and without it asserts nothing there
and is taken.
"""

from __future__ import annotations

import functools
import json
from typing import Any

# Standard formats it holds a string to; one it does not (regex, idn-email...) is refused,
# and a format the standard does not define (password, binary) is an annotation, as JSON
# Schema has it, asserting nothing.
_HELD_FORMATS = frozenset(
    (
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "uuid",
    )
)
_UNHELD_FORMATS = frozenset(("regex", "idn-email", "idn-hostname", "iri", "iri-reference"))
# Of those held, the formats no empty string meets: a minLength of 1 adds nothing to them.
_NONEMPTY_FORMATS = _HELD_FORMATS - {"uri-reference", "uri-template", "json-pointer"}
_NONEMPTY_FORMATS -= {"relative-json-pointer"}
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


@functools.lru_cache(maxsize=64)  # a schema sent again (the compiler caches it too)
def check_json_schema(text: str) -> None:
    """ValueError naming the first keyword of the JSON schema ``text`` that xgrammar would
    not hold the output to, and where it sits (a JSON pointer); text that is not JSON passes
    (the compiler names its fault). Every schema is reached: those under the keywords that
    hold schemas, and each ``$ref``'s target wherever it sits (OpenAPI's components)."""
    try:
        root = json.loads(text)
    except ValueError:
        return
    # Each schema, where it sits, and whether it holds a property's name (a string, with or
    # without a type). A stack, not recursion: the nesting is capped, but not so low.
    stack: list[tuple[Any, str, bool]] = [(root, "", False)]
    seen: set[int] = set()
    while stack:
        node, path, names = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        reason = _unheld(node, names, root)
        if reason is not None:
            raise ValueError(
                f"structured_output.json: {reason} (at {path or '/'}) is not supported: "
                "the output would not be held to it"
            )
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append((_resolve(root, ref), ref[1:], names))
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


def _unheld(node: dict[str, Any], names: bool, root: Any) -> str | None:
    """What in this one schema xgrammar would drop, or None (``names``: it holds property
    names, strings whether it says so or not)."""
    for key, name in _UNHELD_KEYWORDS.items():
        if key in node:
            return name
    if "if" in node and ("then" in node or "else" in node):
        return "'if' with 'then'/'else'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if "multipleOf" in node and not _integer_multiple(node):
        return "'multipleOf' but for an integer multiple of an integer"
    if (reason := _unheld_string(node)) is not None:
        return reason
    for key in ("anyOf", "oneOf", "type"):
        if node.get(key) == []:
            return f"an empty {key!r}"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and not _apart(one_of, root):
        return "'oneOf' of schemas a value may meet more than one of (held as 'anyOf')"
    if (reason := _unheld_names(node)) is not None:
        return reason
    asserted = node.keys() & _ASSERTIONS
    if "const" in node and _same_in(node["const"], node.get("enum")):
        asserted -= {"enum"}  # the const alone is what both allow
    for key in _SOLE_KEYWORDS:
        if key in asserted and len(asserted) > 1:
            return _beside(node, key, asserted - {key})
    if "type" not in node and not names and not asserted.intersection(_TYPE_HINTS):
        for type_, keywords in _TYPED_KEYWORDS.items():
            for key in keywords:
                if key in node and not (key == "format" and not _is_held_format(node[key])):
                    return f"{key!r} in a schema of no 'type' (give it {type_!r})"
    return None


def _is_held_format(value: Any) -> bool:
    return isinstance(value, str) and value in _HELD_FORMATS


def _integer_multiple(node: dict[str, Any]) -> bool:
    """Whether ``multipleOf`` is a whole number of a schema of integers (and maybe null),
    the one kind xgrammar holds."""
    step, types = node["multipleOf"], node.get("type")
    types = types if isinstance(types, list) else [types]
    whole = type(step) is int or (type(step) is float and step.is_integer())
    return whole and "integer" in types and "number" not in types


def _unheld_string(node: dict[str, Any]) -> str | None:
    """A string is held to one of its pattern, its (standard) format and its length: the
    others beside it are dropped (a minLength of 1 beside a format no empty string meets
    asks nothing more)."""
    format_ = node.get("format")
    if not isinstance(format_, str):  # not JSON Schema's: left to the compiler
        format_ = None
    if format_ in _UNHELD_FORMATS:
        return f"format {format_!r}"
    held_format = format_ if _is_held_format(format_) else None
    if "pattern" in node and held_format is not None:
        return "'pattern' beside 'format'"
    lengths = {"minLength", "maxLength"} & node.keys()
    if held_format in _NONEMPTY_FORMATS and node.get("minLength") in (0, 1):
        lengths -= {"minLength"}
    for key in ("pattern", "format"):
        if lengths and (node.get(key) is not None if key == "pattern" else held_format):
            return f"'minLength'/'maxLength' beside {key!r}"
    return None


def _unheld_names(node: dict[str, Any]) -> str | None:
    """An object's rules on its property names that its listed properties escape: a
    required name not listed, a listed name that ``propertyNames`` refuses, a listed name a
    ``patternProperties`` pattern may also match (only the listed schema holds it). A
    client's pattern is never run here: Python's backtracking search of one (``(a+)+$``
    against 40 characters) would hold the tokenizer thread for hours, so a pattern beside
    listed properties is refused whether it matches them or not."""
    properties = node.get("properties")
    listed = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    if isinstance(required, list):
        unlisted = [n for n in required if isinstance(n, str) and n not in listed]
        if unlisted:
            return f"'required' naming {str(unlisted[0])[:100]!r}, not in 'properties'"
    if not listed:
        return None
    names_schema = node.get("propertyNames")
    if isinstance(names_schema, dict):
        if "pattern" in names_schema:
            return "'propertyNames' with a pattern beside listed properties"
        refused = [name for name in listed if not _name_meets(name, names_schema)]
        if refused:
            return f"'propertyNames' that listed property {refused[0][:100]!r} does not meet"
    if node.get("patternProperties"):
        return "'patternProperties' beside listed properties"
    return None


def _name_meets(name: str, schema: dict[str, Any]) -> bool:
    """Whether a property name meets a ``propertyNames`` schema's lengths, enum and const
    (its other keywords are taken as met)."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    if (type(low) is int and len(name) < low) or (type(high) is int and len(name) > high):
        return False
    if "const" in schema and schema["const"] != name:
        return False
    return not isinstance(schema.get("enum"), list) or name in schema["enum"]


def _apart(branches: list[Any], root: Any) -> bool:
    """Whether no value meets two of ``oneOf``'s branches, as far as tells cheaply: each
    pair of a different single type (an integer is a number too), or of objects each
    requiring one property with values of their own (a discriminated union's tag)."""
    schemas = [_resolve(root, b["$ref"]) if _is_ref(b) else b for b in branches]
    return all(_disjoint(a, b) for i, a in enumerate(schemas) for b in schemas[i + 1 :])


def _disjoint(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    kind_a, kind_b = a.get("type"), b.get("type")
    if isinstance(kind_a, str) and isinstance(kind_b, str):
        if kind_a != kind_b and {kind_a, kind_b} != {"integer", "number"}:
            return True
    tags = _tags(a)
    for name, values in _tags(b).items():
        if name in tags and not any(_same_in(v, tags[name]) for v in values):
            return True
    return False


def _tags(schema: dict[str, Any]) -> dict[str, list[Any]]:
    """An object schema's required properties that allow only listed values (const, enum)."""
    properties = schema.get("properties")
    required = schema.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return {}
    tags = {}
    for name in required:
        prop = properties.get(name) if isinstance(name, str) else None
        if isinstance(prop, dict) and "const" in prop:
            tags[name] = [prop["const"]]
        elif isinstance(prop, dict) and isinstance(prop.get("enum"), list):
            tags[name] = prop["enum"]
    return tags


def _is_ref(schema: Any) -> bool:
    return isinstance(schema, dict) and isinstance(schema.get("$ref"), str)


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` (``#/$defs/x``) points to, else None."""
    node = root
    for part in ref.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _same_in(value: Any, values: Any) -> bool:
    """Whether a JSON value is among ``values`` (JSON's equality: 1 and true differ)."""
    return isinstance(values, list) and any(type(v) is type(value) and v == value for v in values)


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
