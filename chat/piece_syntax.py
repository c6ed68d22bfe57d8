"""A tool-call syntax known by its literal pieces (derived from the template by chat/syntax_derivation.py), written
as the template writes it; read by chat/tagged_args.py and chat/derived_family.py, its grammar in
chat/piece_syntax_grammar.py.

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

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

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
