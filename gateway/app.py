"""The HTTP APIs (Starlette), in front of the router's ZMQ client socket: OpenAI Chat Completions, Completions
and Responses, Anthropic Messages, and llama-server's helpers (/tokenize, /detokenize, /apply-template, /slots).

It is one more client of the protocol: every request becomes a `submit` (or a `tokenize`) through `AsyncClient`,
so HTTP and ZMQ clients share one queue, one routing decision path and one set of error codes; each API shape only
translates, and answers errors in its own shape (Anthropic's under /v1/messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common import logs
from gateway import anthropic, llama_helpers, normalise
from gateway.browsers import AllowedHosts, host_refused_message, is_json, not_json_message
from gateway.dialects import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Call, Dialect
from gateway.embeddings import embed_message, embeddings_reply
from gateway.errors import Errors, RequestError, errors_for
from gateway.fields import FIELDS_IGNORED, Policy
from gateway.images import ImageLimits, Images
from gateway.keepalive import IDLE_S, Clock, Ticking
from gateway.limits import (
    MAX_JSON_DEPTH,
    BoundedStream,
    StalledReader,
    declared_length,
    json_depth,
    limited,
    too_large_message,
)
from gateway.openai_chat import chat_submit
from gateway.openapi import OPENAPI
from gateway.rerank import RERANK_PATHS, rerank_message, rerank_reply
from kvroute.client import AsyncClient, KvrouteError
from protocol import (
    MAX_FRAME_BYTES,
    Delta,
    Detokenize,
    Embeddings,
    ErrorCode,
    FinishReason,
    Ranked,
    Result,
    StatusReply,
    Submit,
    Tokenize,
    Tokens,
)

log = logs.get(__name__)

HTTP_REQUESTS = Counter("kvroute_http_requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"])
HTTP_TTFT = Histogram(
    "kvroute_http_time_to_first_token_seconds",
    "Time from HTTP request to first streamed token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

# a larger JSON body is parsed, decoded into a request and its hints counted on a thread, so that the event loop keeps
# serving: 16 KiB of the costliest shapes (hundreds of input items, a thousand unknown fields) take up to 4 ms on it,
# 256 KiB (the bound before) about 100 ms; the hop to a thread costs a tenth of a millisecond
DECODE_INLINE_BYTES = 16 * 1024
STATUS_FRESH_S = 1.0  # /health's view of the router's status is at most this old
STALL_S = 30.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")
Reused = TypeVar("Reused", Embeddings, Ranked)


def error_text(exc: KvrouteError) -> str:
    """What a client reads of a router error (its code goes in the body's own field)."""
    return exc.message if not exc.error_id else f"{exc.message} (error id {exc.error_id})"


def kvroute_error_response(exc: KvrouteError, errors: Errors) -> JSONResponse:
    status, type_ = errors.status_of(exc.code)
    message = errors.message(error_text(exc), exc.code, exc.overflow)
    headers = None
    if exc.code == ErrorCode.QUEUE_FULL:
        headers = {"Retry-After": str(max(1, round((exc.retry_after_ms or 1000) / 1000)))}
    return errors.response(message, status, type_=type_, code=errors.code(exc.code), param=exc.param, headers=headers)


class SharedStatus:
    """The router's status as /health reads it: asked at most once per `fresh_s`, however many callers (load balancer
    probes, pollers), with one request in flight at most; its answer, or its error, serves every caller meanwhile."""

    def __init__(self, client: AsyncClient, fresh_s: float = STATUS_FRESH_S, timeout_s: float = 2.0) -> None:
        self.client, self.fresh_s, self.timeout_s = client, fresh_s, timeout_s
        self._asked: asyncio.Future[StatusReply] | None = None
        self._answered_at = 0.0

    async def get(self) -> StatusReply:
        now = asyncio.get_running_loop().time()
        if self._asked is None or (self._asked.done() and now - self._answered_at >= self.fresh_s):
            self._asked = asyncio.ensure_future(self._ask())
            self._asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read, even with no caller left)
        return await asyncio.shield(self._asked)  # (a caller that leaves does not cancel the others' answer)

    async def _ask(self) -> StatusReply:
        try:
            return await asyncio.wait_for(self.client.status(), self.timeout_s)
        finally:
            self._answered_at = asyncio.get_running_loop().time()


