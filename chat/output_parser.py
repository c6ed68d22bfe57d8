"""What every reader of a reply is (`OutputParser`): fed the reply's text as it streams, it gives out reply text,
reasoning and tool calls (`Piece`), keeps the whole of each, and counts the tokens that wrote the reasoning.

The readers: the tool-call section machinery (chat/section_parser.py), and the replies written as messages
(chat/message_parser.py: gpt-oss's harmony, Muse Glimmer's turns). Which one reads a reply is chat/output.py's
`OutputSpec.parser`; a reader sees the spec through `ReadSpec` only, so the spec may name every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from chat.calls import Call, Head
from chat.families import Family
from protocol import ToolCallDelta


class ReadSpec(Protocol):
    """How to read a request's reply, as a reader sees it (chat/output.py's OutputSpec)."""

    @property
    def family(self) -> Family | None: ...

    @property
    def tool_names(self) -> frozenset[str]: ...

    @property
    def reasoning(self) -> tuple[str, str] | None: ...

    @property
    def in_reasoning(self) -> bool: ...

    @property
    def strings(self) -> dict[str, frozenset[str]]: ...


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
    """A reply's reader. Subclasses read the text (`_step` over `buf`, `finish`) and say where the reasoning is."""

    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec
        self.family = spec.family
        self.buf = ""  # text not yet given out
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[OpenCall] = []
        self.reasoning_tokens = 0  # tokens fed that opened, continued or closed the reasoning (`feed`)
        self.held_tokens = 0  # tokens fed while the text held may yet open the reasoning (its tag in pieces)
        self.reasoned = False  # this feed read reasoning, or a tag of it
        self.fed = 0  # characters fed so far (the text held, `buf`, is their last ones)
        self.reasoning_end: int | None = None  # where in the text fed the reasoning ended, in this feed

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

    def finish(self) -> Piece:
        """What is left once the reply ended."""
        raise NotImplementedError

    @property
    def in_reasoning(self) -> bool:
        raise NotImplementedError

    @property
    def opening_reasoning(self) -> bool:
        """Whether the text held may still be the reasoning's opening tag."""
        raise NotImplementedError

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

    def _feed(self, text: str) -> Piece:
        out = Piece()
        self.buf += text
        while self._step(out, final=False):
            pass
        return out

    def _step(self, out: Piece, final: bool) -> bool:
        """Read on in `self.buf`; True when the reader's state changed (step again)."""
        raise NotImplementedError

    def _reason(self, out: Piece, text: str) -> None:
        if text:
            self.reasoning.append(text)
            out.reasoning += text

    @staticmethod
    def _args(out: Piece, index: int, piece: str) -> None:
        last = out.calls[-1] if out.calls else None
        if last is not None and last.index == index:
            last.arguments += piece
        else:
            out.calls.append(ToolCallDelta(index=index, arguments=piece))
