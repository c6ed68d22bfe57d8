"""Configuration as frozen dataclasses; CLI flags are generated from their fields, never written twice.

A field becomes a flag `--field-name` with `help` from its metadata. Booleans become `--flag/--no-flag`.
`from_args` builds the dataclass back from the parsed namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def opt(default: Any, help: str, *, flag: str | None = None, choices: list[str] | None = None, metavar: str | None = None) -> Any:
    """A config field with its help text (and optionally its flag name, choices, metavar)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "metavar": metavar})


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(type, optional?) of an annotation like `int | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of dataclass `cls` (fields in `skip` are left out)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        tp, _ = _base_type(hints[f.name])
        default = f.default
        if tp is bool:
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"]
            )
            continue
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            flag,
            dest=f.name,
            type=tp if tp in (int, float, str) else str,
            default=default,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
            help=f.metadata["help"] + shown,
        )


def from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build dataclass `cls` from parsed flags; `overrides` win."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}  # type: ignore[arg-type]
    values.update(overrides)
    return cls(**values)
