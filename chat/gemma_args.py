"""Gemma's argument syntax (Gemma 4, FunctionGemma): a grammar for it from a JSON Schema, and a parser back to JSON.

    {city:<|"|>Paris<|"|>,days:3,units:[<|"|>c<|"|>],opts:{fast:true}}

Keys are bare and, as the templates write them (`dictsort`), in sorted order; strings sit between the family's
quote token; numbers, `true`, `false` and `null` are bare; lists and objects nest. No JSON Schema converter
writes this syntax, so the subset agents' tools use is covered here: objects with properties (required or
not), arrays, strings (and string enums), numbers, integers, booleans, null; anything else is any value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from chat.calls import NUMBER_TEXT, ArgsReader, json_chars
from chat.value_grammar import ValueGrammar, lit

# at most 16 digits before the point and after it, as llama.cpp's grammars write numbers (a small model would not stop)
JSON_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?/"
SMALL_RANGE = 256  # an integer range this small is written out value by value
KEY = r"/[A-Za-z_][A-Za-z0-9_]*/"


class _Writer(ValueGrammar):
    """Collects the rules of one argument grammar; rule names are prefixed with the grammar's name."""

    SEP = ","
    NUMBER = JSON_NUMBER
    BOOLEAN = '"true" | "false"'
    NULL = '"null"'

    def __init__(self, prefix: str, quote: str) -> None:
        super().__init__(prefix)
        self.quote = quote
        self._any = ""
        # one lexeme, quotes included: the body is anything without the quote token's first two characters (a
        # lexeme of its own would have to end before a `<` it cannot yet tell from the closing quote)
        a, b, q = re.escape(quote[0]), re.escape(quote[1]), re.escape(quote)
        self.string_lexeme = f"/{q}([^{a}]|{a}[^{b}])*{q}/"

    def any_value(self) -> str:
        if not self._any:
            self._any = f"{self.prefix}_any"
            obj = f'"{{" ({KEY} ":" {self._any} ("," {KEY} ":" {self._any})*)? "}}"'
            arr = f'"[" ({self._any} ("," {self._any})*)? "]"'
            self.rules.append(f'{self._any}: {self.string_lexeme} | {JSON_NUMBER} | "true" | "false" | "null" | {obj} | {arr}\n')
        return self._any

    def enum(self, schema: dict[str, Any]) -> str | None:
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
            return self.rule(" | ".join(lit(self.quote + v + self.quote) for v in schema["enum"]))
        return None

    def string(self) -> str:
        return self.rule(self.string_lexeme)

    def integer(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low <= SMALL_RANGE:
            return self.rule(" | ".join(f'"{v}"' for v in range(low, high + 1)))
        return super().integer(schema)

    def object(self, schema: dict[str, Any]) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return self.rule(f'"{{" ({KEY} ":" {self.any_value()} ("," {KEY} ":" {self.any_value()})*)? "}}"')
        return self.members(props, sorted(props), set(schema.get("required") or []), lambda key: key + ":")


def gemma_grammar(name: str, parameters: dict[str, Any], quote: str) -> str:
    """Lark rules defining `name`: an arguments object (braces included) for a tool with these parameters."""
    w = _Writer(name, quote)
    schema = parameters or {"type": "object", "properties": {}}
    top = w.object(schema) if schema.get("type", "object") == "object" else w.value(schema)
    return f"{name}: {top}\n" + "".join(w.rules)


def parse_gemma_args(text: str, i: int, quote: str) -> tuple[dict[str, Any], int]:
    """The object at text[i] (which is `{`), as JSON values, and the index after it. Raises ValueError."""
    value, end = _Parser(text, quote).value(i)
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return value, end


class _Parser:
    def __init__(self, text: str, quote: str) -> None:
        self.text, self.quote = text, quote

    def value(self, i: int) -> tuple[Any, int]:
        t, q = self.text, self.quote
        if t.startswith(q, i):
            end = t.find(q, i + len(q))
            if end < 0:
                raise ValueError("unterminated string")
            return t[i + len(q) : end], end + len(q)
        if t.startswith("{", i):
            return self.members(i + 1)
        if t.startswith("[", i):
            return self.items(i + 1)
        for word, val in (("true", True), ("false", False), ("null", None), ("None", None)):
            if t.startswith(word, i):
                return val, i + len(word)
        m = NUMBER_TEXT.match(t, i)
        if not m:
            raise ValueError(f"no value at {i}")
        return _number(m.group(0)), m.end()

    def members(self, i: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}

        def member(i: int) -> int:
            t = self.text
            if t.startswith(self.quote, i):  # an escaped key (nested objects in declarations)
                key, i = self.value(i)
            else:
                m = re.compile(KEY.strip("/")).match(t, i)
                if not m:
                    raise ValueError(f"no key at {i}")
                key, i = m.group(0), m.end()
            if not t.startswith(":", i):
                raise ValueError(f"no ':' at {i}")
            out[key], i = self.value(i + 1)
            return i

        return out, self._listed(i, "}", member)

    def items(self, i: int) -> tuple[list[Any], int]:
        out: list[Any] = []

        def item(i: int) -> int:
            v, i = self.value(i)
            out.append(v)
            return i

        return out, self._listed(i, "]", item)

    def _listed(self, i: int, close: str, read: Callable[[int], int]) -> int:
        """Read elements (`read`: the index after one) separated by commas up to `close`; the index after it."""
        t = self.text
        if t.startswith(close, i):
            return i + 1
        while True:
            i = read(i)
            if t.startswith(",", i):
                i += 1
            elif t.startswith(close, i):
                return i + 1
            else:
                raise ValueError(f"no ',' or '{close}' at {i}")


class GemmaArgs(ArgsReader):
    """Gemma's arguments read as they are written, given out as the JSON they mean (`", "` and `": "` between
    members, as `json.dumps` writes it): strings character by character, other values once complete."""

    def __init__(self, start: int, quote: str) -> None:
        super().__init__(start)
        self.quote = quote
        self.stack: list[str] = []  # "{" or "[" for each open object and list
        self.state = "value"  # value | key | after_value | string | scalar | after_key | qkey
        self.word = ""  # the key or scalar being read

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        out: list[str] = []
        i, n, q = self.pos, len(section), self.quote
        while i < n:
            c = section[i]
            st = self.state
            if st in ("string", "qkey"):
                if section.startswith(q, i):
                    i += len(q)
                    if st == "string":
                        out.append('"')
                        self.state = "after_value"
                    else:
                        out.append(json.dumps(self.word, ensure_ascii=False) + ": ")
                        self.word, self.state = "", "after_key"
                    continue
                if q.startswith(section[i:]):  # (the quote token may be arriving)
                    break
                if st == "string":
                    out.append(json_chars(c))
                else:
                    self.word += c
                i += 1
                continue
            if st == "scalar":
                if c in ",}]":
                    out.append(_scalar(self.word))
                    self.word, self.state = "", "after_value"
                    continue  # (the delimiter is read as after a value)
                self.word += c
                i += 1
                continue
            if st == "key":
                if c == "}" and not self.word:
                    out.append("}")
                    self.stack.pop()
                    self.state = "after_value"
                elif section.startswith(q, i) and not self.word:
                    self.state = "qkey"
                    i += len(q)
                    continue
                elif c == ":":
                    out.append(json.dumps(self.word, ensure_ascii=False) + ": ")
                    self.word, self.state = "", "value"
                elif q.startswith(section[i:]) and not self.word:
                    break
                else:
                    self.word += c
                i += 1
                if not self.stack:
                    self.pos = i
                    return "".join(out), i
                continue
            if st == "after_key":
                if c != ":":
                    raise ValueError(f"no ':' after a key at {i}")
                self.state = "value"
                i += 1
                continue
            if st == "value":
                if section.startswith(q, i):
                    out.append('"')
                    self.state = "string"
                    i += len(q)
                    continue
                if q.startswith(section[i:]):
                    break
                if c in "{[":
                    out.append(c)
                    self.stack.append(c)
                    self.state = "key" if c == "{" else "value"
                elif c == "]" and self.stack and self.stack[-1] == "[":
                    out.append("]")
                    self.stack.pop()
                    self.state = "after_value"
                else:
                    if not self.stack:
                        raise ValueError("arguments are not an object")
                    self.state, self.word = "scalar", c
                i += 1
                if not self.stack and self.state == "after_value":
                    self.pos = i
                    return "".join(out), i
                continue
            # after_value
            if not self.stack:
                self.pos = i
                return "".join(out), i
            if c == ",":
                out.append(", ")
                self.state = "key" if self.stack[-1] == "{" else "value"
            elif c in "}]":
                if c != {"{": "}", "[": "]"}[self.stack[-1]]:
                    raise ValueError(f"unbalanced {c!r} at {i}")
                out.append(c)
                self.stack.pop()
            else:
                raise ValueError(f"no ',' or a closing bracket at {i}")
            i += 1
            if not self.stack:
                self.pos = i
                return "".join(out), i
        self.pos = i
        return "".join(out), None


def _scalar(word: str) -> str:
    """A bare value as JSON (`None` is Python's null, which the templates may write)."""
    w = word.strip()
    if w in ("true", "false", "null"):
        return w
    if w == "None":
        return "null"
    if not NUMBER_TEXT.fullmatch(w):
        raise ValueError(f"not a value: {w!r}")
    return json.dumps(_number(w))


def _number(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)
