"""Type checks for decoded msgpack values: each returns the value or raises
``ProtocolError`` naming the field and the first bad element.

Whole-collection checks run in C (``set(map(type, ...))``, ``min``); the slow
element-by-element walk happens only to name the culprit of a failed check.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from weir.shared.protocol.envelope import ProtocolError


def bad_element(name: str, values: Any, kind: type) -> ProtocolError:
    for i, v in enumerate(values):
        if type(v) is not kind:
            return ProtocolError(f"{name}[{i}]: expected {kind.__name__}, got {type(v).__name__}")
    return ProtocolError(f"{name}: bad value")


def array(name: str, value: Any) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError(f"{name}: expected an array, got {type(value).__name__}")
    return value


def mapping(name: str, value: Any) -> dict[Any, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{name}: expected a map, got {type(value).__name__}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def strs(name: str, value: Any) -> list[str]:
    items = array(name, value)
    if items and set(map(type, items)) != {str}:
        raise bad_element(name, items, str)
    return items


def ints(name: str, value: Any) -> list[int]:
    items = array(name, value)
    if items:
        if set(map(type, items)) != {int}:
            raise bad_element(name, items, int)
        if min(items) < 0:
            raise ProtocolError(f"{name}: negative value {min(items)}")
    return items


def check_rows(name: str, rows: Any, labels: Any) -> None:
    """Every row a list of non-negative ints; checked over the flattened rows in C,
    walking row by row only to name the culprit."""
    if set(map(type, rows)) != {list}:
        for label, row in zip(labels, rows):
            array(f"{name}[{label!r}]", row)
    flat = list(chain.from_iterable(rows))
    if flat and (set(map(type, flat)) != {int} or min(flat) < 0):
        for label, row in zip(labels, rows):
            ints(f"{name}[{label!r}]", row)


def int_lists(name: str, value: Any) -> list[list[int]]:
    rows = array(name, value)
    if rows:
        check_rows(name, rows, range(len(rows)))
    return rows


def request_id_map(name: str, value: Any) -> dict[str, Any]:
    by_id = mapping(name, value)
    if by_id and set(map(type, by_id)) != {str}:
        raise ProtocolError(f"{name}: keys must be request id strings")
    return by_id


def int_list_map(name: str, value: Any) -> dict[str, list[int]]:
    by_id = request_id_map(name, value)
    if by_id:
        check_rows(name, by_id.values(), by_id.keys())
    return by_id
