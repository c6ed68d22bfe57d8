"""The family of a tool-call syntax derived from its template (chat/syntax_derivation.py): its section read with the
syntax's pieces (chat/piece_syntax.py), its grammar from them."""

from __future__ import annotations

from collections.abc import Mapping

from chat.calls import WS, ArgsReader, Head, JsonArgs, Pattern, match_literal
from chat.families import ALNUM, EMPTY, Family, closing
from chat.piece_syntax import SLOT, Syntax
from chat.piece_syntax_grammar import grammar_rules
from chat.tagged_args import TaggedArgs
from protocol import Tool

KEY_PREFIX = "derived:"  # a derived family's key: this, then its syntax as JSON (chat/family_registry.py reads it)


class DerivedFamily(Family):
    """A family whose syntax was derived from its template."""

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
        return KEY_PREFIX + self.syntax.wire()

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
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
            return closing(section, i, s.section_close) if s.section_close.strip(WS) else i
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
