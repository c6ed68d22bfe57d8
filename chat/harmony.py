"""gpt-oss's harmony format: the reply is a sequence of messages, each a header and a body, on channels.

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>REPLY                          (<|return|> ends it: a stop token)
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}   (<|call|>: a stop token)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}

The prompt ends with `<|start|>assistant`, so the first header has no `<|start|>`. A message to `functions.NAME` is a
call (its body the arguments, streamed as written), the analysis channel is thinking, the others are reply text.
The template writes calls back with the recipient before the channel, one call per message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from chat.calls import Head, WholeArgs
from chat.families import EMPTY, Family
from chat.output import OpenCall, OutputParser, OutputSpec, Piece, partial_suffix
from protocol import Tool, ToolCallDelta

OPEN, CLOSE = "<|channel|>analysis<|message|>", "<|end|>"  # (as a reasoning pair, for the spec on the wire)
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
HEADER_MAX = 200  # a header longer than this is no header (a model that does not write harmony): reply text


class Harmony(Family):
    name = "harmony"
    triggers = ("to=functions.",)  # (auto: free text, thinking included, until a message to a function begins)
    reasoning = (OPEN, CLOSE)  # (its thinking is a channel)

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        """One call, as the template writes it back (the prompt ends with `<|start|>assistant`; lazily, from the
        recipient on, after the model's own `<|start|>assistant`)."""
        head = '"to=functions."' if lazy else '" to=functions."'
        rules = f"calls: {head} fn\n"
        return rules + self._named(tools, '"{name}<|channel|>commentary json<|message|>" {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        return i  # (read by HarmonyParser, not through the section machinery)

    def parser(self, spec: OutputSpec) -> OutputParser:
        return HarmonyParser(spec)


class HarmonyParser(OutputParser):
    """Reads a harmony reply as it streams (chat/output.py's interface)."""

    def __init__(self, spec: OutputSpec) -> None:
        super().__init__(spec)
        self.state = "header"
        self.header = ""
        self.kind = "content"  # of the current body: content | reasoning | call
        self.call: OpenCall | None = None

    @property
    def in_reasoning(self) -> bool:
        return self.state == "body" and self.kind == "reasoning"

    @property
    def opening_reasoning(self) -> bool:
        return self.state == "header"  # (the header may open the analysis channel)

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
        if self.state == "header" and self.buf:  # (no header after all: reply text)
            self._emit(out, "content", self.buf)
        self.buf = ""
        return out

    def _step(self, out: Piece, final: bool) -> bool:
        if self.state == "header":
            at = self.buf.find("<|message|>")
            if at < 0:
                if len(self.buf) > HEADER_MAX:
                    self.state, self.kind = "body", "content"  # not harmony: reply text from here
                    return True
                return False
            self._open(out, self.buf[:at])
            self.buf = self.buf[at + len("<|message|>") :]
            self.state = "body"
            return True
        hits = [(j, m) for m in ENDS if (j := self.buf.find(m)) >= 0]
        if hits:
            j, mark = min(hits)
            self._emit(out, self.kind, self.buf[:j])
            thought = self.kind == "reasoning"
            self._end_message()
            self.buf = self.buf[j + (0 if mark == "<|start|>" else len(mark)) :]
            if thought:
                self.reasoning_end = self.fed - len(self.buf)
            self.state = "header"
            return True
        keep = 0 if final else partial_suffix(self.buf, ENDS)
        self._emit(out, self.kind, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        if final:
            self._end_message(cut=True)
        return False

    def _open(self, out: Piece, header: str) -> None:
        """A message's header, read: where its body goes."""
        recipient = RECIPIENT.search(header)
        channel = CHANNEL.search(header)
        if recipient and recipient.group(1) in self.spec.tool_names:
            name = recipient.group(1)
            assert self.family is not None
            call = OpenCall(len(self.calls), self.family.new_id(), name, Head(name, WholeArgs(0, "", 0)))
            self.calls.append(call)
            self.call, self.kind = call, "call"
            out.calls.append(ToolCallDelta(index=call.index, id=call.id, name=name, arguments=""))
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
            self.reasoned = True
        else:
            self.kind = "content"

    def _emit(self, out: Piece, kind: str, text: str) -> None:
        if not text:
            return
        if kind == "call" and self.call is not None:
            self.call.arguments += text
            self._args(out, self.call.index, text)
        elif kind == "reasoning":
            self._reason(out, text)
        else:
            self.content.append(text)
            out.content += text

    def _end_message(self, cut: bool = False) -> None:
        if self.call is not None:
            self.call.done = not cut
        self.call = None
        self.kind = "content"
