"""The HTTP APIs (Starlette), in front of the router's ZMQ client socket: OpenAI Chat Completions, Completions
and Responses, Anthropic Messages, and llama-server's helpers (/tokenize, /detokenize, /apply-template, /slots).

It is one more client of the protocol: every request becomes a `submit` (or a `tokenize`) through `AsyncClient`,
so HTTP and ZMQ clients share one queue, one routing decision path and one set of error codes; each API shape only
translates, and answers errors in its own shape (Anthropic's under /v1/messages).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import anthropic, helpers, responses
from gateway.limits import BoundedStream, StalledReader, declared_length, limited, too_large_message
from gateway.openai_schema import (
    RequestError,
    chat_body,
    chat_delta,
    chat_submit,
    choices_of,
    completion_body,
    completion_delta,
    completion_submit,
    finish_reason,
    now,
    usage_body,
)
from gateway.openapi import OPENAPI
from kvroute import logs
from kvroute.client import AsyncClient, KvrouteError
from protocol import MAX_FRAME_BYTES, Delta, ErrorCode, FinishReason, Result, Submit

log = logs.get(__name__)

HTTP_REQUESTS = Counter("kvroute_http_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"])
HTTP_TTFT = Histogram(
    "kvroute_http_time_to_first_token_seconds",
    "Time from HTTP request to first streamed token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

# protocol error code -> (HTTP status, OpenAI error type)
ERROR_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.QUEUE_FULL: (429, "rate_limit_error"),
    ErrorCode.NO_WORKERS: (503, "service_unavailable"),
    ErrorCode.WORKER_LOST: (503, "service_unavailable"),
    ErrorCode.DRAINING: (503, "service_unavailable"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout"),
    ErrorCode.CANCELLED: (499, "cancelled"),
    ErrorCode.TOO_SLOW: (408, "timeout"),
}
PARSE_INLINE_BYTES = 1 << 20  # a larger JSON body is parsed on a thread, so the event loop keeps serving
STALL_S = 30.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(
    message: str,
    status: int,
    *,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse_error(message: str, code: str) -> bytes:
    """An error in the middle of an OpenAI Chat Completions / Completions stream, and the end of it."""
    type_ = ERROR_STATUS.get(code, (500, "internal_error"))[1]
    err = {"error": {"message": message, "type": type_, "code": code, "param": None}}
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


def kvroute_error_response(exc: KvrouteError) -> JSONResponse:
    status, type_ = ERROR_STATUS.get(exc.code, (500, "internal_error"))
    message = exc.message if not exc.error_id else f"{exc.message} (error id {exc.error_id})"
    headers = None
    if exc.code == ErrorCode.QUEUE_FULL:
        headers = {"Retry-After": str(max(1, round((exc.retry_after_ms or 1000) / 1000)))}
    return error_response(message, status, type_=type_, code=exc.code, param=exc.param, headers=headers)


class Gateway:
    """State behind the routes: the ZMQ client, the served model name, the optional API key."""

    def __init__(
        self,
        client: AsyncClient,
        model_name: str,
        api_key: str | None = None,
        *,
        tenant_per_key: bool = False,
        aliases: tuple[str, ...] = (),
        strict_model_name: bool = False,
        max_body_bytes: int = MAX_FRAME_BYTES,
        stall_s: float = STALL_S,
    ) -> None:
        """`api_key`: one key, or several comma-separated; `tenant_per_key`: each key is a tenant (its `cache_salt`);
        `aliases`: more names /v1/models lists; `strict_model_name`: a request naming another model gets 404."""
        self.client = client
        self.model_name = model_name
        self.names = (model_name, *(a for a in aliases if a != model_name))
        self.strict_model_name = strict_model_name
        self.api_keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
        self.tenant_per_key = tenant_per_key
        self.max_body_bytes = max_body_bytes
        self.stall_s = stall_s

    # ---- helpers --------------------------------------------------------------------------------

    def key_of(self, request: Request) -> str | None:
        """The API key the request presents, when it is one of ours."""
        header = request.headers.get("authorization", "")
        token = (header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")).encode()
        found = None
        for key in self.api_keys:  # (every key compared, in constant time each: no timing tells which matched)
            if hmac.compare_digest(token, key.encode()):
                found = key
        return found

    def authorized(self, request: Request) -> bool:
        return not self.api_keys or self.key_of(request) is not None

    def salt_of(self, request: Request, salt: str | None) -> str | None:
        """The request's tenant (`cache_salt`): with --tenant-per-key its key's, combined with the salt it gives."""
        if not self.tenant_per_key:
            return salt
        key = hashlib.sha256((self.key_of(request) or "").encode()).hexdigest()[:32]
        return f"key:{key}" if salt is None else f"key:{key}/{salt}"

    async def body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        model = body.get("model")
        if self.strict_model_name and model not in (None, "", "default", *self.names):
            raise RequestError(
                f"model {model!r} not found; this server serves {', '.join(map(repr, self.names))}",
                param="model",
                status=404,
                code="model_not_found",
            )
        return body

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            status = await asyncio.wait_for(self.client.status(), 2.0)
        except (TimeoutError, KvrouteError) as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc) or "router not answering"}, status_code=503)
        ready = [w for w in status.workers if w.state == "ready"]
        failed = {f.worker: f.reason for f in status.failed}  # workers that crashed at start and stay down
        if not ready and failed:
            reason = "; ".join(f"worker {w}: {r}" for w, r in failed.items())
            return JSONResponse({"status": "failed", "workers": 0, "reason": reason, "failed": failed}, status_code=503)
        if not ready:
            return JSONResponse({"status": "loading", "workers": 0}, status_code=503)
        return JSONResponse({"status": "ok", "workers": len(ready), **({"failed": failed} if failed else {})})

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvroute"} for name in self.names],
            }
        )

    async def metrics(self, request: Request) -> Response:
        """This front's HTTP figures, then the router's and its workers' (asked over the protocol)."""
        own = generate_latest(REGISTRY).decode()
        try:
            router = await asyncio.wait_for(self.client.metrics(), 5.0)
            up = 1
        except (TimeoutError, KvrouteError):
            router, up = "", 0
        gauge = "# HELP kvroute_router_up Whether the router answered\n# TYPE kvroute_router_up gauge\n"
        return Response(own + gauge + f"kvroute_router_up {up}\n" + router, media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(OPENAPI)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def responses(self, request: Request) -> Response:
        rid = uuid.uuid4().hex[:24]
        sub, stream, body = responses.responses_submit(await self.body(request), rid)
        created, logprobs = responses.now(), sub.sampling.logprobs is not None
        return await self._serve(
            request,
            sub,
            stream,
            lambda r: responses.response_body(r, rid, self.model_name, body, created, logprobs),
            lambda msgs: responses.response_events(msgs, rid, self.model_name, body, created),
            responses.error_event,
        )

    async def messages(self, request: Request) -> Response:
        rid = uuid.uuid4().hex[:24]
        sub, stream = anthropic.messages_submit(await self.body(request), rid)
        return await self._serve(
            request,
            sub,
            stream,
            lambda r: anthropic.message_body(r, self.model_name),
            lambda msgs: anthropic.message_events(msgs, rid, self.model_name),
            anthropic.error_event,
        )

    async def count_tokens(self, request: Request) -> Response:
        tokens = await self.client.tokens(anthropic.count_tokens_request(await self.body(request)))
        return JSONResponse({"input_tokens": len(tokens.tokens) // 4})

    async def tokenize(self, request: Request) -> Response:
        body = helpers.TokenizeBody.decode(await self.body(request))
        return JSONResponse(helpers.tokenize_reply(await self.client.tokens(body.message()), body.with_pieces))

    async def detokenize(self, request: Request) -> Response:
        msg = helpers.detokenize_message(await self.body(request))
        return JSONResponse({"content": (await self.client.tokens(msg)).text})

    async def apply_template(self, request: Request) -> Response:
        sub, _, _ = chat_submit(await self.body(request), "template")
        return JSONResponse({"prompt": (await self.client.tokens(helpers.render_message(sub))).text})

    async def slots(self, request: Request) -> Response:
        status = self.client.status(cache_salt=self.salt_of(request, None))
        return JSONResponse(helpers.slots_body(await asyncio.wait_for(status, 10.0)))

    async def _serve(
        self,
        request: Request,
        sub: Submit,
        stream: bool,
        reply: Any,
        events: Any,
        on_error: Any,
    ) -> Response:
        """Run a submit for an API shape: `reply(result)` is its body, `events(messages)` its stream, and
        `on_error(message, code)` an error in the middle of the stream."""
        sub.cache_salt = self.salt_of(request, sub.cache_salt)
        messages = self.client.stream_submit(sub)
        first = await anext(messages)  # errors before the first token become an HTTP status
        if not stream:
            result = first if isinstance(first, Result) else await self._drain(messages, request, sub)
            if result is None:
                return Response(status_code=499)
            self._check_deadline(result, sub)
            return JSONResponse(reply(result))

        async def checked() -> AsyncIterator[Delta | Result]:
            for msg in (first,):
                yield msg
            async for msg in messages:
                if isinstance(msg, Result):
                    self._check_deadline(msg, sub)
                yield msg

        async def body() -> AsyncIterator[bytes]:
            try:
                if isinstance(first, Result):
                    self._check_deadline(first, sub)
                async for chunk in events(checked()):
                    yield chunk
            except KvrouteError as exc:
                yield on_error(str(exc), exc.code)
            finally:
                await messages.aclose()  # on client disconnect this sends the cancel

        return self._stream(body(), on_error)

    def _stream(self, events: AsyncIterator[bytes], on_error: Any) -> BoundedStream:
        """An event stream cut, with `on_error`'s event last, when its reader stalls (gateway/limits.py)."""
        message = f"the reader took nothing for {self.stall_s:g} s; the generation was cancelled"
        cut = on_error(message, ErrorCode.TOO_SLOW)
        return BoundedStream(events, stall_s=self.stall_s, cut_event=cut, media_type="text/event-stream", headers=SSE_HEADERS)

    @staticmethod
    def _check_deadline(result: Result, sub: Submit) -> None:
        if result.finish_reason == FinishReason.DEADLINE_EXCEEDED:
            raise KvrouteError(
                f"deadline of {sub.deadline_ms} ms exceeded after {result.usage.completion_tokens} tokens",
                code=ErrorCode.DEADLINE_EXCEEDED,
            )

    async def _generate(self, request: Request, kind: str) -> Response:
        rid = uuid.uuid4().hex[:24]
        body = await self.body(request)
        sub, stream, include_usage = (completion_submit if kind == "completions" else chat_submit)(body, rid)
        sub.cache_salt = self.salt_of(request, sub.cache_salt)
        created = now()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        messages = self.client.stream_submit(sub)
        first = await anext(messages)  # errors before the first token become an HTTP status
        if not stream:
            result = first if isinstance(first, Result) else await self._drain(messages, request, sub)
            if result is None:
                return Response(status_code=499)
            if result.finish_reason == FinishReason.DEADLINE_EXCEEDED:
                raise KvrouteError(
                    f"deadline of {sub.deadline_ms} ms exceeded after {result.usage.completion_tokens} tokens",
                    code=ErrorCode.DEADLINE_EXCEEDED,
                )
            make = completion_body if kind == "completions" else chat_body
            return JSONResponse(make(result, self.model_name, created, sub.sampling.logprobs is not None))
        return self._stream(
            self._sse(kind, first, messages, rid, created, include_usage, t0, sub.sampling.logprobs is not None), sse_error
        )

    async def _drain(self, messages: AsyncGenerator[Delta | Result, None], request: Request, sub: Submit) -> Result | None:
        """Consume to the Result, but give up (cancelling the job) if the HTTP client goes away."""

        async def consume() -> Result:
            async for msg in messages:
                if isinstance(msg, Result):
                    return msg
            raise KvrouteError("stream ended without a result", code=ErrorCode.INTERNAL)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await messages.aclose()  # sends the cancel
                log.info("http_client_gone", request_id=sub.id)
                return None
        return task.result()

    async def _sse(
        self,
        kind: str,
        first: Delta | Result,
        messages: AsyncGenerator[Delta | Result, None],
        rid: str,
        created: int,
        include_usage: bool,
        t0: float,
        logprobs: bool,
    ) -> AsyncIterator[bytes]:
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        cid = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

        def opening(index: int) -> dict[str, Any]:
            return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

        def ending(index: int, reason: str) -> dict[str, Any]:
            if chat:
                return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)}
            return {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)}

        first_token = True
        opened: set[int] = set()  # chat choices whose first chunk (with the role) went out
        try:

            async def all_messages() -> AsyncIterator[Delta | Result]:
                yield first
                async for m in messages:
                    yield m

            async for msg in all_messages():
                if isinstance(msg, Delta):
                    if first_token and msg.tokens:
                        HTTP_TTFT.observe(asyncio.get_running_loop().time() - t0)
                        first_token = False
                    if chat and msg.index not in opened:
                        opened.add(msg.index)
                        yield chunk([opening(msg.index)])
                    part = chat_delta(msg, logprobs) if chat else completion_delta(msg, logprobs)
                    if part is not None:
                        yield chunk([part])
                elif msg.finish_reason == FinishReason.DEADLINE_EXCEEDED:
                    raise KvrouteError("deadline exceeded", code=ErrorCode.DEADLINE_EXCEEDED)
                else:
                    for c in choices_of(msg):
                        if chat and c.index not in opened:
                            yield chunk([opening(c.index)])
                        yield chunk([ending(c.index, c.finish_reason)])
                    if include_usage:
                        yield chunk([], usage_body(msg))
            yield b"data: [DONE]\n\n"
        except KvrouteError as exc:
            yield sse_error(str(exc), exc.code)
        finally:
            await messages.aclose()  # on client disconnect this sends the cancel


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


