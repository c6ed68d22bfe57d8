"""Lark (llguidance) rules for tool-call values, as the syntaxes that write them by hand share them: a literal (`lit`),
the rules of one grammar collected under one prefix (`Rules`), and a value of a JSON Schema (`ValueGrammar`: each
syntax says how it writes each type; objects' members, optional ones included, are chained here once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

INTEGER = r"/-?(0|[1-9][0-9]{0,15})/"  # (at most 16 digits, as llama.cpp's grammars write them: a small model would not stop)


def lit(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


class Rules:
    """Collects the rules of one grammar; rule names are the prefix and a number."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.rules: list[str] = []
        self.n = 0

    def rule(self, body: str, options: str = "") -> str:
        self.n += 1
        name = f"{self.prefix}_{self.n}"
        self.rules.append(f"{name}{options}: {body}\n")
        return name

    def text(self) -> str:
        return "".join(self.rules)


class ValueGrammar(Rules):
    """Rules for a value of a JSON Schema. Subclasses write the syntax's own spellings (the class attributes) and its
    strings, enums, objects and any value."""

    SEP = ", "  # between an array's items and an object's members
    NUMBER = ""
    BOOLEAN = ""
    NULL = ""

    def value(self, schema: Any) -> str:
        """A rule for a value of `schema`."""
        if not isinstance(schema, dict):
            return self.any_value()
        choices = self.enum(schema)
        if choices is not None:
            return choices
        kind = schema.get("type")
        if kind == "string":
            return self.string()
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.rule(self.NUMBER)
        if kind == "boolean":
            return self.rule(self.BOOLEAN)
        if kind == "null":
            return self.rule(self.NULL)
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.rule(f'"[" ({item} ({lit(self.SEP)} {item})*)? "]"')
        if kind == "object":
            return self.object(schema)
        return self.any_value()

    def members(self, props: dict[str, Any], keys: list[str], required: set[str], key_text: Callable[[str], str]) -> str:
        """An object of `props` in the order of `keys`, each written once at most, the required ones always;
        `key_text` writes a key and what follows it up to the value."""
        sep = lit(self.SEP)
        tail = {len(keys): ('""', '""')}  # (the members from keys[i] on: the first written, or after a separator)
        for i in range(len(keys) - 1, -1, -1):
            kv = f"{lit(key_text(keys[i]))} {self.value(props[keys[i]])}"
            rest_first, rest_more = tail[i + 1]
            if keys[i] in required:
                tail[i] = (self.rule(f"{kv} {rest_more}"), self.rule(f"{sep} {kv} {rest_more}"))
            else:
                tail[i] = (self.rule(f"{kv} {rest_more} | {rest_first}"), self.rule(f"{sep} {kv} {rest_more} | {rest_more}"))
        return self.rule(f'"{{" {tail[0][0]} "}}"')

    def enum(self, schema: dict[str, Any]) -> str | None:
        """A rule for the schema's `enum` where the syntax writes it; None to read the type."""
        raise NotImplementedError

    def string(self) -> str:
        raise NotImplementedError

    def integer(self, schema: dict[str, Any]) -> str:
        return self.rule(INTEGER)

    def object(self, schema: dict[str, Any]) -> str:
        raise NotImplementedError

    def any_value(self) -> str:
        raise NotImplementedError
