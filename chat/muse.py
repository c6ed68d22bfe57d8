"""Muse Glimmer's ATEM turns: the reply is a sequence of messages, each a header naming its recipient, then a body.

    <|start|>assistant to=self<|message|>THINKING<|eom|>
    <|start|>assistant to=search<|message|><atem:function_calls>
    <atem:invoke name="search">
    <atem:parameter name="query">kv cache</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>                                  (<|eot|> after the turn's last message)
    <|start|>assistant to=user<|message|>REPLY<|eot|>

The prompt ends with `<|start|>assistant`, so the first header is ` to=...` alone. A message to one of the tools is
a call, its parameters tagged as MiniMax M2's are (read by chat/derived.py's TaggedArgs: strings as they are, other
values as JSON); to `self` it is thinking; anything else is reply text. The template writes each call as a message
of its own and leaves out the reply text of a turn that calls tools.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from chat.calls import Head, Pattern, WholeArgs, hit, match_literal
from chat.derived import TYPES, Syntax, TaggedArgs
from chat.derived_grammar import tagged_rule
from chat.families import EMPTY, Family, lit
from chat.output import OpenCall, OutputParser, OutputSpec, Piece, partial_suffix
from protocol import Tool, ToolCallDelta

START, MESSAGE, EOM, EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
ENDS = (EOM, EOT, START)
OPEN, CLOSE = " to=self" + MESSAGE, EOM  # (the thinking, as a reasoning pair for the spec on the wire)
RECIPIENT = re.compile(r"to=(\S+)")
HEADER_MAX = 200  # a header longer than this is no header (a model that does not write these turns): reply text
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

    def parser(self, spec: OutputSpec) -> OutputParser:
        return MuseParser(spec)


class MuseParser(OutputParser):
    """Reads a Muse Glimmer reply as it streams (chat/output.py's interface)."""

    def __init__(self, spec: OutputSpec) -> None:
        super().__init__(spec)
        self.state = "header"  # header | body
        self.kind = "content"  # of the current body: content | reasoning | call
        self.call: OpenCall | None = None
        self.body = ""  # a call's body so far
        self.args: TaggedArgs | None = None
        self.args_end: int | None = None

    @property
    def in_reasoning(self) -> bool:
        return self.state == "body" and self.kind == "reasoning"

    @property
    def opening_reasoning(self) -> bool:
        return self.state == "header"  # (the header may open the thinking)

    def _feed(self, text: str) -> Piece:
        out = Piece()
        self.buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Piece:
        out = Piece()
        while self._step(out, final=True):
            pass
        if self.state == "header" and self.buf.strip():  # (no header after all: reply text)
            self._emit(out, "content", self.buf, True)
        self.buf = ""
        return out

    def _step(self, out: Piece, final: bool) -> bool:
        if self.state == "header":
            at = self.buf.find(MESSAGE)
            if at < 0:
                if len(self.buf) > HEADER_MAX:
                    self.state, self.kind = "body", "content"  # not these turns: reply text from here
                    return True
                return False
            self._open(out, self.buf[:at])
            self.buf = self.buf[at + len(MESSAGE) :]
            self.state = "body"
            return True
        hits = [(j, m) for m in ENDS if (j := self.buf.find(m)) >= 0]
        if hits:
            j, mark = min(hits)
            self._emit(out, self.kind, self.buf[:j], True)
            thought = self.kind == "reasoning"
            self.buf = self.buf[j + (0 if mark == START else len(mark)) :]
            if thought:
                self.reasoning_end = self.fed - len(self.buf)
            self.call, self.kind, self.state = None, "content", "header"
            return True
        keep = 0 if final else partial_suffix(self.buf, ENDS)
        self._emit(out, self.kind, self.buf[: len(self.buf) - keep], final)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _open(self, out: Piece, header: str) -> None:
        """A message's header, read: where its body goes."""
        recipient = RECIPIENT.search(header)
        name = recipient.group(1) if recipient else "user"
        if name in self.spec.tool_names:
            assert self.family is not None
            call = OpenCall(len(self.calls), self.family.new_id(), name, Head(name, WholeArgs(0, "", 0)))
            self.calls.append(call)
            self.call, self.kind, self.body, self.args, self.args_end = call, "call", "", None, None
            out.calls.append(ToolCallDelta(index=call.index, id=call.id, name=name, arguments=""))
        elif name == "self":
            self.kind, self.reasoned = "reasoning", True
        else:
            self.kind = "content"

    def _emit(self, out: Piece, kind: str, text: str, final: bool) -> None:
        if kind == "call" and self.call is not None:
            self._call_body(out, self.call, text, final)
        elif not text:
            return
        elif kind == "reasoning":
            self._reason(out, text)
        else:
            self.content.append(text)
            out.content += text

    def _call_body(self, out: Piece, call: OpenCall, text: str, final: bool) -> None:
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
