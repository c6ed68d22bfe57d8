"""Reading tool calls as the model writes them: a call's head (its name, and its id where the syntax has one), then
its arguments, streamed as the JSON text they are (or become) while they are written, then its tail.

A family (chat/families.py) finds heads and tails in its own syntax; an `ArgsReader` follows the arguments from
where the head ends. Every piece a reader gives out extends the ones before it, so the concatenation of the pieces
is the call's arguments text: the client's `function.arguments` deltas, and the history the agent sends back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

_decoder = json.JSONDecoder()
WS = " \t\r\n"
NUMBER_TEXT = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")  # a JSON number, as written


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the JSON object, as the model wrote it
    id: str | None = None  # where the syntax carries one


class ArgsReader:
    """Follows one call's arguments through the section text, from `start` on; `read` is called again as the text
    grows (each call gives the text so far, never less)."""

    def __init__(self, start: int) -> None:
        self.pos = start  # next character of the section to look at

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        """(new arguments text, the index in `section` where the arguments ended, or None while they go on).
        Raises ValueError when the text cannot be arguments."""
        raise NotImplementedError


class JsonArgs(ArgsReader):
    """Arguments written as a JSON object: given out character by character as written (strings, nesting and
    escapes followed so the object's end is known). A JSON string holding an object (some models write that) is
    read whole once complete."""

    def __init__(self, start: int) -> None:
        super().__init__(start)
        self.depth = 0
        self.in_string = self.escaped = False
        self.begun = False
        self.whole = False  # not an object: read as one value once complete

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        i, n = self.pos, len(section)
        if not self.begun:
            while i < n and section[i] in WS:
                i += 1
            if i == n:
                self.pos = i
                return "", None
            self.begun = True
            self.pos = i
            if section[i] != "{":
                self.whole = True
        if self.whole:
            return self._whole(section)
        start = i
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        while i < n:
            c = section[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.pos, self.depth, self.in_string, self.escaped = i, 0, False, False
                    return section[start:i], i
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return section[start:i], None

    def _whole(self, section: str) -> tuple[str, int | None]:
        try:
            _, end = _decoder.raw_decode(section, self.pos)
        except ValueError:
            if section[self.pos] != '"':
                raise ValueError("arguments are neither an object nor a string") from None
            return "", None  # (an unfinished string)
        text = arguments_text(section[self.pos : end])
        if text is None:
            raise ValueError("arguments are not a JSON object")
        return text, end


class WholeArgs(ArgsReader):
    """Arguments known whole when the head is read (a syntax whose call can only be read once complete)."""

    def __init__(self, start: int, arguments: str, end: int) -> None:
        super().__init__(start)
        self.arguments, self.end = arguments, end
        self.given = False

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        if self.given:
            return "", self.end
        self.given = True
        return self.arguments, self.end


@dataclass
class Head:
    """A call's head, read: its function, its id if the syntax writes one, and the reader of its arguments."""

    name: str
    args: ArgsReader
    id: str | None = None
    whole: bool = False  # the reader's end is the call's end (no tail to read)


# ---- JSON helpers the families share ---------------------------------------------------------------------------------


def json_chars(text: str) -> str:
    """`text` as the characters of a JSON string (escaped, without its quotes): a string value given out as it streams."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def decode_at(text: str, i: int) -> tuple[Any, int]:
    """The JSON value starting at text[i] (leading whitespace skipped) and the index after it; ValueError if none."""
    return _decoder.raw_decode(text, skip_ws(text, i))


def object_members(text: str, i: int) -> tuple[dict[str, str], int]:
    """The members of the JSON object at text[i] as raw value texts (exactly as written), and the index after it."""
    value, end = decode_at(text, i)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    raw: dict[str, str] = {}
    j = text.index("{", i) + 1
    for _ in value:
        key, j = decode_at(text, j)
        j = skip_ws(text, text.index(":", j) + 1)
        _, k = _decoder.raw_decode(text, j)
        raw[key] = text[j:k]
        j = k
        while text[j] in " \t\r\n,":
            j += 1
    return raw, end


def arguments_text(raw: str | None) -> str | None:
    """An arguments value as the text of a JSON object: an object as written, or a string that holds one."""
    if raw is None:
        return None
    value = json.loads(raw)
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


def call_from_object(text: str, i: int, args_key: str = "arguments") -> tuple[Call, int]:
    """A `{"name": ..., "arguments": {...}}` object at text[i]. Raises ValueError when it is not one."""
    members, end = object_members(text, i)
    name = json.loads(members["name"]) if "name" in members else None
    args = arguments_text(members.get(args_key, members.get("arguments", members.get("parameters"))))
    if not isinstance(name, str) or args is None:
        raise ValueError("not a call object")
    call_id = json.loads(members["id"]) if "id" in members else None
    return Call(name, args, call_id if isinstance(call_id, str) else None), end


class Pattern:
    """A head written as literal text and named slots (`{name}`, `{id}`, `{index}`), matched as the text grows. Whitespace in
    the literal text matches any run of whitespace (none included); a slot takes the characters of a function name
    (or an id)."""

    NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

    def __init__(self, text: str) -> None:
        self.parts: list[tuple[bool, str]] = []  # (is a slot, literal text or slot name)
        marked = text.replace("{id}", "\x00id\x00").replace("{name}", "\x00name\x00").replace("{index}", "\x00index\x00")
        for k, piece in enumerate(marked.split("\x00")):
            if piece:
                self.parts.append((k % 2 == 1, piece))

    def match(self, text: str, i: int) -> tuple[dict[str, str], int] | Literal[False] | None:
        """(slots, index after) when the head is complete at text[i]; None while it may still become one; False when
        it cannot."""
        slots: dict[str, str] = {}
        for is_slot, value in self.parts:
            if not is_slot:
                got = match_literal(text, i, value)
                if got is None or got is False:
                    return got
                i = got
                continue
            j = i
            while j < len(text) and text[j] in self.NAME_CHARS:
                j += 1
            if j == len(text):
                return None
            if j == i:
                return False
            slots[value] = text[i:j]
            i = j
        return slots, i


def match_literal(text: str, i: int, lit: str) -> int | Literal[False] | None:
    """Index after `lit` matched at text[i] (its whitespace flexible, whitespace before it skipped), None if the text
    ends first, False if not."""
    k = 0
    i = skip_ws(text, i)
    while k < len(lit):
        if lit[k] in WS:
            i = skip_ws(text, i)
            while k < len(lit) and lit[k] in WS:
                k += 1
            if i == len(text) and k < len(lit):
                return None
            continue
        if i == len(text):
            return None
        if text[i] != lit[k]:
            return False
        i += 1
        k += 1
    return i


def match_exact(text: str, i: int, lit: str) -> int | Literal[False] | None:
    """Index after `lit` at text[i] (exactly), None if the text ends first, False if it is not there."""
    if text.startswith(lit, i):
        return i + len(lit)
    return None if lit.startswith(text[i:]) else False


def hit(got: int | Literal[False] | None) -> bool:
    """Whether a match answered an index (False is an int to Python: this says what is meant)."""
    return got is not None and got is not False


def partial_mark(text: str, i: int, mark: str) -> int:
    """Length of the longest suffix of text[i:] that is a proper prefix of `mark` (text held back: `mark` may be
    arriving)."""
    for k in range(min(len(mark) - 1, len(text) - i), 0, -1):
        if text.endswith(mark[:k]):
            return k
    return 0
