"""A stand-in for the router client behind the gateway (unit tests, no model)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from gateway.app import Gateway, build_app
from kvroute.client import KvrouteError
from protocol import (
    Delta,
    Result,
    SlotStatus,
    StatusReply,
    Submit,
    Timings,
    Tokenize,
    Tokens,
    Usage,
    WorkerStatus,
    pack_tokens,
)

BASE_URL = "http://localhost"  # (a name the gateway answers to: gateway/browsers.py)


class FakeRouter:
    """Stands in for AsyncClient: answers every submit with two deltas and a result, or with a chosen error."""

    def __init__(self) -> None:
        self.error: KvrouteError | None = None
        self.cancelled: list[str] = []
        self.workers_ready = True
        self.submits: list[Submit] = []
        self.status_salts: list[str | None] = []

    async def stream_submit(self, sub: Submit) -> AsyncIterator[Delta | Result]:
        if self.error:
            raise self.error
        assert sub.id
        self.submits.append(sub)
        yield Delta(id=sub.id, text="Hel", tokens=pack_tokens([1]))
        yield Delta(id=sub.id, text="lo", tokens=pack_tokens([2]))
        yield Result(
            id=sub.id,
            finish_reason="length",
            text="Hello",
            tokens=pack_tokens([1, 2]),
            usage=Usage(prompt_tokens=7, cached_tokens=5, completion_tokens=2),
            timings=Timings(prefill_ms=4.0, decode_ms=50.0),
            worker="w0",
            slot=1,
        )

    async def status(self, cache_salt: str | None = None) -> StatusReply:
        self.status_salts.append(cache_salt)
        slots = [SlotStatus(slot=0, busy=False, n_tokens=0)]
        workers = [WorkerStatus(worker="w0", incarnation=0, device="cpu", state="ready", queue=0, slots=slots)]
        return StatusReply(model="m", policy="prefix", queued=0, workers=workers if self.workers_ready else [])

    async def metrics(self) -> str:
        return "# TYPE kvroute_requests_waiting gauge\nkvroute_requests_waiting 0.0\n"

    async def close(self) -> None:
        pass


def client_for(fake: FakeRouter, api_key: str | None = None, **kw: Any) -> httpx.AsyncClient:
    """A client of the gateway in front of `fake` (over ASGI, as a client on this machine: Host localhost)."""
    app = build_app(Gateway(fake, "gemma", api_key, **kw))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL)


def result(**kw: Any) -> Result:
    """A Result with 10 prompt tokens (4 cached) and 3 generated, and the fields given."""
    fields: dict[str, Any] = {"id": "r", "finish_reason": "stop", "text": "", "tokens": b"", "timings": Timings()}
    return Result(**{**fields, "usage": Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=3), **kw})


class ScriptedRouter(FakeRouter):
    """Answers every submit with the given deltas and result (their ids set to the submit's), then `fail`s if set;
    answers a tokenize with five tokens."""

    def __init__(self, *replies: Delta | Result, fail: KvrouteError | None = None) -> None:
        super().__init__()
        self.replies, self.fail = replies, fail
        self.tokenized: list[Tokenize] = []

    async def stream_submit(self, sub: Submit) -> AsyncIterator[Delta | Result]:
        self.submits.append(sub)
        for reply in self.replies:
            yield msgspec.structs.replace(reply, id=sub.id or "")
        if self.fail:
            raise self.fail

    async def tokens(self, msg: Tokenize) -> Tokens:
        self.tokenized.append(msg)
        return Tokens(tokens=pack_tokens([1, 2, 3, 4, 5]), text="rendered")


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """A server-sent event stream as (event, data) pairs."""
    out = []
    for chunk in text.strip().split("\n\n"):
        kind, data = chunk.split("\n", 1)
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out
