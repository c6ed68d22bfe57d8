"""A tool-call syntax known by its literal pieces (derived from the template by chat/derive.py), read and written.

    section := section_open call (call_sep call)* section_close
    call    := call_open NAME name_close ARGS call_close
    ARGS    := a JSON object                                              (json arguments)
             | (key_open KEY key_close[type] VALUE value_close)*          (tagged arguments)

The pieces may hold slots: `{id}` (the call's id, where the template writes it) and `{index}` (the call's position,
from `index_base`). Tagged values are written raw when they are strings (a key_close may say the type, as DeepSeek's
`string="true"` does; else the tool's schema does), and as JSON otherwise (or as Python writes them, where the
template does: `True`, `{'a': 1}`); a string value ends at the first `value_close`, or is wrapped (`string_wrap`:
MiniCPM 5's CDATA) where it holds a character the template wraps it for.

| templates (examples) | section_open | call_open | name_close | ARGS |
| --- | --- | --- | --- | --- |
| Qwen3-Coder, Qwen3.5, Nemotron 3 | | `<tool_call>\\n<function=` | `>\\n` | `<parameter=K>\\nV\\n</parameter>\\n` |
| GLM-4.6 / 4.7 | | `<tool_call>` | `\\n` | `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` |
| MiniMax M2 | `<minimax:tool_call>\\n` | `<invoke name="` | `">\\n` | `<parameter name="K">V</parameter>\\n` |
| DeepSeek V3.1 | its tool-calls-begin marker | its tool-call-begin marker | its tool-sep marker | JSON |
| Kimi K2 | `<\\|tool_calls_section_begin\\|>` | `<\\|tool_call_begin\\|>functions.` | `:{index}` + argument marker | JSON |
| MiniCPM 5 | | `<function name="` | `">` | `<param name="K">V</param>`, V in CDATA if it holds `<`, `&`, a newline |
| GigaChat 3 (one call) | | `<\\|message_sep\\|>\\n\\nfunction call<\\|role_sep\\|>\\n{"name": "` | `", "arguments": ` | JSON |
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from chat.calls import WS, ArgsReader, Head, JsonArgs, Pattern, hit, match_exact, match_literal
from chat.families import ALNUM, Family
from protocol import Tool

EMPTY: Mapping[str, frozenset[str]] = {}

TYPES = ("string", "integer", "number", "boolean", "object", "array")
SLOT = re.compile(r"\{(?:id|index)\}")
ID_REGEX = "/[a-zA-Z0-9]{9}/"  # (ids we make for these syntaxes: 9 letters or digits, which every template takes)


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


@dataclass(frozen=True)
class Syntax:
    """The literal pieces of a call syntax (see the module docstring)."""

    section_open: str
    call_open: str
    name_close: str
    call_close: str
    call_sep: str
    section_close: str
    index_base: int = 0
    tagged: bool = False
    key_open: str = ""
    key_close: dict[str, str] = field(default_factory=dict)  # by JSON type (all of TYPES)
    value_close: str = ""
    python_values: tuple[str, ...] = ()  # the types the template writes as Python does (`True`, `{'a': 1}`)
    single: bool = False  # the template writes one call per turn (no call_sep)
    # (open, close, characters): a string holding one of the characters is written between open and close (CDATA)
    string_wrap: tuple[str, ...] = ()
    trigger: str = ""  # the section's trigger, where its first word is not enough (see DerivedFamily)

    def wire(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v or k not in ("string_wrap", "trigger")}  # (as before them)
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_wire(text: str) -> Syntax:
        d = json.loads(text)
        d["python_values"] = tuple(d.get("python_values", ()))
        d["string_wrap"] = tuple(d.get("string_wrap", ()))
        return Syntax(**d)

    # ---- writing (what the template renders, for the derivation's check) ----

    def fill(self, piece: str, call_id: str, index: int) -> str:
        return piece.replace("{id}", call_id).replace("{index}", str(index + self.index_base))

    def write(self, calls: list[tuple[str, dict[str, Any], str]]) -> str:
        """The section for calls (name, arguments, id), as the template writes it."""
        parts = [self.section_open]
        for k, (name, args, call_id) in enumerate(calls):
            if k:
                parts.append(self.call_sep)
            parts += [self.fill(self.call_open, call_id, k), name, self.fill(self.name_close, call_id, k)]
            if self.tagged:
                for key, value in args.items():
                    kind = json_type(value)
                    parts += [self.key_open, key, self.key_close[kind], self.value_text(value), self.value_close]
            else:
                parts.append(json.dumps(args, ensure_ascii=False))
            parts.append(self.fill(self.call_close, call_id, k))
        parts.append(self.section_close)
        return "".join(parts)

    def value_text(self, value: Any) -> str:
        if isinstance(value, str):
            wrap = self.string_wrap
            return wrap[0] + value + wrap[1] if wrap and any(c in value for c in wrap[2]) else value
        return str(value) if json_type(value) in self.python_values else json.dumps(value, ensure_ascii=False)

    @property
    def typed_keys(self) -> bool:
        """Whether the key_close says whether a value is a string."""
        return self.key_close.get("string") != self.key_close.get("integer")


class TaggedArgs(ArgsReader):
    """Tagged arguments read as they are written, given out as the JSON object they mean: a string value character
    by character (JSON-escaped), another value once its close is seen. Keys and values are matched exactly (a
    value's own leading whitespace is the value's)."""

    def __init__(self, start: int, syntax: Syntax, strings: frozenset[str]) -> None:
        super().__init__(start)
        self.s = syntax
        self.strings = strings  # the parameters the tool's schema says are strings
        self.state = "between"  # between | key | value
        self.is_string = False
        self.wrapped: bool | None = None  # the string value is wrapped (None: not known yet)
        self.value = ""  # a non-string value's text so far
        self.count = 0
        self.closers = sorted(((v, t) for t, v in syntax.key_close.items()), key=lambda vt: -len(vt[0]))
        self.call_close = SLOT.split(syntax.call_close)[0]  # (up to a slot: enough to see the arguments end)

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        out: list[str] = []
        s, i, n = self.s, self.pos, len(section)
        while i < n:
            if self.state == "between":  # a parameter's key, or the call's close
                to_key = match_literal(section, i, s.key_open)
                to_end = match_literal(section, i, self.call_close) if self.call_close.strip(WS) else False
                if hit(to_key) and not (hit(to_end) and len(self.call_close) > len(s.key_open)):
                    self.state = "key"
                    i = to_key  # type: ignore[assignment]
                    continue
                if hit(to_end) or (not self.call_close and to_key is False):
                    out.append("}" if self.count else "{}")
                    self.pos = i
                    return "".join(out), i
                if to_key is None or to_end is None:
                    break
                raise ValueError(f"no parameter or call close at {i}")
            if self.state == "key":
                got = self._key(section, i)
                if got is None:
                    break
                key, kind, i = got
                self.is_string = kind == "string" if s.typed_keys else key in self.strings
                out.append(("{" if not self.count else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
                out.append('"' if self.is_string else "")
                self.count += 1
                self.state, self.value, self.wrapped = "value", "", None
                continue
            if self.wrapped is None and self.is_string and s.string_wrap:  # (a string opens wrapped, or not)
                opened = match_exact(section, i, s.string_wrap[0])
                if opened is None:
                    break
                self.wrapped, i = opened is not False, (i if opened is False else opened)
            end = s.string_wrap[1] + s.value_close if self.wrapped else s.value_close
            close = section.find(end, i)  # a value ends at the first value_close (or wrap close)
            upto = close if close >= 0 else n - _partial(section, i, end)
            if self.is_string:
                out.append(json.dumps(section[i:upto], ensure_ascii=False)[1:-1])
            else:
                self.value += section[i:upto]
            i = upto
            if close < 0:
                break
            out.append('"' if self.is_string else value_json(self.value))
            self.state, i = "between", close + len(end)
        self.pos = i
        return "".join(out), None

    def _key(self, section: str, i: int) -> tuple[str, str, int] | None:
        """(key, type, index after the key's close), or None while they are not all written."""
        j = i
        while j < len(section) and section[j] in Pattern.NAME_CHARS:
            j += 1
        if j == len(section):
            return None
        waiting = False
        for closer, kind in self.closers:
            got = match_exact(section, j, closer)
            if got is None:
                waiting = True
            elif got is not False:
                return section[i:j], kind, got
        if waiting:
            return None
        raise ValueError(f"no key close at {j}")


def _partial(text: str, i: int, mark: str) -> int:
    """Length of the longest suffix of text[i:] that is a proper prefix of `mark`."""
    for k in range(min(len(mark) - 1, len(text) - i), 0, -1):
        if text.endswith(mark[:k]):
            return k
    return 0


def value_json(text: str) -> str:
    """A tagged non-string value as JSON: as JSON, as a Python literal (`True`, `{'a': 1}`), else a string."""
    t = text.strip(WS)
    try:
        return json.dumps(json.loads(t), ensure_ascii=False)
    except ValueError:
        pass
    try:
        return json.dumps(ast.literal_eval(t), ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return json.dumps(text, ensure_ascii=False)


class DerivedFamily(Family):
    """A family whose syntax was derived from its template (chat/derive.py)."""

    name = "derived"
    id_alphabet, id_length = ALNUM, 9

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
        lead = SLOT.split((syntax.section_open + syntax.call_open).lstrip(WS))[0]
        trigger = lead.split()[0] if lead.split() else lead
        self.triggers = (syntax.trigger or trigger,)
        self.first = Pattern(syntax.section_open + syntax.call_open + "{name}" + syntax.name_close)
        self.next = Pattern(syntax.call_sep + syntax.call_open + "{name}" + syntax.name_close)
        self.close = SLOT.split(syntax.call_close)[0]

    @property
    def key(self) -> str:
        return "derived:" + self.syntax.wire()

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        from chat.derived_grammar import grammar_rules  # (it reads Syntax)

        return grammar_rules(self.syntax, tools, parallel, lazy)

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        s = self.syntax
        if k == 0:  # (the section's own opening whitespace may be missing: the text before it lost its own)
            got = self.first.match(section, i)
            if got is False and s.section_open[:1] in WS:
                got = Pattern(s.section_open.lstrip(WS) + s.call_open + "{name}" + s.name_close).match(section, i)
        elif s.single:
            return i
        else:
            got = self.next.match(section, i)
        if got is None:
            return None
        if got is False:
            if k == 0:
                return i
            end = match_literal(section, i, s.section_close) if s.section_close.strip(WS) else i
            return None if end is None else (i if end is False else end)
        slots, at = got
        name = slots["name"]
        reader: ArgsReader = TaggedArgs(at, s, strings.get(name, frozenset())) if s.tagged else JsonArgs(at)
        return Head(name, reader, slots.get("id"))

    def tail(self, section: str, i: int) -> int | None:
        if not self.close:
            return i
        got = match_literal(section, i, self.close)
        if got is None:
            return None
        if got is False:
            return i
        rest = self.syntax.call_close[len(self.close) :]
        if rest:  # a slot in the close (an index): read through it
            slot = Pattern(rest.replace("{id}", "{name}").replace("{index}", "{name}")).match(section, got)
            if slot is None:
                return None
            return got if slot is False else slot[1]
        return got
