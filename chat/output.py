"""How to read a request's reply (`OutputSpec`): the tool-call family, the request's tools, the thinking tags; its form
on the wire (a client reading direct replies gets it in `placed`), and the reader it makes (chat/output_parser.py:
a family's own reader, or the tool-call section machinery of chat/section_parser.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chat.families import Family
from chat.family_registry import family_named
from chat.output_parser import OutputParser
from chat.section_parser import SectionParser
from protocol import ReplyFormat


@dataclass(frozen=True)
class OutputSpec:
    """How to read a request's reply. `family` None: no tool calls to look for."""

    family: Family | None = None
    tool_names: frozenset[str] = frozenset()
    reasoning: tuple[str, str] | None = None
    in_reasoning: bool = False  # the prompt ended inside an open reasoning tag
    strings: dict[str, frozenset[str]] = field(default_factory=dict)  # each tool's string parameters (tagged syntaxes)

    def parser(self) -> OutputParser:
        own = self.family.parser(self) if self.family is not None else None  # (gpt-oss's and Muse's messages)
        return own if own is not None else SectionParser(self)

    def wire(self) -> ReplyFormat:
        """As a client reading direct replies gets it (in `placed`)."""
        return ReplyFormat(
            family=self.family.key if self.family is not None else "",
            tool_names=sorted(self.tool_names),
            reasoning=list(self.reasoning or ()),
            in_reasoning=self.in_reasoning,
            string_args=sorted([tool, param] for tool, params in self.strings.items() for param in params),
        )

    @staticmethod
    def from_wire(fmt: ReplyFormat) -> OutputSpec:
        """The spec of a `placed` message's format. ValueError when it names what this side does not know."""
        try:
            family = family_named(fmt.family) if fmt.family else None
        except KeyError:
            raise ValueError(f"unknown tool-call family {fmt.family!r}") from None
        if fmt.reasoning and len(fmt.reasoning) != 2:
            raise ValueError(f"reasoning must be [open, close], got {fmt.reasoning!r}")
        reasoning = (fmt.reasoning[0], fmt.reasoning[1]) if fmt.reasoning else None
        strings: dict[str, set[str]] = {}
        for pair in fmt.string_args:
            if len(pair) != 2:
                raise ValueError(f"string_args items are [tool, parameter], got {pair!r}")
            strings.setdefault(pair[0], set()).add(pair[1])
        frozen = {tool: frozenset(params) for tool, params in strings.items()}
        return OutputSpec(family, frozenset(fmt.tool_names), reasoning, fmt.in_reasoning, frozen)
