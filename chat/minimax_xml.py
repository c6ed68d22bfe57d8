"""MiniMax-M3's tool calls: every tag behind the namespace token `]<]minimax[>[` (NS below), each parameter an element
named by its key, objects and lists expanded into elements as the template's `to_xml` does.

    NS<tool_call>\\n
    NS<invoke name="search">NS<query>kv cache</query-close>NS<filters>NS<tags>NS<item>py</item-close>...NS</invoke>\\n
    NS</tool_call>

(a close tag is NS then `</key>`). Strings are written as they are, booleans as `true`/`false`, numbers as Python
writes them; a null is left out. The derivation cannot find this syntax (a value's close tag holds its key), so it is
written here: read as the JSON the values mean (a string of a parameter the schema calls a string as it streams; the
others once complete, `true`, `false` and numbers as such, the rest as strings), and a grammar from the tools' schemas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from chat.calls import NUMBER_TEXT, WS, ArgsReader, Head, Pattern, json_chars, partial_mark
from chat.families import EMPTY, Family, listed_head
from chat.python_values import PY_NUMBER
from chat.value_grammar import INTEGER, Rules, lit
from protocol import Tool

NS = "]<]minimax[>["
OPEN, CLOSE = NS + "<tool_call>", NS + "</tool_call>"
INVOKE_END = NS + "</invoke>"
_NS_RX = re.escape(NS).replace("/", "\\/")
_KEY = r"[A-Za-z0-9_.\-]+"
SCALAR = re.compile(rf"true|false|{NUMBER_TEXT.pattern}")


class XmlArgs(ArgsReader):
    """One call's parameters, from after its invoke tag through NS</invoke>, given out as a JSON object."""

    def __init__(self, start: int, strings: frozenset[str]) -> None:
        super().__init__(start)
        self.strings = strings
        self.frames: list[list[Any]] = []  # [open char, members written] per open object or list
        self.state = "start"  # start | members | value | text
        self.key = ""  # the element whose value is read
        self.stream = False  # the value is a string given out as it comes
        self.text = ""

    def read(self, section: str, final: bool) -> tuple[str, int | None]:
        out: list[str] = []
        i, n = self.pos, len(section)
        if self.state == "start":
            out.append("{")
            self.frames, self.state = [["{", 0]], "members"
        while i < n:
            if self.state == "text":
                at = section.find(NS, i)
                upto = at if at >= 0 else n - partial_mark(section, i, NS)
                piece = section[i:upto]
                out.append(json_chars(piece) if self.stream else "")
                self.text += "" if self.stream else piece
                i = upto
                if at < 0:
                    break
                tag = self._tag(section, at)
                if tag is None:
                    break
                closing, name, i = tag
                if not closing:
                    raise ValueError(f"a tag inside a value at {at}")
                out.append('"' if self.stream else _scalar(self.text))
                self._member_done()
                continue
            j = i
            while j < n and section[j] in WS:
                j += 1
            tag = self._tag(section, j)
            if tag is None:
                if j < n and not NS.startswith(section[j : j + len(NS)]):
                    if self.state == "value":  # a scalar value (its leading whitespace its own)
                        self.state, self.text = "text", ""
                        self.stream = len(self.frames) == 1 and self.key in self.strings
                        out.append('"' if self.stream else "")
                        continue
                    raise ValueError(f"no tag at {j}")
                i = j if self.state == "members" else i
                break
            closing, name, after = tag
            if self.state == "value" and not closing:  # an object or a list opens
                char = "[" if name == "item" else "{"
                out.append(char)
                self.frames.append([char, 0])
                self.state = "members"
                continue
            if self.state == "value":  # an empty value
                out.append('""')
                self._member_done()
                i = after
                continue
            i = after
            if closing:  # the open object or list ends (and the element holding it)
                char, _ = self.frames.pop()
                out.append("}" if char == "{" else "]")
                if not self.frames:
                    self.pos = i
                    return "".join(out), i
                self._member_done()
                continue
            char, count = self.frames[-1]
            out.append(", " if count else "")
            if char == "{":
                out.append(json.dumps(name, ensure_ascii=False) + ": ")
            self.key, self.state = name, "value"
        self.pos = i
        return "".join(out), None

    def _member_done(self) -> None:
        self.frames[-1][1] += 1
        self.state = "members"

    @staticmethod
    def _tag(text: str, i: int) -> tuple[bool, str, int] | None:
        """(closing, name, index after) of a tag at text[i]; None when it is not (or not yet) one."""
        if not text.startswith(NS, i):
            return None
        m = re.compile(rf"<(/?)({_KEY})>").match(text, i + len(NS))
        if m is None:
            if re.compile(rf"<?/?({_KEY})?$").fullmatch(text, i + len(NS)):
                return None
            raise ValueError(f"no tag after the namespace token at {i}")
        return bool(m.group(1)), m.group(2), m.end()


