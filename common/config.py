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


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: list[str] | None = None,
    metavar: str | None = None,
) -> Any:
    """A config field with its help text (and optionally its flag name, other accepted flag names, choices, metavar)."""
    meta = {"help": help, "flag": flag, "aliases": aliases, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


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
        flags = [f.metadata.get("flag") or "--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        tp, _ = _base_type(hints[f.name])
        default = f.default
        if tp is bool:
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"]
            )
            continue
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            *flags,
            dest=f.name,
            type=tp if tp in (int, float, str) else str,
            default=default,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
            help=f.metadata["help"] + shown,
        )


def to_flags(cfg: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make `add_args` parse back a dataclass equal to `cfg`: one per field that differs from its
    default (a boolean as --flag / --no-flag); fields in `skip` are left out."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or "help" not in f.metadata or value == f.default:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build dataclass `cls` from parsed flags; `overrides` win."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}  # type: ignore[arg-type]
    values.update(overrides)
    return cls(**values)


def read_toml(path: str, what: str) -> dict[str, Any]:
    """A TOML file's tables; one that cannot be read or parsed raises ConfigFileError naming it (`what`: its kind)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read {what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: Any) -> float:
    """A keep-alive as Ollama takes it: seconds, or a duration ("5m", "1h30m", "300ms"); any negative value is -1
    (kept). ValueError for anything else."""
    import re

    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (parts := re.fullmatch(r"\s*(-?)((?:\d+(?:\.\d+)?(?:ms|s|m|h)?)+)\s*", value)):
        sign, body = parts.groups()
        pieces = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", body)
        if len(pieces) > 1 and any(unit == "" for _, unit in pieces):
            raise ValueError(f"{value!r} is not a duration")
        seconds = sum(float(n) * _UNITS[unit or "s"] for n, unit in pieces) * (-1 if sign else 1)
    else:
        raise ValueError(f'expected seconds or a duration such as "5m", got {value!r}')
    return -1.0 if seconds < 0 else seconds


class UsageError(Exception):
    """A problem the user can fix (a flag, a key file, an endpoint): the command prints it as one line."""


class ConfigFileError(Exception):
    """A config file that cannot be used; the message names the file, the key and the problem."""


def _check_value(path: str, section: str, key: str, value: Any, action: argparse.Action) -> Any:
    where = f"{path}: [{section}] {key}"
    if isinstance(action, argparse._AppendAction):  # a repeatable flag (`--model`): a string or a list of them
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ConfigFileError(f"{where}: expected a string or a list of strings, got {value!r}")
        return values
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
        return value
    want: Any = action.type or str
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or isinstance(value, bool):
        name = {int: "an integer", float: "a number", str: "a string"}.get(want, str(want))
        raise ConfigFileError(f"{where}: expected {name}, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ConfigFileError(f"{where}: {value!r} is not one of {sorted(action.choices)}")  # type: ignore[type-var,unused-ignore]
    return value


def load_config_file(path: str, section: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Values for `parser` from the `[section]` table of a TOML file, checked against the parser's flags.

    Keys are flag names without the dashes, with `-` or `_` (`ctx-per-slot` or `ctx_per_slot`). An unknown
    section or key, or a value of the wrong type, raises ConfigFileError naming it.
    """
    data = read_toml(path, "config file")
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise ConfigFileError(f"{path}: [{section}] must be a table")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            known = ", ".join(sorted(k.replace("_", "-") for k in actions))
            raise ConfigFileError(f"{path}: [{section}] unknown key {key!r} (known: {known})")
        values[dest] = _check_value(path, section, key, value, actions[dest])
    return values
