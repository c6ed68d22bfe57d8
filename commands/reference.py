"""The flag and field reference, written from the code that defines them: `python -m commands.reference >
docs/reference.md`.

Flags come from the parser `kvroute` itself builds (commands.cli.build_parser, whose flags common/config.py makes
from the config dataclasses); request fields from each API's request type and gateway/fields.py's tables. The file
is checked in; tests/test_reference.py fails when it differs from what this writes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from typing import Any

import msgspec.inspect as mi

REGENERATE = "python -m commands.reference > docs/reference.md"

# A default that depends on the machine or the environment this runs on is written as what it means, so that the
# file is the same everywhere: (command, flag's dest) -> its default, in words.
_MACHINE_DEFAULTS: dict[tuple[str, str], str] = {
    ("doctor", "threads"): "the CPU count",
    **{
        (command, dest): f"`${env}`"
        for command in ("complete", "chat", "status")
        for dest, env in (
            ("curve_key", "KVROUTE_CURVE_KEY"),
            ("router_key", "KVROUTE_ROUTER_KEY"),
            ("cache_salt", "KVROUTE_CACHE_SALT"),
        )
    },
}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion (`%(default)s`)
        params = {**vars(action), "prog": ""}
        params = {k: getattr(v, "__name__", v) for k, v in params.items()}
        text = text % params
    return re.sub(r"\s*\(default: [^()]*\)$", "", text)  # (common/config.py's suffix: the table has a column for it)


def _default(command: str, action: argparse.Action) -> str:
    if (command, action.dest) in _MACHINE_DEFAULTS:
        return _MACHINE_DEFAULTS[(command, action.dest)]
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if action.default else "off"
    return f"`{action.default}`" if action.default != "" else '`""`'


def _flags(action: argparse.Action) -> str:
    names = list(action.option_strings)
    value = ""
    if not isinstance(action, argparse.BooleanOptionalAction) and action.nargs != 0:
        choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
        value = " " + str(action.metavar or choices or action.dest.upper())
    return ", ".join(f"`{n}{value}`" for n in names).replace("|", "\\|")


def flag_tables() -> Iterator[str]:
    from commands.cli import build_parser

    parser, _, subparsers = build_parser()
    model_sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["model"]
    commands: dict[str, argparse.ArgumentParser] = {**subparsers, "model": model_sub}
    yield "## Commands and their flags\n"
    yield "`kvroute COMMAND --help` prints the same. Every daemon (`serve`, `router`, `worker`, `http`) also reads its"
    yield "flags from the `[COMMAND]` table of a TOML file (`--config FILE`: keys are the flags' names without dashes).\n"
    for name, sub in commands.items():
        yield from _command(name, sub, "###")


def _command(name: str, sub: argparse.ArgumentParser, level: str) -> Iterator[str]:
    """One command's section: its description, positionals, actions (each its own section) and flags."""
    yield f"{level} `kvroute {name}`\n"
    yield _cell(sub.description or "") + "\n"
    actions = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    positionals = [a for a in sub._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    for a in positionals:
        yield f"- `{a.metavar or a.dest}` (positional): {_cell(_help(a))}"
    if positionals:
        yield ""
    if actions:
        yield "| flag | default | what it does |"
        yield "| --- | --- | --- |"
        for a in actions:
            yield f"| {_flags(a)} | {_default(name.split()[0], a)} | {_cell(_help(a))} |"
        yield ""
    for a in sub._actions:
        if isinstance(a, argparse._SubParsersAction):
            for action_name, action_parser in a.choices.items():
                yield from _command(f"{name} {action_name}", action_parser, level + "#")


def _bounds(t: Any) -> str:
    """A type's constraints (`1 to 16`, `at most 16 items`), as msgspec checks them."""
    low = next((f"{op} {getattr(t, k)}" for k, op in (("ge", ">="), ("gt", ">")) if getattr(t, k, None) is not None), "")
    high = next((f"{op} {getattr(t, k)}" for k, op in (("le", "<="), ("lt", "<")) if getattr(t, k, None) is not None), "")
    lengths = (("min_length", "length >="), ("max_length", "length <="))
    length = [f"{op} {getattr(t, k)}" for k, op in lengths if getattr(t, k, None) is not None]
    parts = [x for x in (low, high, *length) if x]
    return f" ({', '.join(parts)})" if parts else ""


def _is_list(t: mi.Type) -> bool:
    if isinstance(t, mi.Metadata):
        return _is_list(t.type)
    if isinstance(t, mi.UnionType):
        return any(_is_list(m) for m in t.types)
    return isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType)


