"""The grammar (llguidance Lark) of a tool-call syntax known by its pieces (chat/piece_syntax.py): the section for a
request's tools, written as the template writes it."""

from __future__ import annotations

import json
import re
from typing import Any

from chat.calls import WS
from chat.piece_syntax import ID_REGEX, Syntax
from chat.python_values import PythonGrammar
from chat.schema import for_grammar
from chat.value_grammar import lit
from protocol import Tool


def slotted(piece: str) -> str:
    """A Lark sequence for a piece with slots."""
    parts = []
    for k, chunk in enumerate(piece.replace("{id}", "\x00id\x00").replace("{index}", "\x00index\x00").split("\x00")):
        if k % 2:
            parts.append(ID_REGEX if chunk == "id" else "/[0-9]+/")
        elif chunk:
            parts.append(lit(chunk))
    return " ".join(parts) or '""'


MAX_INDEXED_CALLS = 8  # a syntax that numbers its calls writes at most this many in one turn under a grammar


def grammar_rules(s: Syntax, tools: list[Tool], parallel: bool, lazy: bool) -> str:
    """Lark rules defining `calls` (the whole section) for these tools. `lazy`: the section starts at its trigger
    (the leading whitespace of section_open is the model's free text). A syntax that numbers its calls (`{index}`)
    gets each call's own number written out, as the template writes it back."""
    opening = s.section_open.lstrip(WS) if lazy else s.section_open
    many = parallel and not s.single
    pieces = (s.call_open, s.name_close, s.call_close)
    indexed = any("{index}" in p for p in pieces)
    rules, args = [], []
    for i, tool in enumerate(tools):
        schema = dict(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}
        schema.setdefault("type", "object")
        if s.tagged:
            rules.append(tagged_rule(s, f"args{i}", schema))
        else:
            rules.append(f"args{i}: %json {json.dumps(for_grammar(schema), ensure_ascii=False)}\n")
        args.append((tool.name, f"args{i}"))
    counts = range(MAX_INDEXED_CALLS if many else 1) if indexed else [None]
    for k in counts:

        def piece(text: str, k: int | None = k) -> str:
            return slotted(text if k is None else text.replace("{index}", str(k + s.index_base)))

        alts = [f"{piece(s.call_open)} {lit(name)} {piece(s.name_close)} {rule} {piece(s.call_close)}" for name, rule in args]
        rules.append(f"call{'' if k is None else k}: " + "\n  | ".join(alts) + "\n")
    if indexed:  # calls: call0 (sep call1 (sep call2 ...)?)?
        chain = ""
        for k in reversed(counts):
            chain = f"call{k}" + (f" ({slotted(s.call_sep)} {chain})?" if chain else "")
        body = chain
    else:
        body = "call" + (f" ({slotted(s.call_sep)} call)*" if many else "")
    return f"calls: {slotted(opening)} {body} {slotted(s.section_close)}\n" + "".join(rules)


def tagged_rule(s: Syntax, name: str, schema: dict[str, Any]) -> str:
    """`name`: the tool's parameters in its schema's order, the required ones always written."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if not props:  # any parameters
        free = f"{name}_v[suffix={lit(s.value_close)}]: /(?s:.*)/\n"
        key = f"{lit(s.key_open)} /[A-Za-z_][A-Za-z0-9_.-]*/ {lit(s.key_close['string'])} {name}_v"
        return f"{name}: ({key})*\n" + free
    parts, rules = [], []
    for j, (key, sub) in enumerate(props.items()):
        kind = sub.get("type") if isinstance(sub, dict) and isinstance(sub.get("type"), str) else None
        vname = f"{name}_{j}"
        choices = sub.get("enum") if isinstance(sub, dict) else None
        if (kind == "string" or kind is None) and isinstance(choices, list) and all(isinstance(c, str) for c in choices):
            closer = s.key_close["string"]  # (the values written raw, one of them)
            rules.append(f"{vname}: " + " | ".join(lit(c) for c in choices) + "\n")
            value = f"{vname} {lit(s.value_close)}"
        elif kind == "string" or (kind is None and not isinstance(sub, dict)):
            closer = s.key_close["string"]
            rules.append(string_rules(s, vname))
            value = vname
        else:
            closer = s.key_close.get(kind or "object", s.key_close["object"])
            if kind == "boolean" and "boolean" in s.python_values:
                rules.append(f'{vname}: "True" | "False"\n')
            elif kind in ("object", "array") and kind in s.python_values:  # (`{'a': 1}`, `['x']`: as Python writes them)
                py = PythonGrammar(f"{vname}_py")
                rules.append(f"{vname}: {py.value(sub)}\n" + py.text())
            else:
                sub_schema = for_grammar(sub if isinstance(sub, dict) else {})
                rules.append(f"{vname}: %json {json.dumps(sub_schema, ensure_ascii=False)}\n")
            value = f"{vname} {lit(s.value_close)}"
        item = f"{lit(s.key_open)} {lit(key)} {lit(closer)} {value}"
        parts.append(f"({item})" if key in required else f"({item})?")
    return f"{name}: {' '.join(parts)}\n" + "".join(rules)


def string_rules(s: Syntax, vname: str) -> str:
    """`vname`: a free string value, then its close; wrapped where the template wraps it (it holds a wrap character:
    then the wrap's close may not be in it), else as it is (then no wrap character is in it)."""
    close = lit(s.value_close)
    if not s.string_wrap:
        return f"{vname}[suffix={close}]: /(?s:.*)/\n"
    opened, closed, chars = s.string_wrap
    cls = "".join({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, re.escape(c)) for c in chars).replace("/", "\\/")
    body = f"{vname.upper()}_BODY"
    return (
        f"{vname}: {vname}_raw | {lit(opened)} {vname}_wrapped\n{vname}_raw[suffix={close}]: /[^{cls}]*/\n"
        f"{body}: /[^{cls}]*[{cls}](?s:.*)/ & ~/(?s:.*){re.escape(closed).replace('/', chr(92) + '/')}(?s:.*)/\n"
        f"{vname}_wrapped[suffix={lit(closed + s.value_close)}]: {body}\n"
    )
