"""The tool-call section machinery: a reply read as it streams for the families whose calls sit in a section that a
trigger opens (hand-written ones in chat/families.py, derived ones in chat/derived_family.py), and for replies without
tools (`family` None: reasoning and text only).

Reply text is sent as soon as it cannot be the start of a tool-call section or of a reasoning tag. A tool call is
sent while it is written: its id and name once its head is read, then its arguments in pieces (the family's reader
gives them out as JSON text as they come). What looked like a call but is not one (no head of the syntax, or a
function the request does not have) is reply text after all; a call cut off (max_tokens) stays a call, its arguments
as far as they were written, as OpenAI's API does. Text before a tool-call section loses its trailing whitespace
(templates write their own separator there).
"""

from __future__ import annotations

import enum
import json

from chat.families import Generic
from chat.output_parser import OpenCall, OutputParser, Piece, ReadSpec, partial_suffix
from protocol import ToolCallDelta

GENERIC_CALLS, GENERIC_RESPONSE = '{"tool_calls": [', '{"response": "'


class Mode(enum.Enum):
    OPENING = "opening"  # the reply may still open with a reasoning tag
    REASONING = "reasoning"
    CONTENT = "content"  # reply text; a trigger may start a tool-call section
    UNDECIDED = "undecided"  # the section can only open the reply (or the reply is one JSON document): not yet known
    CALLS = "calls"
    RESPONSE = "response"  # generic family: inside {"response": "...", streaming the string's characters
    TEXT = "text"  # plain reply text to the end


