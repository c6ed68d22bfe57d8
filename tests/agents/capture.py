"""A logging reverse proxy between a coding agent and a kvroute server.

Every request is forwarded to `upstream` unchanged (less hop-by-hop headers) and the reply is streamed back
unchanged, chunk by chunk, as it arrives. Each exchange is recorded to `out_dir/NNN.json`:

    {"n", "method", "path" (with the query), "headers" (the credentials REDACTED), "body" (the JSON, or the text),
     "response": {"status", "ttfb_s", "ttft_s", "total_s", "longest_silence_s", "usage", "error", "reasoning", "text"}}

`ttfb_s` is when the first byte of the reply came, `ttft_s` when the first generated text or tool call came
(an SSE delta, or the whole body of a reply that does not stream), `usage` is what the server said it counted
(Anthropic `usage`, OpenAI chat `usage`, Responses `response.usage`), `timings` llama-server's figures where the
reply has them (a stream that did not ask for its usage still does), `error` the body of a reply >= 400, `reasoning`
and `text` what the reply carried as the API's reasoning object (Anthropic `thinking`, Responses reasoning items, Chat
`reasoning_content`) and as its reply text (the first TEXT_KEPT characters of each).

Run alone:  python tests/agents/capture.py --upstream http://127.0.0.1:8000 --out /tmp/cap [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "proxy-authorization", "cookie", "x-goog-api-key"}
HOP_BY_HOP = {
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "accept-encoding",  # asked for identity, so the proxy can read usage from what it streams back
}
# events that carry generated text or a tool call (Anthropic, Responses); OpenAI chat chunks are read by their delta
TOKEN_EVENTS = (
    "content_block_delta",
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
)
TEXT_KEPT = 4000
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
REPLY_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


def redact(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("REDACTED" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


class ReplyWatch:
    """Reads the reply as it streams past: when the first generated token came, the usage, an error body."""

    def __init__(self, start: float, status: int, content_type: str) -> None:
        self.start = start
        self.status = status
        self.sse = "text/event-stream" in content_type
        self.ttfb: float | None = None
        self.ttft: float | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] | None = None  # llama-server's (and kvroute's), on a reply's last event or body
        self._buf = b""
        self._whole = bytearray()
        self.silence = 0.0  # the longest time between two chunks of the reply (after its first)
        self._last = 0.0
        self.said = {"reasoning": "", "text": ""}  # what the reply carried as reasoning and as text

    def _said(self, kind: str, piece: Any) -> None:
        if isinstance(piece, str) and len(self.said[kind]) < TEXT_KEPT:
            self.said[kind] += piece

    def feed(self, chunk: bytes) -> None:
        now = time.monotonic() - self.start
        if self.ttfb is None:
            self.ttfb = now
        else:
            self.silence = max(self.silence, now - self._last)
        self._last = now
        if not self.sse:
            if len(self._whole) < 4 << 20:
                self._whole += chunk
            return
        self._buf += chunk
        while True:
            cut = min((i for i in (self._buf.find(b"\n\n"), self._buf.find(b"\r\n\r\n")) if i >= 0), default=-1)
            if cut < 0:
                return
            event, self._buf = self._buf[:cut], self._buf[cut:].lstrip(b"\r\n")
            data = b"\n".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                with contextlib.suppress(ValueError):
                    self._event(json.loads(data), now)

    def _event(self, ev: Any, now: float) -> None:
        if not isinstance(ev, dict):
            return
        kind = ev.get("type")
        token = False
        if kind in TOKEN_EVENTS:  # Anthropic, Responses
            token = True
        elif isinstance(ev.get("choices"), list):  # OpenAI chat chunk
            for choice in ev["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                    token = True
        if token and self.ttft is None:
            self.ttft = now
        with contextlib.suppress(AttributeError, TypeError):  # (an event of another shape is the client's to judge)
            self._content(ev)
        # usage, wherever this API puts it; later events add to (and override) earlier ones
        if kind == "message_start":
            self.usage.update((ev.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            self.usage.update(ev.get("usage") or {})
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.usage.update((ev.get("response") or {}).get("usage") or {})
        elif isinstance(ev.get("usage"), dict):
            self.usage.update(ev["usage"])
        if isinstance(ev.get("timings"), dict):
            self.timings = ev["timings"]
        if kind == "error" or (kind is None and "error" in ev):
            self.usage.setdefault("_stream_error", ev.get("error"))

    def _content(self, ev: dict[str, Any]) -> None:
        """The reasoning and the text a streamed event carries, whatever the API."""
        kind = ev.get("type")
        delta = ev.get("delta")
        if kind == "content_block_delta" and isinstance(delta, dict):  # Anthropic
            self._said("reasoning", delta.get("thinking"))
            self._said("text", delta.get("text"))
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            self._said("reasoning", delta)
        elif kind == "response.output_text.delta":
            self._said("text", delta)
        elif isinstance(ev.get("choices"), list):  # OpenAI chat
            for choice in ev["choices"]:
                d = choice.get("delta") or {}
                self._said("reasoning", d.get("reasoning_content"))
                self._said("text", d.get("content"))

    def _body_content(self, body: dict[str, Any]) -> None:
        """The reasoning and the text of a reply that did not stream."""
        for block in body.get("content") or [] if body.get("type") == "message" else []:  # Anthropic
            self._said("reasoning", block.get("thinking"))
            self._said("text", block.get("text"))
        for item in body.get("output") or []:  # Responses
            for part in (item.get("content") or []) + (item.get("summary") or []):
                self._said("reasoning" if item.get("type") == "reasoning" else "text", part.get("text"))
        for choice in body.get("choices") or []:  # OpenAI chat
            message = choice.get("message") or {}
            self._said("reasoning", message.get("reasoning_content"))
            self._said("text", message.get("content"))

    def finish(self) -> dict[str, Any]:
        total = time.monotonic() - self.start
        out: dict[str, Any] = {"status": self.status, "ttfb_s": _r(self.ttfb), "total_s": _r(total)}
        out["longest_silence_s"] = _r(self.silence)
        body: Any = None
        if not self.sse and self._whole:
            try:
                body = json.loads(bytes(self._whole))
            except ValueError:
                body = bytes(self._whole[:4000]).decode("utf-8", "replace")
            if isinstance(body, dict) and isinstance(body.get("usage"), dict):
                self.usage.update(body["usage"])
            if isinstance(body, dict) and isinstance(body.get("timings"), dict):
                self.timings = body["timings"]
            if isinstance(body, dict) and self.status < 400:
                with contextlib.suppress(AttributeError, TypeError):
                    self._body_content(body)
            self.ttft = total if self.status < 400 else None
        out["ttft_s"] = _r(self.ttft)
        out["usage"] = self.usage or None
        out["timings"] = self.timings
        out["error"] = body if self.status >= 400 else None
        out |= self.said
        return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class CaptureProxy:
    """`CaptureProxy(upstream, out_dir).start()` serves on a free loopback port (`.url`); `.stop()` ends it."""

    def __init__(
        self,
        upstream: str,
        out_dir: Path | str,
        port: int = 0,
        rewrite: Callable[[str, Any], Any] | None = None,
    ) -> None:
        """`rewrite(path, body)`: a test's change to a JSON request body before it goes upstream (recorded as sent)."""
        self.rewrite = rewrite
        self.upstream = upstream.rstrip("/")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._counter = itertools.count(1 + len(list(self.out_dir.glob("[0-9][0-9][0-9].json"))))
        self._lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=METHODS)])
        self._client: httpx.AsyncClient | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    async def handle(self, request: Request) -> Response:
        start = time.monotonic()
        with self._lock:
            n = next(self._counter)
        raw = await request.body()
        body: Any
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if self.rewrite is not None and isinstance(body, dict):
            changed = self.rewrite(path, body)
            if changed is not body:
                body, raw = changed, json.dumps(changed).encode()
        record: dict[str, Any] = {
            "n": n,
            "method": request.method,
            "path": path,
            "headers": redact(dict(request.headers)),
            "body": body,
        }
        fwd = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        fwd.append(("accept-encoding", "identity"))
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))
        try:
            upstream = await self._client.send(
                self._client.build_request(request.method, self.upstream + path, headers=fwd, content=raw), stream=True
            )
        except httpx.HTTPError as e:
            record["response"] = {
                "status": 502,
                "error": f"proxy: {type(e).__name__}: {e}",
                "total_s": _r(time.monotonic() - start),
            }
            self._save(record)
            return Response(f"capture proxy: upstream unreachable: {e}", status_code=502)
        watch = ReplyWatch(start, upstream.status_code, upstream.headers.get("content-type", ""))
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in REPLY_DROP}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    watch.feed(chunk)
                    yield chunk
            finally:
                await upstream.aclose()
                record["response"] = watch.finish()
                self._save(record)

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)

    def _save(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
        (self.out_dir / f"{record['n']:03d}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

    def start(self) -> CaptureProxy:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="capture-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("capture proxy did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def take(self) -> list[dict[str, Any]]:
        """The records saved since the last take(), in the order they finished."""
        with self._lock:
            out, self.records = self.records, []
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--out", required=True, help="directory for NNN.json")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    proxy = CaptureProxy(args.upstream, args.out, args.port).start()
    print(f"capturing {proxy.url} -> {proxy.upstream} into {proxy.out_dir}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(asyncio.Event().wait())
    proxy.stop()


if __name__ == "__main__":
    main()
