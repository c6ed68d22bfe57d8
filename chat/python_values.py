"""Values written as Python writes them (`str(value)`: `True`, `None`, `[1, 'x', {'a': 2.5}]`), which templates show
the model when they format a value with Jinja's `string` filter (LFM2.5's pythonic calls, MiniCPM 5's and Seed-OSS's
tagged parameters): read back into JSON, and a grammar (llguidance Lark) that writes them as Python does.

The grammar covers what agents' tools use: strings (quoted as `repr` quotes them: `'...'`, or `"..."` when the
string holds a `'` and no `"`; `\\\\`, `\\n`, `\\r`, `\\t` escaped), string enums, integers, numbers (Python's
shortest form for at most 16 digits either side of the point), booleans, None, lists, objects (their properties in
the schema's order), anything else as any Python value.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from chat.value_grammar import ValueGrammar, lit

# Python's repr of a float: no trailing zeros but `.0` (`2.5`, `3.0`, `3`: an integer where JSON wrote one)
PY_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.0|\.[0-9]{0,15}[1-9])?/"
_CHAR = r"[^{q}\\\x00-\x1f\x7f]|\\[\\nrt]"
PY_STRING = (
    "/'(" + _CHAR.format(q="'") + ")*'/"  # (no `'` inside: repr uses `'`)
    + ' | /"(' + _CHAR.format(q="\"'") + ")*'(" + _CHAR.format(q='"') + ')*"/'  # (a `'` and no `"`: repr uses `"`)
)  # fmt: skip


def python_text(value: Any) -> str:
    """`value` as Jinja's `string` filter writes it (Python's `str`)."""
    return str(value)


def literal_json(text: str) -> str:
    """A value written as JSON or as Python (or both mixed: `[true, 'x']`), as JSON text. Raises ValueError."""
    t = text.strip()
    try:
        return json.dumps(json.loads(t), ensure_ascii=False)
    except ValueError:
        pass
    for candidate in (t, _json_words_to_python(t)):
        try:
            return json.dumps(ast.literal_eval(candidate), ensure_ascii=False)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    raise ValueError(f"not a value: {t[:40]!r}")


def _json_words_to_python(text: str) -> str:
    """`true`, `false` and `null` outside strings made Python's (a model may mix the two spellings)."""
    out, i, quote = [], 0, ""
    words = {"true": "True", "false": "False", "null": "None"}
    while i < len(text):
        c = text[i]
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < len(text):
                out.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = ""
            i += 1
            continue
        if c in "'\"":
            quote = c
        word = next((w for w in words if text.startswith(w, i) and not text[i + len(w) : i + len(w) + 1].isalnum()), None)
        if word and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            out.append(words[word])
            i += len(word)
            continue
        out.append(c)
        i += 1
    return "".join(out)


class PythonGrammar(ValueGrammar):
    """Collects the Lark rules of values written as Python writes them (`str()`); rule names start with `prefix`."""

    NUMBER = PY_NUMBER
    BOOLEAN = '"True" | "False"'
    NULL = '"None"'

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self._any = ""
        self._string = ""

    def any_value(self) -> str:
        if not self._any:
            self._any = f"{self.prefix}_any"
            a = self._any
            pair = f'{self.string()} ": " {a}'
            self.rules.append(
                f'{a}: {self.string()} | {PY_NUMBER} | "True" | "False" | "None" | "[" ({a} (", " {a})*)? "]"'
                f' | "{{" ({pair} (", " {pair})*)? "}}"\n'
            )
        return self._any

    def string(self) -> str:
        if not self._string:
            self._string = self.rule(PY_STRING)
        return self._string

    def enum(self, schema: dict[str, Any]) -> str | None:
        choices = schema.get("enum")
        if isinstance(choices, list) and choices and all(isinstance(v, str | int | float | bool) for v in choices):
            return self.rule(" | ".join(lit(repr(v)) for v in choices))
        return None

    def object(self, schema: dict[str, Any]) -> str:
        """Its properties in the schema's order (Python keeps the order they were written in); any object without."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return self.any_value()
        return self.members(props, list(props), set(schema.get("required") or []), lambda key: repr(key) + ": ")
