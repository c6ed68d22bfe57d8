"""Replies written as a sequence of messages, each a header (naming where its body goes) up to `<|message|>`, then
a body up to an end mark: gpt-oss's harmony (chat/harmony.py) and Muse Glimmer's turns (chat/muse.py).

The prompt ends with `<|start|>assistant`, so the first header has no `<|start|>`; `<|start|>` ends a body and opens
the next header. A header longer than HEADER_MAX is no header (a model that does not write these messages): reply
text. Each syntax says how a header names a call or the thinking, and how a call's body is read.
"""

from __future__ import annotations

from chat.calls import Head, WholeArgs
from chat.output_parser import OpenCall, OutputParser, Piece, ReadSpec, partial_suffix
from protocol import ToolCallDelta

START, MESSAGE = "<|start|>", "<|message|>"
HEADER_MAX = 200


class MessageParser(OutputParser):
    """Reads a reply of messages as it streams; subclasses read headers (`_recipient`, `_thinking`) and call bodies."""

    ENDS: tuple[str, ...] = (START,)  # the marks that end a body (START is left in the text: the next header's)
    BLANK_TAIL_IS_TEXT = True  # at the end, text that opened no header is reply text even when it is whitespace

    def __init__(self, spec: ReadSpec) -> None:
        super().__init__(spec)
        self.state = "header"  # header | body
        self.kind = "content"  # of the current body: content | reasoning | call
        self.call: OpenCall | None = None

    @property
    def in_reasoning(self) -> bool:
        return self.state == "body" and self.kind == "reasoning"

    @property
    def opening_reasoning(self) -> bool:
        return self.state == "header"  # (the header may open the thinking)

    def finish(self) -> Piece:
        out = Piece()
        while self._step(out, final=True):
            pass
        left = self.buf if self.BLANK_TAIL_IS_TEXT else self.buf.strip()
        if self.state == "header" and left:  # (no header after all: reply text)
            self._emit(out, "content", self.buf, True)
        self.buf = ""
        return out

    def _step(self, out: Piece, final: bool) -> bool:
        if self.state == "header":
            at = self.buf.find(MESSAGE)
            if at < 0:
                if len(self.buf) > HEADER_MAX:
                    self.state, self.kind = "body", "content"  # not these messages: reply text from here
                    return True
                return False
            self._open(out, self.buf[:at])
            self.buf = self.buf[at + len(MESSAGE) :]
            self.state = "body"
            return True
        hits = [(j, m) for m in self.ENDS if (j := self.buf.find(m)) >= 0]
        if hits:
            j, mark = min(hits)
            self._emit(out, self.kind, self.buf[:j], True)
            thought = self.kind == "reasoning"
            self._end_message(cut=False)
            self.buf = self.buf[j + (0 if mark == START else len(mark)) :]
            if thought:
                self.reasoning_end = self.fed - len(self.buf)
            self.state = "header"
            return True
        keep = 0 if final else partial_suffix(self.buf, self.ENDS)
        self._emit(out, self.kind, self.buf[: len(self.buf) - keep], final)
        self.buf = self.buf[len(self.buf) - keep :]
        if final:
            self._end_message(cut=True)
        return False

    def _open(self, out: Piece, header: str) -> None:
        """A message's header, read: where its body goes."""
        name = self._recipient(header)
        if name is not None and name in self.spec.tool_names:
            assert self.family is not None
            call = OpenCall(len(self.calls), self.family.new_id(), name, Head(name, WholeArgs(0, "", 0)))
            self.calls.append(call)
            self.call, self.kind = call, "call"
            self._call_opened()
            out.calls.append(ToolCallDelta(index=call.index, id=call.id, name=name, arguments=""))
        elif self._thinking(header):
            self.kind, self.reasoned = "reasoning", True
        else:
            self.kind = "content"

    def _emit(self, out: Piece, kind: str, text: str, final: bool) -> None:
        if kind == "call" and self.call is not None:
            self._call_text(out, self.call, text, final)
        elif not text:
            return
        elif kind == "reasoning":
            self._reason(out, text)
        else:
            self.content.append(text)
            out.content += text

    def _recipient(self, header: str) -> str | None:
        """The function a header sends its message to (a call where the request has it), or None."""
        raise NotImplementedError

    def _thinking(self, header: str) -> bool:
        """Whether a header that opens no call opens the thinking."""
        raise NotImplementedError

    def _call_opened(self) -> None:
        """A call's message begins (its body is read from here)."""

    def _call_text(self, out: Piece, call: OpenCall, text: str, final: bool) -> None:
        """The next text of a call's body (`final`: it ends here)."""
        raise NotImplementedError

    def _end_message(self, cut: bool) -> None:
        """A body ended at an end mark; or (`cut`) the reply ended inside it."""
        raise NotImplementedError
