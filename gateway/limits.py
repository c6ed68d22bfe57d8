"""Bounds on what one HTTP client can take from everyone else: the size of its request body, and how long its
streaming reply may wait for it to read.

- A body over `max_body_bytes` is refused with 413 before it is read: at once when its Content-Length says so,
  else as soon as the bytes received pass the limit. Nothing of it is parsed, so a 40 MB body costs the shared
  event loop nothing.
- A streamed reply whose reader takes nothing for `stall_s` (one write waited that long) is cut: the generation is
  cancelled, and an error event is the last thing written if the reader takes it within another `stall_s`;
  then the connection is closed. What waits for a stalled reader is bounded by the client library's per-request
  buffer (kvroute.client.MAX_BUFFERED) until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import StreamingResponse

from gateway.openai_schema import RequestError
from kvroute import logs

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


def limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises a 413 RequestError once the body passes `limit` bytes (a body sent without a
    Content-Length, or with a false one)."""
    seen = 0

    async def receive_limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise RequestError(too_large_message(seen, limit), status=413, code="too_large")
        return message

    return receive_limited


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
        # one timer, armed only while a write waits for the reader (asyncio.wait_for made a task per chunk: a fifth of
        # the gateway's CPU per streamed token)
        watch = asyncio.timeout(None)
        try:
            async with watch:
                async for chunk in self.body_iterator:
                    body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                    watch.reschedule(loop.time() + self.stall_s)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    watch.reschedule(None)
        except TimeoutError:
            if not watch.expired():
                raise  # (the body's own, not a stalled reader)
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        log.warning("http_reader_stalled", stall_s=self.stall_s, action="generation cancelled, reply cut")
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  # (an async generator: this cancels the job)
        try:
            await asyncio.wait_for(send({"type": "http.response.body", "body": self.cut_event, "more_body": False}), self.stall_s)
        except TimeoutError:
            raise StalledReader(f"the reader took nothing for {2 * self.stall_s:g} s") from None
