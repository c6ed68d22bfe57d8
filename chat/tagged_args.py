"""Tagged arguments (`key_open KEY key_close VALUE value_close`, chat/piece_syntax.py) read as they are written: a
derived syntax's, and Muse Glimmer's."""

from __future__ import annotations

import ast
import json

from chat.calls import WS, ArgsReader, Pattern, hit, json_chars, match_exact, match_literal, partial_mark
from chat.piece_syntax import SLOT, Syntax


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
            upto = close if close >= 0 else n - partial_mark(section, i, end)
            if self.is_string:
                out.append(json_chars(section[i:upto]))
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
