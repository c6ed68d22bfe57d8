"""Bounds on what one HTTP client can take from everyone else: the size of its request body, how long its headers and
body may take to arrive, how deep its JSON may nest, and how long its streaming reply may wait for it to read.

- A body over `max_body_bytes` is refused with 413 before it is read: at once when its Content-Length says so,
  else as soon as the bytes received pass the limit. Nothing of it is parsed, so a 40 MB body costs the shared
  event loop nothing.
- Headers must arrive within `header_timeout_s` of a connection's first byte (or of the next request's, on a kept
  connection), else the connection is closed; a body within `body_timeout_s` of its headers, else 408. A client
  sending one byte a minute holds no socket for long; headers over MAX_HEADER_BYTES get 431 (`guarded_protocol`).
- A body whose JSON nests deeper than MAX_JSON_DEPTH levels is refused with 400 before it is parsed (`json_depth`:
  the parser, and every reader after it, recurse; 10,000 levels were a 500).
- A streamed reply whose reader takes nothing for `stall_s` (one write waited that long) is cut: the generation is
  cancelled, and an error event is the last thing written if the reader takes it within another `stall_s`;
  then the connection is closed. What waits for a stalled reader is bounded by the client library's per-request
  buffer (kvroute.client.MAX_BUFFERED) until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common import logs
from gateway.errors import RequestError

log = logs.get(__name__)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]


def too_large_message(size: int, limit: int) -> str:
    return f"request body of {size} bytes is over this server's limit of {limit} bytes (--max-body-bytes)"


def declared_length(scope: Message) -> int | None:
    """The request's Content-Length, when it has a valid one."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def limited(receive: Receive, limit: int, timeout_s: float | None = None) -> Receive:
    """`receive` that raises a 413 RequestError once the body passes `limit` bytes (a body sent without a
    Content-Length, or with a false one), and a 408 one when the body has not all come `timeout_s` after the first
    read of it."""
    seen = 0
    deadline: float | None = None
    complete = False

    async def receive_limited() -> Message:
        nonlocal seen, deadline, complete
        if complete or timeout_s is None:
            message = await receive()
        else:
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                text = f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s)"
                raise RequestError(text, kind="body_timeout", code="timeout") from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if seen > limit:
                raise RequestError(too_large_message(seen, limit), kind="too_large", code="too_large")
        return message

    return receive_limited


MAX_JSON_DEPTH = 128  # levels of objects and arrays in a request body (the router refuses values past 64 by name)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deep the JSON text `raw` nests (objects and arrays), counted on its bytes without parsing them: brackets
    inside strings are not structure, a quote after an odd run of backslashes does not end a string. numpy over the
    bytes once, then over the brackets, quotes and backslashes only (a regular expression over 8 MB would hold the
    GIL, and with it the event loop, for a tenth of a second)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    steps = _STEP[a]
    brackets = np.flatnonzero(steps)
    if not len(brackets):
        return 0
    quotes = np.flatnonzero(a == ord('"'))
    slashes = np.flatnonzero(a == ord("\\"))
    if len(slashes) and len(quotes):  # a quote after an odd run of backslashes is escaped
        starts = np.flatnonzero(np.diff(slashes, prepend=-2) != 1)  # where each run of backslashes begins
        run = np.arange(len(slashes)) - starts[np.searchsorted(starts, np.arange(len(slashes)), side="right") - 1] + 1
        at = np.searchsorted(slashes, quotes - 1)  # the backslash just before each quote, if there is one
        before = np.zeros(len(quotes), dtype=np.int64)
        hit = (at < len(slashes)) & (slashes[np.minimum(at, len(slashes) - 1)] == quotes - 1)
        before[hit] = run[at[hit]]
        quotes = quotes[before % 2 == 0]
    outside = np.searchsorted(quotes, brackets) % 2 == 0  # an even number of quotes before it: not in a string
    return int(np.cumsum(steps[brackets[outside]], dtype=np.int64).max(initial=0))


MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers (h11's own bound was 16 KiB; httptools has none)
TOO_LARGE_HEADERS = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 43\r\n\r\nrequest line and headers over 65536 bytes\r\n"
)


def guarded_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP/1.1 protocol (httptools: its per-event cost is a fraction of h11's, the pure-Python parser and
    framer, and a streamed token is an event) with bounds on headers: a connection whose request headers have not all
    come `header_timeout_s` after its first byte (or after the connection opened) is closed, and one whose headers
    pass MAX_HEADER_BYTES gets 431 and is closed. Between requests uvicorn's own keep-alive timeout applies; the
    deadline and the count start again with the next request's first byte."""

    class Guarded(HttpToolsProtocol):
        _headers_due: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._headers_due = self.loop.call_later(header_timeout_s, self._headers_late)

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # (for a request's headers)
            if waiting and self._headers_due is None:
                self._headers_due = self.loop.call_later(header_timeout_s, self._headers_late)
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # its headers are in: it is being served
                self._header_bytes = 0
                if self._headers_due is not None:
                    self._headers_due.cancel()
                    self._headers_due = None
            elif waiting and not self.transport.is_closing():  # (all of `data` was request line and headers)
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    log.warning("http_headers_too_large", client=str(self.client), bytes=self._header_bytes)
                    self.transport.write(TOO_LARGE_HEADERS)
                    self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
                self._headers_due = None
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._headers_due = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                log.warning("http_headers_too_slow", client=str(self.client), timeout_s=header_timeout_s)
                self.transport.close()

    return Guarded


class StalledReader(Exception):
    """The reader of a streamed reply took nothing for too long, not even the error event that cut it."""


class BoundedStream(StreamingResponse):
    """Server-sent events whose reader must keep up (see the module docstring). `cut_event` is the last event
    written when the reply is cut."""

    def __init__(self, content: AsyncIterable[bytes], *, stall_s: float, cut_event: bytes, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stall_s, self.cut_event = stall_s, cut_event

    async def stream_response(self, send: Callable[[Message], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        # A check every quarter of stall_s expires `watch` once one write has waited stall_s: a write costs a clock
        # read, where re-arming a timer around each (asyncio.wait_for made a task per chunk) was a fifth of the
        # gateway's CPU per streamed token. A stall is cut after 1 to 1.25 stall_s.
        watch = asyncio.timeout(None)
        began = -1.0  # when the write that waits now began (-1: none waits)
        checking: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal checking
            if began >= 0 and loop.time() - began >= self.stall_s:
                watch.reschedule(loop.time())
            else:
                checking = loop.call_later(self.stall_s / 4, check)

        check()
        try:
            async with watch:
                async for chunk in self.body_iterator:
                    body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                    began = loop.time()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    began = -1.0
        except TimeoutError:
            if not watch.expired():
                raise  # (the body's own, not a stalled reader)
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        finally:
            if checking is not None:
                checking.cancel()
        log.warning("http_reader_stalled", stall_s=self.stall_s, action="generation cancelled, reply cut")
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  # (an async generator: this cancels the job)
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": self.cut_event, "more_body": False}), self.stall_s)
        except TimeoutError:
            raise StalledReader(f"the reader took nothing for {2 * self.stall_s:g} s") from None
