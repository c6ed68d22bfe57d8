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
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

IDLE_S = 1.5  # (the issue-47 bound is 2 s between writes: a tick at 2.0 arrived 2.02 s after the last write)
T = TypeVar("T")


class Tick:
    """Nothing was written for IDLE_S: write a keep-alive."""


TICK = Tick()


class Clock:
    """When the stream last wrote something (the writer's loop calls `wrote`)."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.time = asyncio.get_running_loop().time
        self.last = self.time()

    def wrote(self) -> None:
        self.last = self.time()

    def left(self) -> float:
        return self.idle_s - (self.time() - self.last)


class Ticking(Generic[T]):
    """`source`'s items, with a TICK whenever the clock says nothing was written for its idle time.

    One reader task drains the source into a buffer for the stream's whole life (a task and a timer per item cost a
    tenth of the gateway's CPU per streamed token), and `ready` says whether an item waits there: a writer joins what
    it writes until none does, so what arrived together goes out in one write. The source is never cancelled mid-item
    except by `aclose` (its own cleanup runs as usual); an exception it raises comes after the items before it. At most
    AHEAD items wait in the buffer: then the reader waits too, and the source's own bound applies (kvroute's client
    cuts a request whose reader leaves its replies untaken)."""

    AHEAD = 1024

    def __init__(self, source: AsyncIterator[T], clock: Clock) -> None:
        self.source, self.clock = source, clock
        self._items: deque[T] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self._wake: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # (one at a time: a timer per wait was a tenth of a token's cost)

    def ready(self) -> bool:
        return bool(self._items)

    def __aiter__(self) -> Ticking[T]:
        return self

    async def __anext__(self) -> T | Tick:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        while True:
            if self.clock.left() <= 0:
                self.clock.wrote()  # (a writer that writes nothing for a tick is not ticked again at once)
                return TICK
            if self._items:
                if self._room is not None and not self._room.done():
                    self._room.set_result(None)
                return self._items.popleft()
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._wake = asyncio.get_running_loop().create_future()
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_at(self.clock.last + self.clock.idle_s, self._on_timer)
            await self._wake

    def _on_timer(self) -> None:
        """The clock's deadline as it was when the timer was set: wake a waiting writer if nothing was written since,
        else wait on for the deadline as it is now (writes only move it later)."""
        self._timer = None
        if self._wake is None or self._wake.done():
            return  # (no writer waits: the next wait sets a timer)
        if self.clock.left() <= 0:
            self._wake.set_result(None)
        else:
            self._timer = asyncio.get_running_loop().call_at(self.clock.last + self.clock.idle_s, self._on_timer)

    async def _read(self) -> None:
        try:
            async for item in self.source:
                self._items.append(item)
                self._notify()
                if len(self._items) >= self.AHEAD:
                    self._room = asyncio.get_running_loop().create_future()
                    await self._room
        except Exception as exc:  # (for the writer, after the items before it)
            self._error = exc
        finally:
            self._ended = True
            self._notify()

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def aclose(self) -> None:
        """Stop reading (a source still waiting for its next item is cancelled there)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
