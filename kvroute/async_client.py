"""The asyncio client (`AsyncClient`): many requests in flight from many tasks on one DEALER; fail-over between
routers (a dropped connection, a draining router); direct replies from workers (kvroute/direct.py); a reader that
falls behind cut (`TooSlow`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import typing
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.monitor

from common import logs
from kvroute.direct import DirectReplies, auto_endpoint
from kvroute.errors import KvrouteError, error_from
from kvroute.requests import DEFAULT_ENDPOINT, build_submit, dealer, encode_checked
from protocol import (
    MAX_FRAME_BYTES,
    Cancel,
    Delta,
    Deltas,
    Detokenize,
    Embed,
    Embeddings,
    Error,
    ErrorCode,
    Invalid,
    MetricsReply,
    MetricsRequest,
    Placed,
    Ranked,
    Rerank,
    Result,
    StatusReply,
    StatusRequest,
    Submit,
    Tokenize,
    Tokens,
    encode,
    router_reply_decoder,
)

MAX_BUFFERED = 4096  # replies kept for one request that its reader has not taken yet

log = logs.get(__name__)


def reply_endpoint_of(given: str | None, router_endpoint: str) -> str | None:
    """The endpoint a client binds for direct replies: "auto" (kvroute/direct.py auto_endpoint), "off", or one given.
    ValueError for one workers could not be told to reach (a wildcard host)."""
    if given in (None, "", "off"):
        return None
    if given == "auto":
        return auto_endpoint(router_endpoint)
    if not given.startswith(("tcp://", "ipc://")):
        raise ValueError(f"reply endpoint {given!r}: expected tcp://HOST:PORT, ipc://PATH, 'auto' or 'off'")
    if given.startswith(("tcp://*", "tcp://0.0.0.0", "tcp://[::]")):
        raise ValueError(f"reply endpoint {given!r}: give an address the workers can reach, not a wildcard host")
    return given


class AsyncClient:
    """asyncio client; many requests may be in flight from many tasks at once.

    `reply_endpoint`: where workers send this client's streamed output directly (kvroute/direct.py), so that it does
    not pass through the router: "auto" (an ipc path or a loopback port when the router is on this host, else none),
    an endpoint to bind (tcp://HOST:PORT, a port of * picks one; HOST must be one the workers reach), or "off"."""

    _ids = itertools.count()

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout_s: float = 300.0,
        context: zmq.asyncio.Context | None = None,
        curve_key: str | None = None,
        router_key: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_buffered: int = MAX_BUFFERED,
        reply_endpoint: str | None = "auto",
    ) -> None:
        # several routers, comma-separated: one is used; when its connection drops, the next one (see _fail_over)
        self.endpoints = [e.strip() for e in endpoint.split(",") if e.strip()] or [endpoint]
        self.endpoint = self.endpoints[0]
        self.curve = (curve_key, router_key)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.max_buffered = max_buffered
        self.ctx = context or zmq.asyncio.Context.instance()
        self._decoder = router_reply_decoder()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._cut: set[str] = set()  # requests cancelled because their reader fell behind
        self._unanswered: dict[str, bytes] = {}  # frames of requests no reply has come for yet: sent again on failover
        self._sock = self._connect()
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._draining: list[tuple[zmq.asyncio.Socket, asyncio.Task[None] | None]] = []  # left routers, still streaming
        self.reply_endpoint = reply_endpoint_of(reply_endpoint, self.endpoints[0])
        self._direct: DirectReplies | None = None  # bound at the first request that uses it
        self._submits: dict[str, Submit] = {}  # requests with direct replies, as given (sent again if those fail)
        self._wire: dict[str, str] = {}  # request id -> the id it was sent again under (replies through the router)
        self._alias: dict[str, str] = {}  # ... and back

    def _connect(self) -> zmq.asyncio.Socket:
        return dealer(self.ctx, self.endpoint, self.curve)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(self._sock))
        if len(self.endpoints) > 1 and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """With several routers: when the connection to the one in use drops (its process died), move to the next."""
        sock = self._sock
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and sock is self._sock:
                    self._fail_over()
                    return
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)

    def _fail_over(self) -> None:
        """Move to the next router. A request no reply has come for is sent there again (a router places a request
        once, so it ran nowhere else); one whose output had begun ends with `router_lost`."""
        lost = self.endpoint
        old, self.endpoint = self._sock, self.endpoints[(self.endpoints.index(lost) + 1) % len(self.endpoints)]
        log.warning("router_lost", endpoint=lost, next=self.endpoint, resent=len(self._unanswered))
        self._sock = self._connect()
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        old.close(0)
        message = f"the router at {lost} stopped answering after this request's output began; it was not sent again"
        direct = self._direct
        for rid, q in list(self._queues.items()):
            if direct is not None and direct.began(rid):
                direct.orphan(rid, lost)  # its worker streams it here without the router, while it lives
            elif rid in self._unanswered:
                if direct is not None and rid in direct.sent_at:  # (a job placed at the lost router is not read)
                    direct.forget(rid)
                    direct.expect(rid)
                self._send_soon_frame(self._unanswered[rid])
            else:
                q.put_nowait(Error(id=rid, code=ErrorCode.ROUTER_LOST, message=message))
        self._ensure_reader()

    def _leave_draining(self) -> None:
        """The router in use is draining (a graceful restart): new requests, and those it refused, go to the next
        router; the ones it is streaming finish there (the old connection is read until this client closes)."""
        left = self.endpoint
        self.endpoint = self.endpoints[(self.endpoints.index(left) + 1) % len(self.endpoints)]
        log.info("router_draining", endpoint=left, next=self.endpoint)
        self._draining.append((self._sock, self._reader))
        if len(self._draining) > len(self.endpoints):  # (a router left that long ago has ended what it streamed)
            sock, reader = self._draining.pop(0)
            if reader is not None:
                reader.cancel()
            sock.close(0)
        self._sock, self._reader = self._connect(), None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self._ensure_reader()

    def _direct_for(self, sub: Submit) -> DirectReplies | None:
        """The reply endpoint this request's output comes to, if it uses one (bound now if not yet)."""
        if self.reply_endpoint is None or sub.n > 1:
            return None
        if self._direct is None:
            try:
                self._direct = DirectReplies(
                    self.reply_endpoint,
                    self._take,
                    lambda rid: self._send_soon(Cancel(id=rid)),
                    curve=self.curve != (None, None),
                    resend=self._resend_routed,
                )
            except (zmq.ZMQError, ValueError) as exc:
                log.error(
                    "reply_endpoint_failed",
                    endpoint=self.reply_endpoint,
                    error=str(exc),
                    effect="replies come through the router",
                )
                self.reply_endpoint = None
                return None
            log.info("reply_endpoint", endpoint=self._direct.endpoint, curve=bool(self._direct.key))
        self._direct.start()
        return None if self._direct.broken else self._direct

    def _resend_routed(self, rid: str) -> bool:
        """A request whose worker could not reach the reply endpoint (it sent nothing): cancelled, and sent again under
        another id with its replies through the router; they reach its reader under its own id."""
        sub = self._submits.pop(rid, None)
        if sub is None or rid not in self._queues:
            return False
        self._send_soon(Cancel(id=rid))
        wire = f"{rid[:120]}~routed"
        self._wire[rid], self._alias[wire] = wire, rid
        self._send_soon(msgspec.structs.replace(sub, id=wire, reply_to=None, reply_key=None))
        return True

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            msg = self._decoder.decode(frame)
            if isinstance(msg, Invalid):
                log.warning("unreadable_reply", code=msg.code, reason=msg.reason)
            elif isinstance(msg, Placed):  # its output comes from the worker now (kvroute/direct.py); until its
                if self._direct is not None:  # first delta it may be sent to another router (_fail_over)
                    self._direct.placed(msg)
            elif isinstance(msg, Deltas):  # several requests' deltas (this client's submits say batch_deltas)
                for delta in msg.items:
                    self._take(delta)
            else:
                self._take(msg, sock)

    def _take(self, msg: Any, sock: zmq.asyncio.Socket | None = None) -> None:
        """One reply to the queue of the request it answers."""
        if msg.id is None and isinstance(msg, Error):
            if len(self._queues) != 1:  # cannot tell whose frame it was: fail none of them
                log.warning("unattributed_error", code=msg.code, message=msg.message, waiting=len(self._queues))
                return
            (msg.id,) = self._queues  # the router could not read the frame of the one request waiting
        rid = msg.id or ""
        if self._alias:  # (requests sent again under another id: _resend_routed)
            if rid in self._wire:
                return  # the first attempt's last words (its cancel)
            if rid in self._alias:
                msg.id = rid = self._alias[rid]
        if isinstance(msg, Error) and msg.code == ErrorCode.DRAINING and rid in self._unanswered and len(self.endpoints) > 1:
            if sock is self._sock:
                self._leave_draining()
            self._send_soon_frame(self._unanswered[rid])  # to the next router (a draining one placed it nowhere)
            return
        self._unanswered.pop(rid, None)
        q = self._queues.get(rid)
        if q is None or rid in self._cut:
            return
        if q.qsize() >= self.max_buffered:
            self._fall_behind(rid, q)
            return
        q.put_nowait(msg)

    def _fall_behind(self, rid: str, q: asyncio.Queue[Any]) -> None:
        """The reader of `rid` left max_buffered replies untaken: cancel it, and end what it will read with TooSlow
        (what it has not read yet stays; nothing more is kept)."""
        self._cut.add(rid)
        message = f"the reader took none of the last {self.max_buffered} replies; the request was cancelled"
        log.warning("reader_too_slow", request_id=rid, buffered=q.qsize())
        q.put_nowait(Error(id=rid, code=ErrorCode.TOO_SLOW, message=message))
        self._send_soon(Cancel(id=self._wire.get(rid, rid)))

    def _send_soon(self, msg: Any) -> None:
        self._send_soon_frame(encode(msg))

    def _send_soon_frame(self, frame: bytes) -> None:
        fut = typing.cast("asyncio.Future[Any]", self._sock.send(frame))  # done at once unless a send is pending
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def close(self) -> None:
        for task in (self._reader, self._watcher, *(reader for _, reader in self._draining)):
            if task:
                task.cancel()
        for sock, _ in self._draining:
            sock.close(0)
        self._sock.close(0)
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _next(self, q: asyncio.Queue[Any]) -> Any:
        if not q.empty():  # (a reply per token: a timer for each would cost more than the rest of the path)
            msg = q.get_nowait()
        else:
            try:
                async with asyncio.timeout(self.timeout_s):
                    msg = await q.get()
            except TimeoutError:
                raise TimeoutError(f"no reply from the router at {self.endpoint} in {self.timeout_s:g} s") from None
        if isinstance(msg, Error):
            raise error_from(msg)
        return msg

    def stream(self, **kwargs: Any) -> AsyncGenerator[Delta | Result, None]:
        """Submit; yields each Delta, then the final Result. Leaving early cancels the request."""
        return self.stream_submit(build_submit(stream=True, **kwargs))

    async def stream_submit(self, sub: Submit) -> AsyncGenerator[Delta | Result, None]:
        """Send a ready-made Submit (it must carry an id); yields each Delta, then the Result."""
        if sub.stream and not sub.batch_deltas:  # this reader takes `deltas` messages apart (_read_loop)
            sub = msgspec.structs.replace(sub, batch_deltas=True)
        direct = self._direct_for(sub)
        if direct is not None:
            sub = msgspec.structs.replace(sub, reply_to=direct.endpoint, reply_key=direct.key or None)
        assert sub.id is not None
        frame = encode_checked(sub, self.max_frame_bytes)  # (before any record of it: a refusal leaves none behind)
        if direct is not None:
            direct.expect(sub.id)
            self._submits[sub.id] = sub
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[sub.id] = q
        self._unanswered[sub.id] = frame
        self._ensure_reader()
        done = False
        try:
            await self._sock.send(frame)
            while True:
                msg = await self._next(q)
                if isinstance(msg, Result):
                    done = True
                    yield msg
                    return
                yield msg
        except KvrouteError:
            done = True  # (a TooSlow one was cancelled when it was cut)
            raise
        finally:
            self._queues.pop(sub.id, None)
            self._unanswered.pop(sub.id, None)
            self._cut.discard(sub.id)
            wire = self._wire.pop(sub.id, sub.id)
            self._alias.pop(wire, None)
            if direct is not None:
                direct.forget(sub.id)
                self._submits.pop(sub.id, None)
            if not done:
                await self._sock.send(encode(Cancel(id=wire)))

    async def submit(self, **kwargs: Any) -> Result:
        result = None
        async for msg in self.stream(**kwargs):
            if isinstance(msg, Result):
                result = msg
        assert result is not None
        return result

    async def cancel(self, request_id: str) -> None:
        await self._sock.send(encode(Cancel(id=self._wire.get(request_id, request_id))))

    async def status(self, cache_salt: str | None = None) -> StatusReply:
        rid = f"status-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        reply: StatusReply = await self._ask(StatusRequest(id=rid, cache_salt=cache_salt))
        return reply

    async def metrics(self) -> str:
        """The router's and its workers' metrics, in Prometheus' text format."""
        reply: MetricsReply = await self._ask(MetricsRequest(id=f"metrics-{next(self._ids)}-{uuid.uuid4().hex[:6]}"))
        return reply.text

    async def embed(self, msg: Embed) -> Embeddings:
        """Send an `embed` (its id is set here when it has none) and wait for the vectors."""
        msg.id = msg.id or f"emb-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        reply: Embeddings = await self._ask(msg, cancel_if_abandoned=True)
        return reply

    async def rerank(self, msg: Rerank) -> Ranked:
        """Send a `rerank` (its id is set here when it has none) and wait for the scores."""
        msg.id = msg.id or f"rr-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        reply: Ranked = await self._ask(msg, cancel_if_abandoned=True)
        return reply

    async def tokens(self, msg: Tokenize | Detokenize) -> Tokens:
        """Send a `tokenize` or `detokenize` (its id is set here) and wait for the `tokens` reply."""
        msg.id = f"tok-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        reply: Tokens = await self._ask(msg)
        return reply

    async def _ask(self, msg: Any, cancel_if_abandoned: bool = False) -> Any:
        """Send a message that has one reply, and wait for that reply (an Error raises). With `cancel_if_abandoned`, a
        wait that is cancelled (its caller gave up: an HTTP client gone) sends the router a `cancel` for it, so that
        its work (an embed's inputs) stops too."""
        frame = encode_checked(msg, self.max_frame_bytes)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[msg.id] = q
        self._unanswered[msg.id] = frame
        self._ensure_reader()
        try:
            await self._sock.send(frame)
            return await self._next(q)
        except (asyncio.CancelledError, TimeoutError):  # (a wait given up: cancelled, or no reply in timeout_s)
            if cancel_if_abandoned:  # (a cancellation was delivered: one more await runs)
                with contextlib.suppress(zmq.ZMQError):
                    await self.cancel(msg.id)
            raise
        finally:
            self._queues.pop(msg.id, None)
            self._unanswered.pop(msg.id, None)
