"""vLLM's ``--config FILE``: a YAML mapping of a command's long flags to their values, read
as if they were given on the command line before its own flags, which win over them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import yaml


class ConfigFileError(ValueError):
    pass


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        action="append",  # so that a second one is seen, and refused as vLLM refuses it
        default=None,
        metavar="FILE",
        help="a YAML file of this command's long flags and their values (model: ..., "
        "max-num-seqs: 64, enforce-eager: true), as vLLM's; flags given here win over it",
    )


def apply_config_file(parser: argparse.ArgumentParser, path: str, skip: set[str]) -> None:
    """Make the values of the config file at ``path`` the defaults of ``parser`` (a
    subcommand's), converted and checked by its own flags; the keys in ``skip`` are left out.
    Raises ``ConfigFileError`` naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as file:
            values = yaml.safe_load(file)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"--config {path}: {exc}") from None
    if values is None:
        return
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path}: a mapping of flags to values is needed")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    argv: list[str] = []
    given: set[str] = set()
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ConfigFileError(f"--config {path}: {key!r} is no option of this command")
        if key in skip or value is None or value == []:  # vLLM's: an empty list gives nothing
            continue
        flag_argv = _flag_argv(flag, action, value, path)
        if not flag_argv:  # a switch's false: its default (a refused switch's has no value)
            continue
        argv += flag_argv
        given.add(action.dest)
    # Parsed alone, the file need not hold the options the command line must give.
    with none_required(parser):
        parsed = parser.parse_args(argv)
    parser.set_defaults(**{dest: getattr(parsed, dest) for dest in given})
    for action in parser._actions:  # a default from the file is an option given
        if action.dest in given:
            action.required = False


@contextmanager
def none_required(parser: argparse.ArgumentParser) -> Iterator[None]:
    """``parser`` with none of its options required, as it parses a part of them."""
    required = [action for action in parser._actions if action.required]
    for action in required:
        action.required = False
    try:
        yield
    finally:
        for action in required:
            action.required = True


def _flag_argv(flag: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {flag[2:]} must be true or false")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true: only true means anything
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {flag[2:]} must be true or false")
        return [flag] if value else []
    items = value if isinstance(value, list) else [value]
    # YAML's dates and times in a mapping are their text, as they are as a flag's value.
    texts = [
        json.dumps(item, default=str) if isinstance(item, dict | list) else _text(item)
        for item in items
    ]
    # FLAG=TEXT: a text that begins with "-" (an API key's) is the flag's value, not a flag.
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={text}" for text in texts]
    if action.nargs in ("+", "*"):
        return [flag, *texts]
    if isinstance(value, list):
        raise ConfigFileError(f"--config {path}: {flag[2:]} takes one value, not a list")
    return [f"{flag}={texts[0]}"]


def _text(value: Any) -> str:
    """A scalar as a flag's text: YAML's true/false as the flags' own spelling."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
