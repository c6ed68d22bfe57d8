"""A reply as a sequence of blocks (thinking, text, one per tool call), for the APIs that stream blocks: Anthropic
Messages (content blocks) and OpenAI Responses (output items). Each API formats the same events its own way."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from protocol import Delta, ToolCall


class Kind(enum.Enum):
    THINKING = "thinking"
    TEXT = "text"
    TOOL = "tool"


@dataclass
class Block:
    kind: Kind
    index: int  # among the reply's blocks
    text: str = ""  # thinking or text so far (for a tool call: its arguments so far)
    call: ToolCall | None = None


@dataclass(frozen=True)
class Event:
    """`open` a block, add `text` to it (`delta`), or `close` it (its whole text is then `block.text`)."""

    what: str  # "open", "delta", "close"
    block: Block
    text: str = ""


@dataclass
class Blocks:
    """Turns the deltas of one choice into block events, in order: a block closes when the next one opens."""

    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None

    def feed(self, d: Delta) -> Iterator[Event]:
        if d.reasoning:
            yield from self._add(Kind.THINKING, d.reasoning)
        if d.text:
            yield from self._add(Kind.TEXT, d.text)
        for c in d.tool_calls:
            if c.name is not None:  # a call's first piece: its block opens
                yield from self._close()
                block = self._new(Kind.TOOL)
                block.call = ToolCall(id=c.id or "", name=c.name, arguments="")
                yield Event("open", block)
            elif self.open is None or self.open.kind is not Kind.TOOL:
                raise ValueError(f"arguments of tool call {c.index} arrived with no call open")  # (the router's bug)
            if c.arguments:
                assert self.open is not None
                self.open.text += c.arguments
                yield Event("delta", self.open, c.arguments)

    def finish(self) -> Iterator[Event]:
        yield from self._close()

    def _add(self, kind: Kind, text: str) -> Iterator[Event]:
        if self.open is None or self.open.kind is not kind:
            yield from self._close()
            self.open = self._new(kind)
            yield Event("open", self.open)
        self.open.text += text
        yield Event("delta", self.open, text)

    def _new(self, kind: Kind) -> Block:
        block = Block(kind, len(self.blocks))
        self.blocks.append(block)
        self.open = block
        return block

    def _close(self) -> Iterator[Event]:
        if self.open is not None:
            block, self.open = self.open, None
            yield Event("close", block)