class SectionParser(OutputParser):
    """Reads a reply whose calls sit in a trigger-opened section (or a reply without tools), as it streams."""

    def __init__(self, spec: ReadSpec) -> None:
        super().__init__(spec)
        self.ws = ""  # trailing whitespace of the reply text, held until more text (or no call) follows
        self.section_used = 0  # characters of the tool-call section taken by calls so far
        self.section_calls = 0  # calls read from it
        self.section_end: int | None = None  # where the section ended (the rest is reply text)
        self.open: OpenCall | None = None  # the call being read
        self.resp_raw = 0  # RESPONSE mode: characters of the JSON string already decoded
        self.lead = False  # newlines at the start of the reply text are dropped (after a reasoning block)
        self.mode = self._start_mode()

    def _start_mode(self) -> Mode:
        spec = self.spec
        if spec.reasoning and spec.in_reasoning:
            return Mode.REASONING
        if spec.reasoning:
            return Mode.OPENING
        return self._after_reasoning()

    def _after_reasoning(self) -> Mode:
        f = self.family
        if f is None:
            return Mode.TEXT
        if isinstance(f, Generic) or f.at_start:
            return Mode.UNDECIDED
        return Mode.CONTENT

    @property
    def in_reasoning(self) -> bool:
        return self.mode is Mode.REASONING

    @property
    def opening_reasoning(self) -> bool:
        """Whether the text held may still be the reasoning's opening tag."""
        return self.mode is Mode.OPENING

    def _feed(self, text: str) -> Piece:
        if self.mode is Mode.TEXT:  # (no call or thinking tag to look for: the common case, per token)
            out = Piece()
            self._text(out, text)
            return out
        return super()._feed(text)

    def finish(self) -> Piece:
        out = Piece()
        while self._step(out, final=True):
            pass
        if self.mode is Mode.CALLS:  # what follows the section is reply text after all
            end = self.section_end if self.section_end is not None else self.section_used
            self._text(out, self.buf[end:], keep_ws=True)
        self.buf = ""
        if self.ws:
            self._text(out, "", keep_ws=True)
        return out

    # ---- modes ----

    def _step(self, out: Piece, final: bool) -> bool:
        """Advance the current mode over `self.buf`; True when the mode changed (step again)."""
        mode = self.mode
        if mode is Mode.OPENING:
            return self._opening(final)
        if mode is Mode.REASONING:
            return self._in_reasoning(out, final)
        if mode is Mode.CONTENT:
            return self._in_content(out, final)
        if mode is Mode.UNDECIDED:
            return self._undecided(final)
        if mode is Mode.CALLS:
            self._in_calls(out, final)
            return False
        if mode is Mode.RESPONSE:
            self._response(out, final)
            return False
        self._text(out, self.buf)
        self.buf = ""
        return False

    def _opening(self, final: bool) -> bool:
        assert self.spec.reasoning
        tag, close = self.spec.reasoning
        head = self.buf.lstrip()
        if head.startswith(tag):
            self.buf = head[len(tag) :]
            self.mode = Mode.REASONING
            self.reasoned = True
            return True
        if (tag.startswith(head) or close.startswith(head)) and not final:
            return False  # could still become the tag
        if head.startswith(close):  # a turn without thinking opened with its close (MiniMax-M3's `</mm:think>`)
            self.buf, self.lead = head[len(close) :], True
        self.mode = self._after_reasoning()
        return True

    def _in_reasoning(self, out: Piece, final: bool) -> bool:
        assert self.spec.reasoning
        close = self.spec.reasoning[1]
        self.reasoned = True
        at = self.buf.find(close)
        if at >= 0:
            self._reason(out, self.buf[:at])
            self.buf = self.buf[at + len(close) :]
            self.reasoning_end = self.fed - len(self.buf)
            self.mode = self._after_reasoning()
            self.lead = True  # the reply starts after the newlines that follow the tag (templates write their own)
            return True
        keep = 0 if final else partial_suffix(self.buf, (close,))
        self._reason(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _in_content(self, out: Piece, final: bool) -> bool:
        assert self.family is not None
        triggers = self.family.triggers
        hits = [(i, t) for t in triggers if (i := self.buf.find(t)) >= 0]
        if hits:
            at = min(hits)[0]
            self._text(out, self.buf[:at])
            self.buf = self.buf[at:]
            self.mode = Mode.CALLS
            return True
        keep = 0 if final else partial_suffix(self.buf, triggers)
        self._text(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _undecided(self, final: bool) -> bool:
        f = self.family
        assert f is not None
        head = self.buf.lstrip()
        starts = (GENERIC_CALLS, GENERIC_RESPONSE) if isinstance(f, Generic) else f.triggers
        for s in starts:
            if head.startswith(s):
                self.buf = head
                self.mode = Mode.RESPONSE if s == GENERIC_RESPONSE else Mode.CALLS
                self.resp_raw = len(s)
                return True
        if not final and any(s.startswith(head) for s in starts):
            return False
        self.mode = Mode.TEXT
        return True

    def _in_calls(self, out: Piece, final: bool) -> None:
        f = self.family
        assert f is not None
        buf = self.buf
        while self.section_end is None:
            call = self.open
            if call is None:
                head = f.head(buf, self.section_used, self.section_calls, self.spec.strings)
                if head is None:  # undecided: at the end, the section ends here
                    if final:
                        self.section_end = self.section_used
                    return
                if isinstance(head, int) or head.name not in self.spec.tool_names:
                    # no call follows; or not one of the request's tools: reply text from here
                    self.section_end = head if isinstance(head, int) else self.section_used
                    return
                call = OpenCall(len(self.calls), head.id or f.new_id(), head.name, head)
                self.calls.append(call)
                self.open = call
                self.section_calls += 1
                self.ws = ""  # a call follows the reply text: its trailing whitespace was the template's separator
                out.calls.append(ToolCallDelta(index=call.index, id=call.id, name=call.name, arguments=""))
            end = call.args_end
            if end is None:
                try:
                    piece, end = call.head.args.read(buf, final)
                except ValueError:  # not arguments after all: the call ends cut, the section with it
                    self.open, self.section_end = None, len(buf)
                    return
                if piece:
                    call.arguments += piece
                    self._args(out, call.index, piece)
                if end is None:
                    if final:  # cut off inside its arguments: a cut call, and nothing of the section is reply text
                        self.open, self.section_end = None, len(buf)
                    return
                call.args_end = end
            after = end if call.head.whole else f.tail(buf, end)
            if after is None:
                if final:
                    self._close(call, end)
                return
            self._close(call, after)

    def _close(self, call: OpenCall, end: int) -> None:
        call.done = True
        self.open = None
        self.section_used = end

    def _response(self, out: Piece, final: bool) -> None:
        """Stream the characters of the generic family's `{"response": "..."}` string as they complete."""
        raw = self.buf
        i, chars = self.resp_raw, []
        while i < len(raw):
            c = raw[i]
            if c == '"':
                break
            if c == "\\":
                width = 6 if raw[i + 1 : i + 2] == "u" else 2
                if i + width > len(raw):
                    break
                try:
                    chars.append(json.loads('"' + raw[i : i + width] + '"'))
                except ValueError:
                    break
                i += width
                continue
            chars.append(c)
            i += 1
        self.resp_raw = i
        self._text(out, "".join(chars), keep_ws=True)
        if final:
            tail = raw[i:]
            if tail.strip() not in ('"}', ""):  # the document did not end as {"response": "..."}: keep it all
                self._text(out, tail, keep_ws=True)

    # ---- output ----

    def _text(self, out: Piece, text: str, keep_ws: bool = False) -> None:
        """Reply text; trailing whitespace is held back unless `keep_ws` (it is dropped if a call follows)."""
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        text = self.ws + text
        if keep_ws:
            self.ws = ""
        else:
            body = text.rstrip()
            self.ws, text = text[len(body) :], body
        if text:
            self.content.append(text)
            out.content += text
