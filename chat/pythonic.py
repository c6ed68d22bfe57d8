"""LFM2 and LFM2.5's pythonic tool calls: a Python list of calls between the family's markers.

    <|tool_call_start|>[get_weather(city='Paris', days=3), search(q='kv cache')]<|tool_call_end|>

The values are what LFM2.5's template writes for an assistant message's calls: a string between single quotes as it is
(no escapes, so it may hold quotes and newlines), an object as JSON, anything else as Python writes it (`True`,
`None`, `[1, 'x']`: chat/python_values.py). A string's closing quote is the first `'` followed by what may follow a
value (`, key=`, or `)` then `]` or `,`); the grammar keeps a string from holding that, and so writes exactly the
text the template renders back. The LFM2 templates that render no calls (LFM2-8B-A1B, LFM2.5-Instruct) get the
calls written into the assistant's content in this syntax (`write`), as the model wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from chat.calls import WS, ArgsReader, Head, Pattern, json_chars, match_literal, skip_ws
from chat.families import EMPTY, Family, listed_head
from chat.python_values import PY_NUMBER, PythonGrammar, literal_json, python_text
from chat.schema import for_grammar
from chat.value_grammar import lit
from protocol import Tool

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
KEY_CHARS = Pattern.NAME_CHARS
_IDENT = r"[A-Za-z0-9_.\-]+"
_WS = r"[ \t\r\n]*"
# a string may not hold a quote followed by what ends a value (else the reader would end it there)
STRING_BODY = rf"/(?s:.*)/ & ~/(?s:.*)'{_WS}(,{_WS}{_IDENT}{_WS}=|\){_WS}[\],])(?s:.*)/"


def value_text(value: Any) -> str:
    """An argument's value as LFM2.5's template writes it."""
    if isinstance(value, str):
        return "'" + value + "'"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return python_text(value)


def write_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The section for these calls, as LFM2.5's template renders an assistant message's `tool_calls`."""
    items = [f"{name}(" + ", ".join(f"{k}={value_text(v)}" for k, v in args.items()) + ")" for name, args in calls]
    return OPEN + "[" + ", ".join(items) + "]" + CLOSE


def string_closes(text: str, j: int, final: bool) -> bool | None:
    """Whether text[j:] (what follows a quote) is what may follow a value (`, key=`, or `)` then `]` or `,`); None
    while it cannot be told yet (at the end of the text, a quote closes the string)."""
    n, undecided = len(text), (True if final else None)
    k = skip_ws(text, j)
    if k == n:
        return undecided
    if text[k] == ")":
        k = skip_ws(text, k + 1)
        return undecided if k == n else text[k] in "],"
    if text[k] != ",":
        return False
    k = start = skip_ws(text, k + 1)
    while k < n and text[k] in KEY_CHARS:
        k += 1
    if k == n:
        return undecided
    k = skip_ws(text, k)
    if k == n:
        return undecided if k > start else False
    return k > start and text[k] == "="


class PythonArgs(ArgsReader):
    """The arguments of one call, from after its `(` through its `)`, given out as the JSON object they mean: a
    string value character by character, another value once complete."""

    def __init__(self, start: int) -> None:
        super().__init__(start)
        self.state = "key"  # key | value | string | literal | after
        self.count = 0
        self.quote = ""
        self.literal = ""  # a non-string value's text so far
        self.depth = 0
        self.in_str = ""  # the quote of a string inside the literal

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        out: list[str] = []
        i, n = self.pos, len(section)
        while i < n:
            c = section[i]
            if self.state == "string":
                if c != self.quote:
                    j = i
                    while j < n and section[j] != self.quote:
                        j += 1
                    out.append(json_chars(section[i:j]))
                    i = j
                    continue
                closes = string_closes(section, i + 1, final)
                if closes is None:
                    break
                out.append('"' if closes else json_chars(c))
                self.state = "after" if closes else "string"
                i += 1
                continue
            if self.state == "literal":
                i, done = self._literal(section, i)
                if not done:
                    break
                out.append(literal_json(self.literal))
                self.state = "after"
                continue
            if c in WS:
                i += 1
                continue
            if self.state in ("key", "after") and c == ")":
                out.append("}" if self.count else "{}")
                self.pos = i + 1
                return "".join(out), i + 1
            if self.state == "after":
                if c != ",":
                    raise ValueError(f"no ',' or ')' after a value at {i}")
                self.state, i = "key", i + 1
                continue
            if self.state == "key":
                j = i
                while j < n and section[j] in KEY_CHARS:
                    j += 1
                eq = match_literal(section, j, "=")
                if eq is None or j == n:
                    break
                if eq is False or j == i:
                    raise ValueError(f"no `key=` at {i}")
                out.append(("{" if not self.count else ", ") + json.dumps(section[i:j], ensure_ascii=False) + ": ")
                self.count += 1
                self.state, i = "value", eq
                continue
            if c in "'\"":  # (state value) a string
                out.append('"')
                self.state, self.quote, i = "string", c, i + 1
                continue
            self.state, self.literal, self.depth, self.in_str = "literal", "", 0, ""
        self.pos = i
        return "".join(out), None

    def _literal(self, section: str, i: int) -> tuple[int, bool]:
        """Follow a non-string value (nesting and inner strings tracked) to the `,` or `)` that ends it: (the index
        of that character, True), or (where to go on from, False) while the value goes on."""
        while i < len(section):
            c = section[i]
            if self.in_str:
                if c == "\\":
                    if i + 1 == len(section):
                        return i, False  # (the escaped character is not written yet)
                    self.literal += section[i : i + 2]
                    i += 2
                    continue
                if c == self.in_str:
                    self.in_str = ""
            elif c in "'\"":
                self.in_str = c
            elif c in "[{(":
                self.depth += 1
            elif c in "]})":
                if self.depth == 0:
                    return i, True
                self.depth -= 1
            elif c == "," and self.depth == 0:
                return i, True
            self.literal += c
            i += 1
        return i, False