def _type_name(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _type_name(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(_type_name(m) for m in t.types if not isinstance(m, mi.NoneType))
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType):
        return f"list of {_type_name(t.item_type)}{_bounds(t)}"
    if isinstance(t, mi.DictType):
        return "object"
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{v!r}`".replace("'", '"') for v in t.values)
    return {
        mi.StrType: "string",
        mi.IntType: "integer",
        mi.FloatType: "number",
        mi.BoolType: "boolean",
        mi.AnyType: "any",
    }.get(type(t), type(t).__name__.removesuffix("Type").lower()) + _bounds(t)


def _structs(t: mi.Type) -> list[mi.StructType]:
    """The struct types a field's value may be read as (through lists, unions and metadata)."""
    if isinstance(t, mi.Metadata):
        return _structs(t.type)
    if isinstance(t, mi.StructType):
        return [t]
    if isinstance(t, mi.UnionType):
        return [s for m in t.types for s in _structs(m)]
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType):
        return _structs(t.item_type)
    return []


def _fields(struct: mi.StructType, at: str, seen: frozenset[type], depth: int) -> Iterator[tuple[str, str, str]]:
    """(path pattern, where it applies, type) of each field of `struct` and of the structs inside it."""
    for f in struct.fields:
        path = f"{at}{f.encode_name}"
        yield path, "", _type_name(f.type)
        inner = _structs(f.type)
        for s in inner:
            if s.cls in seen or depth >= 2:
                continue
            where = f"{path} with {s.tag_field} `{s.tag}`" if s.tag_field and len(inner) > 1 else ""
            for p, w, kind in _fields(s, f"{path}[]." if _is_list(f.type) else f"{path}.", seen | {s.cls}, depth + 1):
                yield p, w or where, kind


def _request_types() -> dict[str, tuple[str, list[tuple[str, Any]]]]:
    """Each API of gateway/fields.py: its endpoint, and the types its body is decoded as: (where, type), where '' is
    the body and `tools[]` each element of its `tools` (parts the gateway decodes on their own)."""
    from gateway import anthropic, embeddings, openai_bodies, rerank, responses

    return {
        "chat": ("`POST /v1/chat/completions`", [("", openai_bodies.ChatRequest)]),
        "completions": ("`POST /v1/completions`", [("", openai_bodies.CompletionRequest)]),
        "responses": (
            "`POST /v1/responses`",
            [
                ("", responses.ResponsesRequest),
                ("input[]", responses.EasyMessage),
                ("input[]", responses.Item),
                ("tools[]", responses.FunctionTool),
                ("tools[]", responses.NamespaceTool),
                ("tools[].tools[]", responses.FunctionTool),
            ],
        ),
        "messages": (
            "`POST /v1/messages` (`/v1/messages/count_tokens`)",
            [("", anthropic.MessagesRequest), ("tools[]", anthropic.ToolDef)],
        ),
        "embeddings": ("`POST /v1/embeddings`", [("", embeddings.EmbeddingsBody)]),
        "rerank": (", ".join(f"`POST {p}`" for p in rerank.RERANK_PATHS), [("", rerank.RerankBody)]),
    }


# Fields read from the body before it is decoded (gateway/app.py), in every generating API.
_READ_FIRST = {"keep_alive": "Ollama's: how long the model stays loaded after this request (seconds or `5m`)"}


def field_tables() -> Iterator[str]:
    from gateway.fields import HINTS, REFUSED

    yield "## Request fields of each API\n"
    yield "Each field is **honoured** (it changes what is computed or returned: the fields of the request type the"
    yield "gateway decodes the body as), a **hint** (served, logged as `request_fields_ignored` and counted in"
    yield "`kvroute_request_fields_ignored_total{api,field}`; a field kvroute does not know is a hint too, a 400 with"
    yield "`--strict-api`), or **refused** (a 400 naming the field). A value a type does not take (out of range, the"
    yield "wrong kind) is a 400 naming the field as well, and so is a value the type takes but kvroute cannot serve"
    yield "(an image by URL, `echo: true`: [apis.md](apis.md) lists them). `a[].b` is field `b` of any element of `a`.\n"
    generating = {"chat", "completions", "responses", "messages"}
    for api, (endpoint, kinds) in _request_types().items():
        yield f"### {api}: {endpoint}\n"
        yield "| field | class | type, or why |"
        yield "| --- | --- | --- |"
        refused, hints = REFUSED[api], set(HINTS[api])
        listed: set[str] = set()
        for at, kind in kinds:
            for struct in _structs(mi.type_info(kind)):
                tagged = (
                    ""
                    if not at
                    else f"{at} with {struct.tag_field} `{struct.tag}`"
                    if struct.tag_field
                    else f"{at} as {struct.cls.__name__}"
                )
                prefix = f"{at}." if at else ""
                for path, where, type_name in _fields(struct, prefix, frozenset({struct.cls}), 0):
                    shown = f"`{path}` ({where or tagged})" if where or tagged else f"`{path}`"
                    if path in hints or path.split(".")[0].split("[")[0] in refused or shown in listed:
                        continue
                    listed.add(shown)
                    yield f"| {_cell(shown)} | honoured | {_cell(type_name)} |"
        if api in generating:
            for name, why in _READ_FIRST.items():
                yield f"| `{name}` | honoured | {_cell(why)} |"
        for name in HINTS[api]:
            yield f"| `{name}` | hint | |"
        for name, why in refused.items():
            yield f"| `{name}` | refused | {_cell(why)} |"
        yield "| any other field | hint (refused with `--strict-api`) | |"
        yield ""


def write() -> str:
    lines = [
        "# Reference: flags and request fields",
        "",
        f"Generated by `{REGENERATE}` from the parser and the request types; do not edit by hand (a test fails",
        "when this file differs from what the command writes). What the flags and fields mean together:",
        "[using.md](using.md) and [apis.md](apis.md).",
        "",
        *flag_tables(),
        *field_tables(),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(write())
