"""Muse Glimmer's ATEM turns: the reply is a sequence of messages, each a header naming its recipient, then a body.

    <|start|>assistant to=self<|message|>THINKING<|eom|>
    <|start|>assistant to=search<|message|><atem:function_calls>
    <atem:invoke name="search">
    <atem:parameter name="query">kv cache</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>                                  (<|eot|> after the turn's last message)
    <|start|>assistant to=user<|message|>REPLY<|eot|>

The prompt ends with `<|start|>assistant`, so the first header is ` to=...` alone (chat/message_parser.py reads the
messages). A message to one of the tools is a call, its parameters tagged as MiniMax M2's are (read by
chat/tagged_args.py's TaggedArgs: strings as they are, other values as JSON); to `self` it is thinking; anything else
is reply text. The template writes each call as a message
of its own and leaves out the reply text of a turn that calls tools.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from chat.calls import Head, Pattern, hit, match_literal
from chat.families import EMPTY, Family
from chat.message_parser import MESSAGE, START, MessageParser
from chat.output_parser import OpenCall, OutputParser, Piece, ReadSpec
from chat.piece_syntax import TYPES, Syntax
from chat.piece_syntax_grammar import tagged_rule
from chat.tagged_args import TaggedArgs
from chat.value_grammar import lit
from protocol import Tool

EOM, EOT = "<|eom|>", "<|eot|>"
OPEN, CLOSE = " to=self" + MESSAGE, EOM  # (the thinking, as a reasoning pair for the spec on the wire)
RECIPIENT = re.compile(r"to=(\S+)")
ATEM = Syntax(
    section_open="<atem:function_calls>\n", call_open='<atem:invoke name="', name_close='">\n',
    call_close="</atem:invoke>\n", call_sep="", section_close="</atem:function_calls>", tagged=True,
    key_open='<atem:parameter name="', key_close=dict.fromkeys(TYPES, '">'), value_close="</atem:parameter>\n",
)  # fmt: skip
BODY = Pattern(ATEM.section_open + ATEM.call_open + "{name}" + ATEM.name_close)
BODY_END = ATEM.call_close + ATEM.section_close


class Muse(Family):
    name = "muse"
    triggers = (" to=",)  # (a request's own: a message to one of its tools, `request_triggers`)
    reasoning = (OPEN, CLOSE)

    def request_triggers(self, tools: list[Tool]) -> tuple[str, ...]:
        return tuple(f" to={t.name}{MESSAGE}" for t in tools)

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        """The calls as the template writes them back, each a message of its own; from the first call's header on
        (a forced call may think first: its own message)."""
        rules, first, more = [], [], []
        for i, tool in enumerate(tools):
            rules.append(tagged_rule(ATEM, f"args{i}", tool.parameters or {"type": "object", "properties": {}}))
            body = f"{lit(ATEM.section_open + ATEM.call_open + tool.name + ATEM.name_close)} args{i} {lit(BODY_END)}"
            first.append(f"{lit(f' to={tool.name}{MESSAGE}')} {body}")
            more.append(f"{lit(f'{EOM}{START}assistant to={tool.name}{MESSAGE}')} {body}")
        head = "calls: " + ("" if lazy else "thought? ") + "first" + (" more*" if parallel else "") + "\n"
        thought = f"thought: {lit(OPEN)} thought_text {lit(START + 'assistant')}\n"
        thought += f"thought_text[suffix={lit(EOM)}]: /(?s:.*)/\n"
        alts = "first: " + "\n  | ".join(first) + "\nmore: " + "\n  | ".join(more) + "\n"
        return head + ("" if lazy else thought) + alts + "".join(rules)

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        return i  # (read by MuseParser, not through the section machinery)

    def parser(self, spec: ReadSpec) -> OutputParser:
        return MuseParser(spec)


class MuseParser(MessageParser):
    """Reads a Muse Glimmer reply as it streams: a message to one of the tools is a call, its body tagged parameters."""

    ENDS = (EOM, EOT, START)
    BLANK_TAIL_IS_TEXT = False

    def __init__(self, spec: ReadSpec) -> None:
        super().__init__(spec)
        self.body = ""  # a call's body so far
        self.args: TaggedArgs | None = None
        self.args_end: int | None = None

    def _recipient(self, header: str) -> str | None:
        recipient = RECIPIENT.search(header)
        return recipient.group(1) if recipient else "user"

    def _thinking(self, header: str) -> bool:
        return self._recipient(header) == "self"

    def _call_opened(self) -> None:
        self.body, self.args, self.args_end = "", None, None

    def _call_text(self, out: Piece, call: OpenCall, text: str, final: bool) -> None:
        """Read the call's body as far as it is written (`final`: it ends here)."""
        self.body += text
        if self.args is None:
            got = BODY.match(self.body, 0)
            if got is None or got is False:
                return  # (not written yet; or not a call's body: the call stays cut)
            self.args = TaggedArgs(got[1], ATEM, self.spec.strings.get(call.name, frozenset()))
        if self.args_end is None:
            try:
                piece, self.args_end = self.args.read(self.body, final)
            except ValueError:
                self.args_end = -1  # (not parameters after all: the call ends cut)
                return
            if piece:
                call.arguments += piece
                self._args(out, call.index, piece)
        if self.args_end is not None and self.args_end >= 0 and not call.done:
            call.done = hit(match_literal(self.body, self.args_end, BODY_END))

    def _end_message(self, cut: bool) -> None:
        if not cut:  # (a call's end is its body's: read in `_call_text`)
            self.call, self.kind = None, "content"