def _scalar(text: str) -> str:
    """A value the schema does not call a string: `true`, `false` and numbers as such, anything else a string."""
    return text if SCALAR.fullmatch(text) else json.dumps(text, ensure_ascii=False)


class MinimaxXml(Family):
    name = "minimax-m3"
    triggers = (OPEN,)
    FIRST = Pattern(OPEN + "\n" + NS + '<invoke name="{name}">')
    NEXT = Pattern(NS + '<invoke name="{name}">')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        got = listed_head(self.FIRST, self.NEXT, CLOSE, section, i, k)
        if not isinstance(got, tuple):
            return got
        slots, at = got
        return Head(slots["name"], XmlArgs(at, strings.get(slots["name"], frozenset())))

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        g = XmlGrammar()
        alts = []
        for tool in tools:
            schema = tool.parameters or {}
            body = g.members(schema) if schema.get("properties") else f"{g.any_member()}*"
            alts.append(g.rule(f"{lit(NS + '<invoke name=' + json.dumps(tool.name) + '>')} {body} {lit(INVOKE_END + chr(10))}"))
        calls = "call+" if parallel else "call"
        return f"calls: {lit(OPEN + chr(10))} {calls} {lit(CLOSE)}\ncall: {' | '.join(alts)}\n" + g.text()


class XmlGrammar(Rules):
    """Lark rules for values written as `to_xml` writes them; each value rule writes its element's close tag too."""

    def __init__(self) -> None:
        super().__init__("xml")
        self.rules += [
            f"XML_TEXT: /(?s:.*)/ & ~/(?s:.*){_NS_RX}(?s:.*)/\n",  # (a value holds no namespace token)
            f"XML_ANY_CLOSE: /{_NS_RX}<\\/{_KEY}>/\n",
        ]
        self._any = ""

    def element(self, key: str, schema: Any) -> str:
        return f"{lit(NS + '<' + key + '>')} {self.value(schema, NS + '</' + key + '>')}"

    def members(self, schema: dict[str, Any]) -> str:
        """An object's properties in the schema's order, each at most once, the required ones always."""
        required = set(schema.get("required") or [])
        items = [(self.element(k, v), k in required) for k, v in (schema.get("properties") or {}).items()]
        return " ".join(f"({item})" if needed else f"({item})?" for item, needed in items) or '""'

    def value(self, schema: Any, close: str) -> str:
        """A value of `schema` and the close tag `close`."""
        end = lit(close)
        kind = schema.get("type") if isinstance(schema, dict) else None
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return self.rule(" | ".join(lit(v + close) for v in enum))
        if kind == "string":
            return self.rule("XML_TEXT", f"[suffix={end}]")
        if kind in ("integer", "number"):
            return self.rule(f"{INTEGER if kind == 'integer' else PY_NUMBER} {end}")
        if kind == "boolean":
            return self.rule(f'("true" | "false") {end}')
        if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            return self.rule(f"{self.members(schema)} {end}")
        if kind == "array":
            item = self.element("item", schema.get("items"))
            return self.rule(f"({item})* {end}")
        return self.any_value()  # (its close tag is any element's)

    def any_member(self) -> str:
        self.any_value()
        return self._any + "_member"

    def any_value(self) -> str:
        """Any value: text, or elements of any values; its close tag is not checked against its open tag."""
        if not self._any:
            a = self._any = "xml_any"
            self.rules.append(f"{a}_text[suffix=XML_ANY_CLOSE]: XML_TEXT\n")
            self.rules.append(f'{a}_member: {lit(NS + "<")} /{_KEY}/ ">" {a}\n')
            self.rules.append(f"{a}: {a}_text | {a}_member+ XML_ANY_CLOSE\n")
        return self._any