class Guard:
    """Pure ASGI middleware: API key check (all but /health) and request counting by status."""

    def __init__(self, app: Any, gateway: Gateway, paths: set[str]) -> None:
        self.app, self.gateway, self.paths = app, gateway, paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.paths else "other"
        status = {"code": 500}

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        limit, length = self.gateway.max_body_bytes, declared_length(scope)
        try:
            if path != "/health" and not self.gateway.authorized(Request(scope)):
                if is_anthropic(path):
                    response: Response = JSONResponse(
                        anthropic.error_body("missing or wrong API key", "authentication_error"), 401
                    )
                else:
                    response = error_response(
                        "missing or wrong API key", 401, type_="authentication_error", code="invalid_api_key"
                    )
                await response(scope, receive, counting_send)
            elif length is not None and length > limit:  # refused before a byte of it is read
                message = too_large_message(length, limit)
                if is_anthropic(path):
                    response = JSONResponse(anthropic.error_body(message, "request_too_large"), 413)
                else:
                    response = error_response(message, 413, type_="invalid_request_error", code="too_large")
                await response(scope, receive, counting_send)
            else:
                await self.app(scope, limited(receive, limit), counting_send)
        except StalledReader as exc:
            log.warning("http_reply_cut", path=path, reason=str(exc))
        finally:
            HTTP_REQUESTS.labels(endpoint, str(status["code"])).inc()