class Gateway:
    """State behind the routes: the ZMQ client, the served model name, the optional API key."""

    def __init__(
        self,
        client: AsyncClient,
        model_name: str,
        api_key: str | None = None,
        *,
        shared_cache: bool = False,
        allowed_hosts: AllowedHosts | None = None,
        cors_origins: tuple[str, ...] = (),
        aliases: tuple[str, ...] = (),
        strict_model_name: bool = False,
        strict_api: bool = False,
        max_body_bytes: int = MAX_FRAME_BYTES,
        stall_s: float = STALL_S,
        pooling: str = "auto",
        body_timeout_s: float | None = None,
        keep_alive_s: float = IDLE_S,
        status_fresh_s: float = STATUS_FRESH_S,
        image_limits: ImageLimits | None = None,
        priority_keys: str = "",
    ) -> None:
        """`api_key`: one key, or several comma-separated, each a tenant of its own (its `cache_salt`) unless
        `shared_cache`; `allowed_hosts`: the Host names served (gateway/browsers.py; by default this machine's);
        `cors_origins`: the web origins CORS allows (none by default); `aliases`: more names /v1/models lists;
        `strict_model_name`: a request naming another model gets 404; `strict_api`: a field no API knows is a 400
        rather than a hint (gateway/fields.py); `image_limits`: what one request's images may be (gateway/images.py);
        `priority_keys`: the keys that may ask a higher priority (`may_go_first`).
        (The sampling a request leaves out is the router's: --temp, --seed ...
        apply to every client, this one among them.)"""
        self.client = client
        self.pooling = pooling  # of /v1/embeddings (gateway/embeddings.py)
        self.model_name = model_name
        self.names = (model_name, *(a for a in aliases if a != model_name))
        self.strict_model_name = strict_model_name
        self.strict_api = strict_api
        self.api_keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
        named = [k.strip() for k in priority_keys.split(",") if k.strip()]
        unknown = [k for k in named if k != "all" and k not in self.api_keys]
        if unknown:
            raise ValueError(f"--priority-keys names {len(unknown)} key(s) that --api-key does not give")
        self.first_keys = None if "all" in named or (not named and len(self.api_keys) <= 1) else set(named)
        self.shared_cache = shared_cache
        self.allowed_hosts = allowed_hosts or AllowedHosts()
        self.cors_origins = cors_origins
        self.status = SharedStatus(client, status_fresh_s)  # (/health's view of the router)
        self.max_body_bytes = max_body_bytes
        self.stall_s = stall_s
        self.body_timeout_s = body_timeout_s
        self.keep_alive_s = keep_alive_s  # a stream writes something at least this often (gateway/keepalive.py)
        self.image_limits = image_limits or ImageLimits()

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

    def owner_of(self, request: Request) -> str | None:
        """Whose share of the router's queue a request counts against: its API key's (a digest), when keys are
        required; None without keys (one user: the whole queue)."""
        key = self.key_of(request) if self.api_keys else None
        return None if key is None else hashlib.sha256(b"owner:" + key.encode()).hexdigest()[:32]

    def may_go_first(self, request: Request) -> bool:
        """Whether a request may be served at a higher priority than 0: its key is one of --priority-keys (by default,
        any key when at most one is set)."""
        return self.first_keys is None or self.key_of(request) in self.first_keys

    @property
    def tenants_by_key(self) -> bool:
        """Whether each API key is a tenant of its own: with keys, unless --shared-cache."""
        return bool(self.api_keys) and not self.shared_cache

    def salt_of(self, request: Request, salt: str | None) -> str | None:
        """The request's tenant (`cache_salt`): with API keys its key's (unless --shared-cache), narrowed by the salt it
        gives."""
        if not self.tenants_by_key:
            return salt
        key = hashlib.sha256((self.key_of(request) or "").encode()).hexdigest()[:32]
        return f"key:{key}" if salt is None else f"key:{key}/{salt}"

    def own_reuse(self, got: Reused) -> Reused:
        """An embeddings or rerank result as a tenant may read it: its `cached_tokens` say how much of the previous
        input (anyone's) an embedding context kept, so they are left out where keys are tenants."""
        return msgspec.structs.replace(got, cached_tokens=0) if self.tenants_by_key else got

    async def decoded(
        self,
        request: Request,
        decode: Callable[[dict[str, Any]], T],
        policy: Policy | None = None,
        rid: str = "",
        images: Images | None = None,
    ) -> T:
        """`decode` of the request's body (a JSON object), with the hints it found reported: parsed, decoded and
        counted in one go, on a thread for a body over DECODE_INLINE_BYTES (the event loop serves everyone else);
        then the images `decode` met by URL fetched into their parts (--image-fetch: gateway/images.py)."""
        raw = await request.body()

        def work() -> T:
            decoded = decode(self.parsed(raw))
            if policy is not None:
                policy.report(rid)
            return decoded

        decoded = work() if len(raw) <= DECODE_INLINE_BYTES else await asyncio.to_thread(work)
        if images is not None:
            await images.fetch()
        return decoded

    def parsed(self, raw: bytes) -> dict[str, Any]:
        """A body as a JSON object naming a model this server serves (RequestError if not)."""
        body = parse_body(raw)
        model = body.get("model")
        if self.strict_model_name and model not in (None, "", "default", *self.names):
            raise RequestError(
                f"model {model!r} not found; this server serves {', '.join(map(repr, self.names))}",
                param="model",
                kind="not_found",
                code="model_not_found",
            )
        return body

    # ---- routes ---------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """Whether a worker is ready, from a view of the router's status at most STATUS_FRESH_S old (probes and
        pollers cost the router one status request a second at most); why workers failed only to a caller with a
        key, where keys are required (a crash's words may name paths and the machine's state)."""
        reasons = self.authorized(request)
        try:
            status = await self.status.get()
        except (TimeoutError, KvrouteError) as exc:
            why = {"reason": str(exc) or "router not answering"} if reasons else {}
            return JSONResponse({"status": "unavailable", **why}, status_code=503)
        ready = [w for w in status.workers if w.state == "ready"]
        failed = {f.worker: f.reason for f in status.failed} if reasons else {}  # crashed at start, and stay down
        if not ready and status.failed:
            reason = "; ".join(f"worker {w}: {r}" for w, r in failed.items())
            told: dict[str, Any] = {"reason": reason, "failed": failed} if reasons else {}
            return JSONResponse({"status": "failed", "workers": 0, **told}, status_code=503)
        if not ready:
            return JSONResponse({"status": "loading", "workers": 0}, status_code=503)
        return JSONResponse({"status": "ok", "workers": len(ready), **({"failed": failed} if failed else {})})

    def asked_model(self, body: Any) -> str | None:
        """The model a request names, for the router to pick (one model served: any name is it, unless
        --strict-model-name); None when it names none."""
        model = body.get("model") if isinstance(body, dict) else getattr(body, "model", None)
        return model if isinstance(model, str) and model and model != "default" else None

    async def models(self, request: Request) -> Response:
        """Every model and alias the router serves, each with where it stands (llama-server's router mode's `status`);
        this front's own names when the router serves one model."""
        with contextlib.suppress(TimeoutError, KvrouteError):
            status = await asyncio.wait_for(self.client.status(), 2.0)
            if len(status.models) > 1:
                data = [
                    {"id": name, "object": "model", "created": 0, "owned_by": "kvroute", "status": {"value": m.state}}
                    for m in status.models
                    for name in (m.name, *m.aliases)
                ]
                return JSONResponse({"object": "list", "data": data})
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvroute"} for name in self.names]
        return JSONResponse({"object": "list", "data": data})

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
        return await self.serve(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, CHAT)

    async def responses(self, request: Request) -> Response:
        return await self.serve(request, RESPONSES)

    async def messages(self, request: Request) -> Response:
        return await self.serve(request, MESSAGES)

    async def count_tokens(self, request: Request) -> Response:
        policy = Policy("messages", strict=self.strict_api)
        images = Images(self.image_limits)
        counted = await self.decoded(request, lambda raw: anthropic.count_tokens_request(raw, policy, images), images=images)
        tokens = await self.tokens(request, counted)
        return JSONResponse({"input_tokens": len(tokens.tokens) // 4})

    async def embeddings(self, request: Request) -> Response:
        rid = uuid.uuid4().hex[:24]
        policy = Policy("embeddings", strict=self.strict_api)
        msg, body = await self.decoded(request, lambda raw: embed_message(raw, policy, self.pooling), policy, rid)
        msg.id, msg.model = rid, self.asked_model(body)
        msg.owner = self.owner_of(request)
        try:
            got = await until_gone(request, self.client.embed(msg))
        except KvrouteError as exc:
            if exc.code == ErrorCode.BAD_REQUEST:  # (about an input: the body's field is `input`)
                raise RequestError(exc.message, param="input") from None
            raise
        if got is None:
            return Response(status_code=499)  # (the client is gone; its embed was cancelled)
        return JSONResponse(embeddings_reply(self.own_reuse(got), body, body.model or self.model_name))

    async def rerank(self, request: Request) -> Response:
        rid = uuid.uuid4().hex[:24]
        policy = Policy("rerank", strict=self.strict_api)
        msg, body = await self.decoded(request, lambda raw: rerank_message(raw, policy), policy, rid)
        msg.id, msg.model = rid, self.asked_model(body)
        msg.owner = self.owner_of(request)
        try:
            got = await until_gone(request, self.client.rerank(msg))
        except KvrouteError as exc:
            if exc.code == ErrorCode.BAD_REQUEST and exc.param is None:  # (about an input: a document's pair)
                raise RequestError(exc.message, param="texts" if body.texts is not None else "documents") from None
            raise
        if got is None:
            return Response(status_code=499)
        return JSONResponse(rerank_reply(self.own_reuse(got), msg, body, body.model or self.model_name))

    async def tokenize(self, request: Request) -> Response:
        body, asked = await self.decoded(request, lambda raw: (llama_helpers.TokenizeBody.decode(raw), self.asked_model(raw)))
        msg = body.message()
        msg.model = asked
        tokens = await self.tokens(request, msg)
        return JSONResponse(await self._work(len(tokens.tokens), llama_helpers.tokenize_reply, tokens, body.with_pieces))

    async def detokenize(self, request: Request) -> Response:
        # (a million ids: checked and packed off the loop)
        msg, asked = await self.decoded(request, lambda raw: (llama_helpers.detokenize_message(raw), self.asked_model(raw)))
        msg.model = asked
        return JSONResponse({"content": (await self.tokens(request, msg)).text})

    async def tokens(self, request: Request, msg: Tokenize | Detokenize) -> Tokens:
        """The router's answer to a tokenize or detokenize, the work counted as the request's key's (its owner)."""
        msg.owner = self.owner_of(request)
        return await self.client.tokens(msg)

    @staticmethod
    async def _work(size: int, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, on a thread when it is about `size` bytes of work past DECODE_INLINE_BYTES."""
        return fn(*args) if size <= DECODE_INLINE_BYTES else await asyncio.to_thread(fn, *args)

    async def apply_template(self, request: Request) -> Response:
        policy = Policy("chat", strict=self.strict_api)
        images = Images(self.image_limits)
        sub, _, _ = await self.decoded(request, lambda raw: chat_submit(raw, "template", policy, images), images=images)
        return JSONResponse({"prompt": (await self.tokens(request, llama_helpers.render_message(sub))).text})

    async def props(self, request: Request) -> Response:
        status = await asyncio.wait_for(self.client.status(cache_salt=self.salt_of(request, None)), 10.0)
        return JSONResponse(llama_helpers.props_body(status, request.query_params.get("model")))

    async def slots(self, request: Request) -> Response:
        status = self.client.status(cache_salt=self.salt_of(request, None))
        return JSONResponse(llama_helpers.slots_body(await asyncio.wait_for(status, 10.0)))

    async def serve(self, request: Request, dialect: Dialect) -> Response:
        """Run one generating request in its API's dialect: decode it (its hints counted), submit it, and answer with
        the reply body, or its stream (errors before the first token become an HTTP status)."""
        rid = uuid.uuid4().hex[:24]
        policy = Policy(dialect.api, strict=self.strict_api)
        for header in dialect.hint_headers:
            if header in request.headers:
                policy.hint(f"header:{header}")
        headed = normalise.SessionHeaders.read(request.headers, policy)  # (before the decode: counted with its hints)
        images = Images(self.image_limits)
        decode = functools.partial(self._decode, dialect, rid, policy, images)
        asked, keep_alive, call = await self.decoded(request, decode, policy, rid, images)
        sub = normalise.served(call.sub, asked, keep_alive, self.salt_of(request, call.sub.cache_salt), self.owner_of(request))
        headed.apply(sub)
        if sub.priority > 0 and not self.may_go_first(request):
            sub.priority = 0  # (another key's requests would go before everyone's: --priority-keys)
            FIELDS_IGNORED.labels(dialect.api, "priority").inc()
            log.info("priority_not_allowed", request_id=rid, api=dialect.api)
        t0 = asyncio.get_running_loop().time()
        messages = self.client.stream_submit(sub)
        try:
            first = await self._first(messages, request, sub)
        except KvrouteError as exc:
            if not (call.stream and call.failed and exc.code == ErrorCode.CONTEXT_OVERFLOW):
                raise
            text = dialect.errors.message(error_text(exc), exc.code, exc.overflow)
            failed = call.failed(dialect.errors.code(exc.code), text)
            return StreamingResponse(iter([failed]), media_type="text/event-stream", headers=SSE_HEADERS)
        if first is None:
            return Response(status_code=499)
        if not call.stream:
            result = first if isinstance(first, Result) else await self._drain(messages, request, sub)
            if result is None:
                return Response(status_code=499)
            self._check_deadline(result, sub)
            return JSONResponse(call.reply(result))

        async def checked() -> AsyncIterator[Delta | Result]:
            timed = False
            msg: Delta | Result = first
            while True:
                if isinstance(msg, Result):
                    self._check_deadline(msg, sub)
                elif not timed and msg.tokens:
                    HTTP_TTFT.observe(asyncio.get_running_loop().time() - t0)
                    timed = True
                yield msg
                if isinstance(msg, Result):
                    return
                try:
                    msg = await anext(messages)
                except StopAsyncIteration:
                    return

        async def body() -> AsyncIterator[bytes]:
            clock = Clock(self.keep_alive_s)
            source = Ticking(checked(), clock)
            events: list[bytes] = []
            try:
                if isinstance(first, Result):
                    self._check_deadline(first, sub)
                async for event in call.events(source):
                    events.append(event)
                    if not source.ready():  # (what came in together goes out in one write)
                        yield b"".join(events)
                        events.clear()
                        clock.wrote()
                if events:
                    yield b"".join(events)
            except KvrouteError as exc:
                yield b"".join([*events, dialect.stream_error(error_text(exc), exc.code, exc.overflow)])
            finally:
                await source.aclose()
                await messages.aclose()  # on client disconnect this sends the cancel

        return self._stream(body(), dialect.stream_error)

    def _decode(
        self, dialect: Dialect, rid: str, policy: Policy, images: Images, raw: dict[str, Any]
    ) -> tuple[str | None, float | None, Call]:
        """A generating request's body: the model it asks for, its keep-alive, and its call in `dialect` (which names
        the model serving it); `images` reads its images."""
        asked, keep_alive = self.asked_model(raw), normalise.keep_alive_s(raw.pop("keep_alive", None))
        model = asked if asked in self.names else self.model_name
        return asked, keep_alive, dialect.decode(raw, rid, policy, model, images)

    def _stream(self, events: AsyncIterator[bytes], on_error: Any) -> BoundedStream:
        """An event stream cut, with `on_error`'s event last, when its reader stalls (gateway/limits.py)."""
        message = f"the reader took nothing for {self.stall_s:g} s; the generation was cancelled"
        cut = on_error(message, ErrorCode.TOO_SLOW, None)
        return BoundedStream(events, stall_s=self.stall_s, cut_event=cut, media_type="text/event-stream", headers=SSE_HEADERS)

    @staticmethod
    def _check_deadline(result: Result, sub: Submit) -> None:
        if result.finish_reason == FinishReason.DEADLINE_EXCEEDED:
            raise KvrouteError(
                f"deadline of {sub.deadline_ms} ms exceeded after {result.usage.completion_tokens} tokens",
                code=ErrorCode.DEADLINE_EXCEEDED,
            )

    async def _first(
        self, messages: AsyncGenerator[Delta | Result, None], request: Request, sub: Submit
    ) -> Delta | Result | None:
        """The reply's first message; None when the client left before it came (a queued or prefilling request is
        cancelled then: nobody waits for its prompt to be computed)."""
        first = asyncio.ensure_future(anext(messages))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if first.done():
            return first.result()
        first.cancel()  # (inside the generator: its `finally` sends the cancel)
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, KvrouteError):
            await first
        await messages.aclose()
        log.info("http_client_gone", request_id=sub.id, before="first token")
        return None

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


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; a RequestError (400) names what is wrong with it."""
    opening = raw.count(b"{") + raw.count(b"[")  # (at least the depth: most bodies need no closer look)
    depth = json_depth(raw) if opening > MAX_JSON_DEPTH else opening
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"request body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:  # msgspec's parser: 5x json's (which holds the GIL, and with it the event loop, 0.2 s for 7 MB)
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # (json's reading, and its words, for what strict JSON is not)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


async def until_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client of `request` closes its connection first: `work` is then cancelled
    (an embed or rerank: the client's `cancel` stops its inputs on the worker)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            log.info("http_client_gone", path=request.url.path)
            return None
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns once the client of `request` (its body read) has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Guard:
    """Pure ASGI middleware: the Host check and JSON-only POSTs (gateway/browsers.py), the API key check (all but
    /health), the body's size, and request counting by status."""

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

        limit = self.gateway.max_body_bytes
        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, counting_send)
            else:
                await self.app(scope, limited(receive, limit, self.gateway.body_timeout_s), counting_send)
        except StalledReader as exc:
            log.warning("http_reply_cut", path=path, reason=str(exc))
        finally:
            HTTP_REQUESTS.labels(endpoint, str(status["code"])).inc()

    def refusal(self, scope: Any) -> Response | None:
        """The answer to a request refused on its headers alone, before a byte of its body is read; None to serve it."""
        request, path, errors = Request(scope), scope["path"], errors_for(scope["path"])
        host = request.headers.get("host")
        if not self.gateway.allowed_hosts.allows(host):
            return errors.of("host", host_refused_message(host or ""), code="host_not_allowed")
        if path != "/health" and not self.gateway.authorized(request):
            return errors.of("auth", "missing or wrong API key", code="invalid_api_key")
        content_type = request.headers.get("content-type")
        if scope["method"] == "POST" and not is_json(content_type):
            return errors.of("not_json", not_json_message(content_type), code="unsupported_media_type")
        length, limit = declared_length(scope), self.gateway.max_body_bytes
        if length is not None and length > limit:
            return errors.of("too_large", too_large_message(length, limit), code="too_large")
        return None


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
        Route("/v1/embeddings", gateway.embeddings, methods=["POST"]),
        Route("/embeddings", gateway.embeddings, methods=["POST"]),
        *(Route(path, gateway.rerank, methods=["POST"]) for path in RERANK_PATHS),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/apply-template", gateway.apply_template, methods=["POST"]),
        Route("/slots", gateway.slots, methods=["GET"]),
        Route("/props", gateway.props, methods=["GET"]),
    ]

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return errors_for(request.url.path).of(exc.kind, exc.message, code=exc.code, param=exc.param)

    async def on_kvroute_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvrouteError)
        return kvroute_error_response(exc, errors_for(request.url.path))

    async def on_timeout(request: Request, exc: Exception) -> Response:
        return errors_for(request.url.path).of("timeout", str(exc) or "timeout", code="timeout")

    async def on_internal(request: Request, exc: Exception) -> Response:
        error_id = uuid.uuid4().hex[:12]
        log.error("http_internal_error", error_id=error_id, path=request.url.path, error=repr(exc))
        message = f"internal error {type(exc).__name__} (error id {error_id})"
        return errors_for(request.url.path).of("internal", message, code=ErrorCode.INTERNAL)

    # (CORS, when origins are given, outside the guard: a browser's preflight carries no key and no body)
    cors = [Middleware(CORSMiddleware, allow_origins=gateway.cors_origins, allow_methods=["GET", "POST"], allow_headers=["*"])]
    return Starlette(
        routes=routes,
        middleware=[*(cors if gateway.cors_origins else []), Middleware(Guard, gateway=gateway, paths={r.path for r in routes})],
        exception_handlers={
            RequestError: on_request_error,
            KvrouteError: on_kvroute_error,
            TimeoutError: on_timeout,
            Exception: on_internal,
        },
    )
