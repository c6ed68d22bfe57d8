"""Reading a reply as it streams: reasoning, reply text and tool calls taken apart, the same whether the client
streams or not (the router feeds every reply through one parser).

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
from dataclasses import dataclass, field

from chat.calls import Call, Head
from chat.families import Family, Generic
from protocol import ReplyFormat, ToolCallDelta

GENERIC_CALLS, GENERIC_RESPONSE = '{"tool_calls": [', '{"response": "'
REASONING_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def reasoning_tags(source: str) -> tuple[str, str] | None:
    """The thinking tags a template uses, if it has any."""
    for open_, close in REASONING_TAGS:
        if close in source:
            return open_, close
    return None


@dataclass
class Piece:
    """What one `feed` or `finish` produced."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)  # a call's first piece has its id and name


@dataclass
class OpenCall:
    """A call of the reply, as far as it is read."""

    index: int
    id: str
    name: str
    head: Head
    arguments: str = ""
    args_end: int | None = None  # where its arguments ended in the section, once they have
    done: bool = False  # its tail is read (False at the end: it was cut off)

    def call(self) -> Call:
        return Call(self.name, self.arguments, self.id)


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
        return own if own is not None else OutputParser(self)

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
        from chat.derive import family_named  # (derive reads replies with this module to check what it derives)

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


class Mode(enum.Enum):
    OPENING = "opening"  # the reply may still open with a reasoning tag
    REASONING = "reasoning"
    CONTENT = "content"  # reply text; a trigger may start a tool-call section
    UNDECIDED = "undecided"  # the section can only open the reply (or the reply is one JSON document): not yet known
    CALLS = "calls"
    RESPONSE = "response"  # generic family: inside {"response": "...", streaming the string's characters
    TEXT = "text"  # plain reply text to the end


def share(text: str, upto: int, tokens: int) -> int:
    """Of `tokens` tokens that wrote `text`, about how many wrote text[:upto] (by bytes; one at least)."""
    total, part = len(text.encode()), len(text[: max(upto, 0)].encode())
    return tokens if part >= total else max(1, min(tokens, -(-tokens * part // total)))


def partial_suffix(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `marks`."""
    best = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class OutputParser:
    def __init__(self, spec: OutputSpec) -> None:
        self.spec = spec
        self.family = spec.family
        self.buf = ""  # text not yet given out
        self.ws = ""  # trailing whitespace of the reply text, held until more text (or no call) follows
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[OpenCall] = []
        self.section_used = 0  # characters of the tool-call section taken by calls so far
        self.section_calls = 0  # calls read from it
        self.section_end: int | None = None  # where the section ended (the rest is reply text)
        self.open: OpenCall | None = None  # the call being read
        self.resp_raw = 0  # RESPONSE mode: characters of the JSON string already decoded
        self.lead = False  # newlines at the start of the reply text are dropped (after a reasoning block)
        self.reasoning_tokens = 0  # tokens fed that opened, continued or closed the reasoning (`feed`)
        self.held_tokens = 0  # tokens fed while the text held may yet open the reasoning (its tag in pieces)
        self.reasoned = False  # this feed read reasoning, or a tag of it
        self.fed = 0  # characters fed so far (the text held, `buf`, is their last ones)
        self.reasoning_end: int | None = None  # where in the text fed the reasoning ended, in this feed
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

    # ---- public ----

    def feed(self, text: str, tokens: int = 1) -> Piece:
        """The reply's next text, `tokens` generated tokens' worth: what of it can be given out now. Tokens that
        open, continue or close the reasoning are counted as its own (`reasoning_tokens`), those of an opening tag
        written in several tokens included. A feed of several tokens (speculation's guesses) in which the reasoning
        ends counts its share up to the reasoning's end, by bytes."""
        inside, self.reasoned, self.reasoning_end = self.in_reasoning, False, None
        start = self.fed
        self.fed += len(text)
        out = self._feed(text)
        if inside or self.reasoned or self.in_reasoning:
            if self.reasoning_end is not None and not self.in_reasoning and tokens > 1:
                tokens = share(text, self.reasoning_end - start, tokens)
            self.reasoning_tokens += self.held_tokens + tokens
            self.held_tokens = 0
        elif self.opening_reasoning:
            self.held_tokens += tokens
        else:
            self.held_tokens = 0
        return out

    @property
    def in_reasoning(self) -> bool:
        return self.mode is Mode.REASONING

    @property
    def opening_reasoning(self) -> bool:
        """Whether the text held may still be the reasoning's opening tag."""
        return self.mode is Mode.OPENING

    def _feed(self, text: str) -> Piece:
        out = Piece()
        if self.mode is Mode.TEXT:  # (no call or thinking tag to look for: the common case, per token)
            self._text(out, text)
            return out
        self.buf += text
        while self._step(out, final=False):
            pass
        return out

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

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def tool_calls(self) -> list[Call]:
        """Every call of the reply so far (ids included), in order."""
        return [c.call() for c in self.calls]

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning) if self.spec.reasoning and self.reasoning else None

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

    @staticmethod
    def _args(out: Piece, index: int, piece: str) -> None:
        last = out.calls[-1] if out.calls else None
        if last is not None and last.index == index:
            last.arguments += piece
        else:
            out.calls.append(ToolCallDelta(index=index, arguments=piece))

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

    def _reason(self, out: Piece, text: str) -> None:
        if text:
            self.reasoning.append(text)
            out.reasoning += text

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