class Pythonic(Family):
    name = "pythonic"
    triggers = (OPEN,)
    FIRST = Pattern(OPEN + "[{name}(")
    NEXT = Pattern(", {name}(")

    def __init__(self, in_content: bool = False) -> None:
        self.in_content = in_content  # the template renders no calls: they are written into the content

    def write(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return write_calls(calls)

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        got = listed_head(self.FIRST, self.NEXT, "]" + CLOSE, section, i, k)
        if not isinstance(got, tuple):
            return got
        slots, at = got
        return Head(slots["name"], PythonArgs(at))

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        """Each call ends with `)` and what follows it (`]`, or `,` before the next call): a string value's terminal
        takes in the quote that closes it and what follows, so that the string ends where the reader ends it
        (llguidance's terminals are greedy: a quote followed by anything else is the string's)."""
        g = PythonGrammar("py")
        rules = [f"STRING_BODY: {STRING_BODY}\n"]
        for end, close in (("end", ")]"), ("more", "),")):
            for t, tool in enumerate(tools):
                rules += call_rules(f"c{t}_{end}", tool, close, g)
            rules.append(f"call_{end}: " + " | ".join(f"c{t}_{end}" for t in range(len(tools))) + "\n")
        more = '(call_more " ")* ' if parallel else ""
        return f"calls: {lit(OPEN + '[')} {more}call_end {lit(CLOSE)}\n" + "".join(rules) + g.text()


def call_rules(name: str, tool: Tool, close: str, g: PythonGrammar) -> list[str]:
    """Rules for one call of `tool` ending with `close` (`)]` or `),`), from its function's name on. `{name}_vJ`:
    the key of parameter J is written; its value and the rest of the call follow (the parameters in the schema's
    order, each once at most, the required ones always)."""
    schema = tool.parameters or {}
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    keys = list(props)

    def nexts(j: int) -> tuple[list[int], bool]:
        """The parameters that may follow parameter j (-1: none yet), and whether the call may end after it."""
        out = []
        for k in range(j + 1, len(keys)):
            out.append(k)
            if keys[k] in required:
                return out, False
        return out, True

    if not props:  # (the schema lists no parameters: any, their values as Python writes them)
        pair = f'/{_IDENT}/ "=" {g.any_value()}'
        return [f'{name}: {lit(tool.name + "(")} ({pair} (", " {pair})*)? {lit(close)}\n']
    first, may_end = nexts(-1)
    alts = [f"{lit(keys[k] + '=')} {name}_v{k}" for k in first] + ([lit(close)] if may_end else [])
    rules = [f"{name}: {lit(tool.name + '(')} ({' | '.join(alts)})\n"]
    for j, key in enumerate(keys):
        after, may_end = nexts(j)
        sub = props[key] if isinstance(props[key], dict) else {}
        kind = sub.get("type") if isinstance(sub.get("type"), str) else None
        enum = sub.get("enum") if isinstance(sub.get("enum"), list) and sub.get("enum") else None
        follows = [(", " + keys[k] + "=", f" {name}_v{k}") for k in after] + ([(close, "")] if may_end else [])
        alts = []
        if kind in ("string", None) and enum is None:  # a string: its terminal takes in what follows it
            for m, (text, rest) in enumerate(follows):
                term = f"S_{name}_{j}_{m}".upper()
                rules.append(f'{term}: "\'" STRING_BODY {lit(chr(39) + text)}\n')
                alts.append(term + rest)
        if kind != "string" or enum is not None:
            value = _value(sub, kind, enum, g)
            alts += [f"{value} {lit(text)}{rest}" for text, rest in follows]
        rules.append(f"{name}_v{j}: " + " | ".join(alts) + "\n")
    return rules


def _value(schema: dict[str, Any], kind: str | None, enum: list[Any] | None, g: PythonGrammar) -> str:
    """A value but a free string: an object as JSON, a string of an enum quoted as the template quotes it, anything
    else as Python writes it."""
    if enum is not None and all(isinstance(v, str) for v in enum):
        return g.rule(" | ".join(lit("'" + v + "'") for v in enum))
    if kind == "object":
        return g.rule(f"%json {json.dumps(for_grammar(schema), ensure_ascii=False)}")
    if kind is None:  # (any value: the string terminals are its other alternative)
        obj = json.dumps(for_grammar({"type": "object"}))
        return g.rule(f'{PY_NUMBER} | "True" | "False" | "None" | {g.value({"type": "array"})} | %json {obj}')
    return g.value(schema)