def build_app(gateway: Gateway) -> Starlette:
    routes = [
        Route("/health", gateway.health, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
        Route("/openapi.json", gateway.openapi, methods=["GET"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/responses", gateway.responses, methods=["POST"]),
        Route("/v1/messages", gateway.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", gateway.count_tokens, methods=["POST"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/apply-template", gateway.apply_template, methods=["POST"]),
        Route("/slots", gateway.slots, methods=["GET"]),
    ]

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        if is_anthropic(request.url.path):  # Anthropic's shape has no `param`: the message names the field
            return JSONResponse(anthropic.error_body(exc.message), exc.status)
        return error_response(exc.message, exc.status, type_=exc.type, code=exc.code, param=exc.param)

    async def on_kvroute_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvrouteError)
        if is_anthropic(request.url.path):
            status, type_ = anthropic.ERROR_TYPES.get(exc.code, (500, "api_error"))
            return JSONResponse(anthropic.error_body(exc.message, type_), status)
        return kvroute_error_response(exc)

    async def on_timeout(request: Request, exc: Exception) -> Response:
        if is_anthropic(request.url.path):
            return JSONResponse(anthropic.error_body(str(exc) or "timeout", "timeout_error"), 504)
        return error_response(str(exc), 504, type_="timeout", code="timeout")

    async def on_internal(request: Request, exc: Exception) -> Response:
        error_id = uuid.uuid4().hex[:12]
        log.error("http_internal_error", error_id=error_id, path=request.url.path, error=repr(exc))
        message = f"internal error {type(exc).__name__} (error id {error_id})"
        if is_anthropic(request.url.path):
            return JSONResponse(anthropic.error_body(message, "api_error"), 500)
        return error_response(message, 500, type_="internal_error", code=ErrorCode.INTERNAL)

    return Starlette(
        routes=routes,
        middleware=[Middleware(Guard, gateway=gateway, paths={r.path for r in routes})],
        exception_handlers={
            RequestError: on_request_error,
            KvrouteError: on_kvroute_error,
            TimeoutError: on_timeout,
            Exception: on_internal,
        },
    )
