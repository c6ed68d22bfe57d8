"""Something on the wire at least every `IDLE_S` of a stream: while a reply's output is held (text that may still open
a tool call, a call's closing markers, tokens with no text yet) or the model is slow, each API's stream writer gets a
`Tick` and writes what its clients take as a keep-alive and otherwise ignore:

- Chat Completions and Completions: an SSE comment (`: keep-alive`); every SSE reader skips comment lines
  (openai-python, openai-node).
- Responses: `event: keepalive` with `{"type": "keepalive", "sequence_number": n}`, what OpenAI's API sends on long
  streams. Codex CLI ignores event types it does not know and counts any event against its idle timeout (a comment
  is no event to it); openai-python passes it through, openai-node treats it as a no-op.
- Anthropic Messages: `event: ping` with `{"type": "ping"}`, Anthropic's own keep-alive; its SDKs skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

IDLE_S = 1.5  # (the issue-47 bound is 2 s between writes: a tick at 2.0 arrived 2.02 s after the last write)
T = TypeVar("T")


class Tick:
    """Nothing was written for IDLE_S: write a keep-alive."""


TICK = Tick()


class Clock:
    """When the stream last wrote something (the writer's loop calls `wrote`)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.last = asyncio.get_running_loop().time()

    def wrote(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def left(self) -> float:
        return self.idle_s - (asyncio.get_running_loop().time() - self.last)


async def ticking(source: AsyncIterator[T], clock: Clock) -> AsyncIterator[T | Tick]:
    """`source`'s items, with a TICK whenever the clock says nothing was written for its idle time. The source is
    read through one pending task, never cancelled mid-item (so its own cleanup runs as usual)."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if clock.left() <= 0:
                yield TICK
                clock.wrote()  # (a writer that writes nothing for a tick is not ticked again at once)
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            await asyncio.wait({pending}, timeout=max(clock.left(), 0.0))
            if not pending.done():
                continue
            done, pending = pending, None
            try:
                item = done.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
