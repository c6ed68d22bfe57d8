"""The router's event loop: client socket, worker socket, queue, dispatch, relay, liveness.

One asyncio task reads each socket and a ticker runs every 100 ms; all state (mirror, index, queue,
requests, workers) is owned by this loop, so there are no locks. Every change that may free or fill a
slot ends in `_pump()`, which dispatches queued requests in arrival order.

Failure rules:
- A frame a client sends that cannot be served gets an `error` reply naming the problem; the loop goes on.
- A worker silent for `heartbeat_timeout_s`, or whose process exited (`worker_exited`, from the
  supervisor), is dead at once: its slots leave the index in the same turn, its requests that have not
  streamed to their client are queued again at the front, the others end with `worker_lost`.
- A queued request whose deadline passes gets `deadline_exceeded`; with no worker for
  `no_workers_grace_s`, queued and new requests get `no_workers`.

Graceful stop (`shutdown()`, on SIGTERM): new submits get `draining` at once; accepted requests (queued
or running) go on and the loop stops when none is left, or after `drain_timeout_s`, when each request
still open gets a `draining` error and its job is cancelled. A second `shutdown()` gives up waiting.
No accepted request ends without a reply. `hangup()` (SIGHUP) changes nothing and says so in the log.

systemd: READY=1 once both sockets are bound; a STATUS= line (workers, busy slots, queue, served) every
second; WATCHDOG=1 from the ticker when the unit asks for it; STOPPING=1 when draining starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import time
import typing
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from chat.request import ChatFormat
from chat.template import ChatTemplate
from kvroute import logs
from kvroute.notify import notify, watchdog_interval_s
from kvroute.vocab import Vocab
from protocol import (
    Accept,
    Cancel,
    Choice,
    Detokenize,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Invalid,
    Job,
    JobCancel,
    JobDelta,
    JobDone,
    JobError,
    Refuse,
    SlotStatus,
    StatusReply,
    StatusRequest,
    Submit,
    Timings,
    Tokenize,
    Tokens,
    Usage,
    WorkerStatus,
    client_request_decoder,
    encode,
    worker_to_router_decoder,
)
from router.config import RouterConfig
from router.metrics import Metrics, RequestRecord, mispredicted
from router.mirror import Mirror
from router.prepare import Prepared, PrepareError, prepare, text_chars, tokens_reply
from router.replies import choice_of, delta_of, result_of
from router.requests import Req, ReqState, WorkerConn, WorkerState
from router.security import Gatekeeper, Security
from router.select import Dispatch, Params, Wait, coldest, predicted_reuse, select

log = logs.get(__name__)

TICK_S = 0.1
MAX_WAITING_SCAN = 64  # queued requests examined per event beyond those dispatched
STATUS_EVERY_S = 1.0  # systemd STATUS= lines
CLOSE_LINGER_MS = 1000  # last replies (drain errors) get this long to leave when the sockets close
# Text longer than this is tokenized on a thread: llama_tokenize takes ~3 us a token here (80 ms for a 130 kB,
# 26k-token conversation), which on the event loop would stall every other client for as long.
TOKENIZE_INLINE_CHARS = 16 * 1024
NO_TOKENS = np.zeros(0, dtype=np.int32)


def params_from(cfg: RouterConfig) -> Params:
    return Params(
        policy=cfg.policy,
        prefix_cache=cfg.prefix_cache,
        min_match=cfg.min_match,
        busy_slot_cost=float(cfg.busy_slot_cost),
        evict_weight=cfg.evict_weight,
        evict_half_life_s=cfg.evict_half_life_s,
        imbalance_abs=cfg.imbalance_abs,
        imbalance_rel=cfg.imbalance_rel,
        busy_wait_ms=float(cfg.busy_wait_ms),
        hold_ms=float(cfg.hold_ms),
    )


def send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Send without waiting through the asyncio socket itself; a zmq error (EHOSTUNREACH...) raises here.

    Never through a synchronous shadow of the same socket: such a send consumes the socket's edge-triggered
    readiness, so a recv awaiting on the asyncio socket is not woken and the loop stalls (under load every
    worker then looked dead: no heartbeat). pyzmq's own send re-arms the pending recv.
    """
    fut = typing.cast("asyncio.Future[Any]", sock.send_multipart(frames, flags=zmq.NOBLOCK))
    if not fut.done():  # another send is pending: this one completes after it
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return
    exc = fut.exception()
    if exc is not None:
        raise exc


class Router:
    """The router process's state and loops. `await run()` serves until `stop()`."""

    def __init__(self, cfg: RouterConfig, vocab: Vocab, *, context: zmq.asyncio.Context | None = None) -> None:
        self.cfg = cfg
        self.vocab = vocab
        self.params = params_from(cfg)
        self.router_id = uuid.uuid4().hex[:12]
        self.ctx = context or zmq.asyncio.Context.instance()
        bos = vocab.piece(vocab.bos).decode("utf-8", "replace") if vocab.bos is not None else ""
        eos = vocab.piece(vocab.eos).decode("utf-8", "replace") if vocab.eos is not None else ""
        template = ChatTemplate.choose(vocab.chat_template, cfg.chat_template, cfg.chat_format, bos_text=bos, eos_text=eos)
        self.chat = ChatFormat(template)
        self.mirror = Mirror()
        self.metrics = Metrics()
        self.workers: dict[str, WorkerConn] = {}
        self.seen: set[tuple[str, int]] = set()  # (worker id, incarnation) ever accepted
        self.restarts: dict[str, int] = {}  # filled by the supervisor
        self.requests: dict[tuple[bytes, str, int], Req] = {}  # by (client, request id, choice)
        self.jobs: dict[str, Req] = {}
        self.queue: list[Req] = []
        self.no_workers_since: float | None = time.monotonic()
        self._job_ids = itertools.count(1)
        self._rid = itertools.count(1)
        self._rotation = 0
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.client_sock: zmq.asyncio.Socket | None = None
        self.worker_sock: zmq.asyncio.Socket | None = None
        self._client_decoder = client_request_decoder(cfg.max_frame_bytes)
        self._worker_decoder = worker_to_router_decoder()
        self.on_worker_dead: Callable[[str, str], None] | None = None  # supervisor hook
        self.draining = False
        self._drain_deadline = 0.0
        self._next_status = 0.0
        self._watchdog_s = watchdog_interval_s()
        # long texts are tokenized here, so that the event loop keeps serving (llama_tokenize releases the GIL)
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvroute-tokenize")
        self._next_watchdog = 0.0
        self.gatekeeper: Gatekeeper | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def bind(self) -> None:
        """Read the keys and bind both sockets. A bad key setup raises ValueError naming the flag."""
        security = Security.from_config(self.cfg)
        self.gatekeeper = Gatekeeper(self.ctx, security)  # its ZAP handler is bound before any CURVE socket
        for endpoint in security.insecure:
            log.warning("insecure_bind", endpoint=endpoint, reason="no CURVE keys: anyone who can reach it gets in")
        self.client_sock = self._router_socket(self.cfg.client_endpoint, security, "clients")
        self.worker_sock = self._router_socket(self.cfg.worker_endpoint, security, "workers")

    def _router_socket(self, endpoint: str, security: Security, domain: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        security.secure(sock, domain)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        # frames over the cap still get a `too_large` reply; only far larger ones drop the connection
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_frame_bytes + 4096)
        sock.bind(endpoint)
        assert self.gatekeeper is not None
        self.gatekeeper.watch(sock, domain)
        return sock

    async def run(self) -> None:
        if self.client_sock is None:
            self.bind()
        log.info(
            "router_started",
            router_id=self.router_id,
            clients=self.cfg.client_endpoint,
            workers=self.cfg.worker_endpoint,
            policy=self.cfg.policy,
            chat_template=self.chat.name,
            tool_calls=self.chat.family.name,
            model=self.vocab.name,
            curve=sorted(self.gatekeeper.security.allowed) if self.gatekeeper else [],
        )
        self.ready.set()
        notify(ready=True, status=self.status_line())
        tasks = [
            asyncio.ensure_future(self._client_loop()),
            asyncio.ensure_future(self._worker_loop()),
            asyncio.ensure_future(self._ticker()),
            *(self.gatekeeper.tasks() if self.gatekeeper else []),
        ]
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if self.gatekeeper is not None:
                self.gatekeeper.close()
            for sock in (self.client_sock, self.worker_sock):
                if sock is not None:
                    sock.close(CLOSE_LINGER_MS)
            self._tokenizer.shutdown(wait=False, cancel_futures=True)
            log.info("router_stopped", router_id=self.router_id)

    def stop(self) -> None:
        """Stop now (requests still open get no reply: tests and the drain's last step use this)."""
        self._stop.set()

    def shutdown(self) -> None:
        """Graceful stop (SIGTERM): refuse new requests, let accepted ones finish within drain_timeout_s."""
        now = time.monotonic()
        if self.draining:
            log.info("router_drain_cut_short", in_flight=len(self.requests))
            self._drain_deadline = now  # a second signal: give up waiting
        else:
            self.draining = True
            self._drain_deadline = now + self.cfg.drain_timeout_s
            log.info("router_draining", in_flight=len(self.requests), timeout_s=self.cfg.drain_timeout_s)
            notify(stopping=True, status=self.status_line())
        self._check_drained(now)

    def hangup(self) -> None:
        """SIGHUP: nothing is reloaded (settings are read at start; `systemctl restart` drains first)."""
        log.info("sighup", action="none", reason="settings are read at start; restart to change them", status=self.status_line())
        notify(status=self.status_line())

    def _check_drained(self, now: float) -> None:
        if not self.draining:
            return
        if self.requests and now < self._drain_deadline:
            return
        for req in list(self.requests.values()):
            if req.state is ReqState.RUNNING:
                self._cancel_job(req)
                if req.worker in self.workers:
                    self._release(self.workers[req.worker], req)
                self._finish_req(req)
            if req.state is not ReqState.DONE or not req.gone:
                self._fail(req, ErrorCode.DRAINING, "the router stopped before this request finished (drain timeout)")
        log.info("router_drained", timeout_s=self.cfg.drain_timeout_s)
        self.stop()

    def status_line(self) -> str:
        """One line for systemd's STATUS=: workers, busy slots, queue, requests served."""
        ready = sum(w.state is WorkerState.READY for w in self.workers.values())
        slots = sum(len(w.slots) for w in self.workers.values())
        busy = sum(w.load.busy for w in self.workers.values())
        served = self.metrics.requests["stop"] + self.metrics.requests["length"]
        other = sum(self.metrics.requests.values()) - served
        head = f"draining, {len(self.requests)} in flight; " if self.draining else ""
        return (
            f"{head}workers {ready} ready/{len(self.workers)}, slots {busy}/{slots} busy, queued {len(self.queue)},"
            f" served {served}, other endings {other}"
        )

    # ---- client side ----------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        assert self.client_sock is not None
        while True:
            frames = await self.client_sock.recv_multipart()
            try:
                self._on_client_frames(frames)
            except Exception as exc:  # never let one request take the loop down
                error_id = uuid.uuid4().hex[:12]
                log.exception("client_frame_crashed", error_id=error_id, error=str(exc))
                self._reply(frames[0], [], Error(code=ErrorCode.INTERNAL, message="internal error", error_id=error_id))

    def _on_client_frames(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        if len(rest) == 2 and rest[0] == b"":
            envelope, payload = [b""], rest[1]
        elif len(rest) == 1:
            envelope, payload = [], rest[0]
        else:
            self.metrics.bad_frames += 1
            self._reply(identity, [], Error(code=ErrorCode.BAD_REQUEST, message=f"expected one message frame, got {len(rest)}"))
            return
        msg = self._client_decoder.decode(payload)
        if isinstance(msg, Invalid):
            self.metrics.bad_frames += 1
            log.info("bad_client_frame", code=msg.code, reason=msg.reason, request_id=msg.id)
            self._reply(identity, envelope, Error(id=msg.id, code=msg.code, message=msg.reason))
        elif isinstance(msg, Submit):
            self._on_submit(identity, envelope, msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(identity, msg.id)
        elif isinstance(msg, StatusRequest):
            self._reply(identity, envelope, self.status(msg.id))
        elif isinstance(msg, Tokenize | Detokenize):
            self._on_tokenize(identity, envelope, msg)

    def _reply(self, identity: bytes, envelope: list[bytes], msg: Any) -> bool:
        """Send to a client; False when it is gone (its requests are then cancelled)."""
        assert self.client_sock is not None
        try:
            send_now(self.client_sock, [identity, *envelope, encode(msg)])
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._client_gone(identity)
            else:
                log.warning("client_send_failed", error=str(exc))
            return False

    def _fail(self, req: Req, code: str, message: str, **extra: Any) -> None:
        """End the request with an error: every choice of it (the others' jobs are cancelled), one reply."""
        if req.state is ReqState.DONE and req.gone:
            return  # already ended (another choice of it failed first)
        gone = any(r.gone for r in req.choices)
        for r in req.choices:
            if r is not req and r.state is ReqState.RUNNING:
                r.gone = r.cancelled = True  # its job_done or job_error still updates the mirror
                self._cancel_job(r)
            elif r.state is not ReqState.DONE:
                self._finish_req(r)
                r.gone = True
        self.metrics.requests[code] += 1
        log.info("request_failed", request_id=req.rid, job=req.job, code=code, message=message)
        if not gone:
            self._reply(req.client, req.envelope, Error(id=req.rid, code=code, message=message, **extra))

    def _on_tokenize(self, identity: bytes, envelope: list[bytes], msg: Tokenize | Detokenize) -> None:
        """Tokens or text, nothing generated; a long text is tokenized on the tokenizing thread."""
        work = functools.partial(tokens_reply, msg, self.vocab, self.chat)

        def reply(fut: asyncio.Future[Tokens] | None) -> None:
            try:
                answer: Any = work() if fut is None else fut.result()
            except PrepareError as exc:
                answer = Error(id=msg.id, code=ErrorCode.BAD_REQUEST, message=str(exc), param=exc.param)
            except Exception as exc:
                error_id = uuid.uuid4().hex[:12]
                log.exception("tokenize_crashed", error_id=error_id, request_id=msg.id, error=str(exc))
                answer = Error(id=msg.id, code=ErrorCode.INTERNAL, message="internal error", error_id=error_id)
            self._reply(identity, envelope, answer)

        if isinstance(msg, Tokenize) and text_chars(msg) > TOKENIZE_INLINE_CHARS:
            asyncio.get_running_loop().run_in_executor(self._tokenizer, work).add_done_callback(reply)
        else:
            reply(None)

    def _on_submit(self, identity: bytes, envelope: list[bytes], msg: Submit) -> None:
        rid = msg.id or f"r{next(self._rid)}-{uuid.uuid4().hex[:8]}"
        if self.draining:
            self.metrics.requests[ErrorCode.DRAINING] += 1
            self._reply(identity, envelope, Error(id=rid, code=ErrorCode.DRAINING, message="the router is shutting down"))
            return
        if (identity, rid, 0) in self.requests:
            self._reply(
                identity, envelope, Error(id=rid, code=ErrorCode.BAD_REQUEST, message=f"request id {rid!r} is already in flight")
            )
            return
        now = time.monotonic()
        deadline = None if msg.deadline_ms is None else now + msg.deadline_ms / 1000.0
        # REQ sockets take exactly one reply per request: no deltas for them
        req = Req(identity, envelope, rid, NO_TOKENS, msg.sampling, msg.stream and not envelope, deadline)
        work = functools.partial(prepare, msg, self.vocab, self.chat)
        if text_chars(msg) > TOKENIZE_INLINE_CHARS:
            req.state = ReqState.TOKENIZING  # in flight: a cancel, a disconnect or a drain ends it like a queued one
            self.requests[req.key] = req
            fut = asyncio.get_running_loop().run_in_executor(self._tokenizer, work)
            fut.add_done_callback(functools.partial(self._on_prepared, req, msg.n))
            return
        try:
            prepared = work()
        except PrepareError as exc:
            self._reply(identity, envelope, Error(id=rid, code=ErrorCode.BAD_REQUEST, message=str(exc), param=exc.param))
            return
        self._enqueue(req, prepared, msg.n)

    def _on_prepared(self, req: Req, n: int, fut: asyncio.Future[Prepared]) -> None:
        if req.state is not ReqState.TOKENIZING or fut.cancelled():
            return  # ended meanwhile (cancelled, client gone, router draining or stopped)
        self.requests.pop(req.key, None)
        req.state = ReqState.QUEUED
        try:
            prepared = fut.result()
        except PrepareError as exc:
            err = Error(id=req.rid, code=ErrorCode.BAD_REQUEST, message=str(exc), param=exc.param)
            self._reply(req.client, req.envelope, err)
            return
        except Exception as exc:
            error_id = uuid.uuid4().hex[:12]
            log.exception("tokenize_crashed", error_id=error_id, request_id=req.rid, error=str(exc))
            err = Error(id=req.rid, code=ErrorCode.INTERNAL, message="internal error", error_id=error_id)
            self._reply(req.client, req.envelope, err)
            return
        self._enqueue(req, prepared, n)

    def _enqueue(self, req: Req, prepared: Prepared, n: int) -> None:
        """A prepared request: refuse it with a reason, or queue its n choices and dispatch what can go."""
        req.tokens, req.constraint, req.output = prepared.tokens, prepared.constraint, prepared.output
        if not len(req.tokens):
            err = Error(id=req.rid, code=ErrorCode.BAD_REQUEST, message="the prompt has no tokens")
            self._reply(req.client, req.envelope, err)
            return
        if refusal := self._admit(req, n):
            code, text, extra = refusal
            self.metrics.requests[code] += 1
            self._reply(req.client, req.envelope, Error(id=req.rid, code=code, message=text, **extra))
            return
        if n > 1:
            req.group = [req]
            req.group.extend(req.sibling(i) for i in range(1, n))
        now = time.monotonic()
        for r in req.choices:
            r.queued_at = now
            self.requests[r.key] = r
            self.queue.append(r)
        log.info("request_queued", request_id=req.rid, prompt_tokens=len(req.tokens), n=n, queued=len(self.queue))
        self._pump()

    def _admit(self, req: Req, n: int = 1) -> tuple[str, str, dict[str, Any]] | None:
        """Why a new request cannot be queued, or None."""
        ready = [w for w in self.workers.values() if w.state is WorkerState.READY]
        if not ready and self._no_workers_expired():
            return ErrorCode.NO_WORKERS, "no worker is connected", {}
        if ready:
            ctx = max(w.hello.ctx_per_slot for w in ready)
            need = len(req.tokens) + (req.sampling.max_tokens or 0)
            if len(req.tokens) >= ctx or need > ctx:
                return (
                    ErrorCode.CONTEXT_OVERFLOW,
                    f"prompt of {len(req.tokens)} tokens + max_tokens {req.sampling.max_tokens}"
                    f" does not fit a slot of {ctx} tokens",
                    {},
                )
        if len(self.queue) + n > max(self.queue_limit(), n):
            return ErrorCode.QUEUE_FULL, f"{len(self.queue)} requests are already waiting", {"retry_after_ms": 1000}
        return None

    def queue_limit(self) -> int:
        if self.cfg.queue_size > 0:
            return self.cfg.queue_size
        return max(8, 2 * sum(len(w.slots) for w in self.workers.values()))

    def _no_workers_expired(self) -> bool:
        return self.no_workers_since is not None and time.monotonic() - self.no_workers_since >= self.cfg.no_workers_grace_s

    def _on_cancel(self, identity: bytes, rid: str) -> None:
        lead = self.requests.get((identity, rid, 0))
        if lead is None:
            return
        for req in lead.choices:
            req.cancelled = True
            log.info("request_cancel", request_id=rid, choice=req.index, job=req.job, state=req.state.value)
            if req.state in (ReqState.QUEUED, ReqState.TOKENIZING):
                self._send_result_empty(req, "cancelled")
            elif req.state is ReqState.RUNNING:
                self._cancel_job(req)

    def _client_gone(self, identity: bytes) -> None:
        for req in [r for r in self.requests.values() if r.client == identity]:
            req.gone = req.cancelled = True
            log.info("client_gone", request_id=req.rid, job=req.job)
            if req.state in (ReqState.QUEUED, ReqState.TOKENIZING):
                self._finish_req(req)
            else:
                self._cancel_job(req)

    def _cancel_job(self, req: Req) -> None:
        if req.worker in self.workers and req.job:
            self._send_worker(self.workers[req.worker], JobCancel(id=req.job))

    def _send_result_empty(self, req: Req, reason: str) -> None:
        """End a choice that produced nothing (cancelled before it ran)."""
        self._finish_req(req)
        self.metrics.requests[reason] += 1
        waited = (time.monotonic() - req.arrived) * 1000
        req.choice = Choice(index=req.index, finish_reason=reason, text="", tokens=b"")
        req.usage = Usage(prompt_tokens=len(req.tokens), cached_tokens=0, completion_tokens=0)
        req.timings = Timings(queue_ms=waited, total_ms=waited)
        self._complete(req)

    def _complete(self, req: Req) -> None:
        """A choice ended: the result goes out once every choice of the request has ended."""
        choices = req.choices
        if req.gone or any(r.choice is None for r in choices):
            return
        lead = choices[0]
        if not lead.gone:
            self._reply(lead.client, lead.envelope, result_of(choices, lead.worker or "", lead.slot.index if lead.slot else -1))

    def _finish_req(self, req: Req) -> None:
        """Forget a request's choice (it must no longer hold a slot)."""
        req.state = ReqState.DONE
        self.requests.pop(req.key, None)
        if req in self.queue:
            self.queue.remove(req)
        if req.job:
            self.jobs.pop(req.job, None)

    # ---- dispatch -------------------------------------------------------------------------------

    def _ready_loads(self) -> list:
        return [w.load for w in self.workers.values() if w.state is WorkerState.READY]

    def _pump(self) -> None:
        """Dispatch queued requests, oldest first, while idle slots remain."""
        if not self.queue:
            self.metrics.queue_depth = 0
            return
        now = time.monotonic()
        waiting = 0
        for req in list(self.queue):
            loads = self._ready_loads()
            if not any(w.busy < len(w.slots) for w in loads):
                break  # no idle slot anywhere
            if waiting >= MAX_WAITING_SCAN:
                break  # bound the work per event when many requests wait for particular slots
            t0 = time.perf_counter()
            match = self.mirror.index.match(req.tokens)
            if req.index > 0:  # another choice of a request: beside its first choice, which computes the prompt
                lead = req.choices[0]
                if lead.state is ReqState.QUEUED or lead.state is ReqState.TOKENIZING:
                    waiting += 1
                    continue
                beside = self._beside(lead, match)
                if beside is not None:
                    self._dispatch(req, beside)
                    continue
            waited = 0.0 if req.wait_since is None else (now - req.wait_since) * 1000
            decision = select(match, loads, self.params, now, self._rotation, waited)
            self.metrics.decision_ms.observe((time.perf_counter() - t0) * 1000)
            if isinstance(decision, Wait):
                if req.wait_since is None:
                    req.wait_since = now
                    self.metrics.decisions["wait"] += 1
                    log.info(
                        "waiting_for_slot",
                        request_id=req.rid,
                        worker=decision.slot.worker,
                        slot=decision.slot.index,
                        reuse=decision.reuse,
                    )
                waiting += 1
                continue
            if isinstance(decision, Dispatch):
                self._dispatch(req, decision)
        self.metrics.queue_depth = len(self.queue)

    def _beside(self, lead: Req, match: Any) -> Dispatch | None:
        """An idle slot on the worker running `lead` (that worker copies the prompt's KV from lead's slot once it is
        computed, instead of computing it again); None when that worker has no idle slot."""
        conn = self.workers.get(lead.worker or "")
        if conn is None or conn.state is not WorkerState.READY:
            return None
        slot = coldest(conn.load, self.params.evict_half_life_s)
        if slot is None:
            return None
        reuse = predicted_reuse(match.lcp(slot), match.length, slot, self.params)
        return Dispatch(slot, reuse, 0.0, False)

    def _dispatch(self, req: Req, d: Dispatch) -> None:
        conn = self.workers[d.slot.worker]
        slot = d.slot
        job = f"{req.rid[:100]}.{next(self._job_ids)}"
        prefix_cache = self.cfg.prefix_cache and not slot.dirty
        self.mirror.assign(slot, job, req.tokens)
        self._rotation += 1
        self.queue.remove(req)
        now = time.monotonic()
        req.queue_ms += (now - req.queued_at) * 1000
        self.metrics.queue_wait_ms.observe((now - req.queued_at) * 1000)
        req.state, req.job, req.worker, req.slot = ReqState.RUNNING, job, conn.id, slot
        req.predicted, req.prefill_pending, req.attempts = d.reuse, len(req.tokens) - d.reuse, req.attempts + 1
        req.streamed, req.logprobs, req.parser = [], [], req.output.parser()
        self.jobs[job] = req
        conn.jobs[job] = req
        conn.load.busy += 1
        conn.load.queued_prefill += req.prefill_pending
        self.metrics.decisions["guarded" if d.guarded else "affinity" if d.affinity else "cold"] += 1
        deadline_ms = None if req.deadline is None else max(1, int((req.deadline - now) * 1000))
        log.info(
            "slot_assigned",
            request_id=req.rid,
            job=job,
            worker=conn.id,
            slot=slot.index,
            predicted_reuse=d.reuse,
            prefill=len(req.tokens) - d.reuse,
            cost=round(d.cost, 1),
            affinity=d.affinity,
        )
        self._send_worker(
            conn,
            Job(
                id=job,
                slot=slot.index,
                tokens=np.ascontiguousarray(req.tokens, dtype="<i4").tobytes(),
                sampling=req.sampling,
                deadline_ms=deadline_ms,
                predicted_reuse=d.reuse,
                prefix_cache=prefix_cache,
                constraint=req.constraint,
            ),
        )

    def _release(self, conn: WorkerConn | None, req: Req) -> None:
        """Undo a job's load counters on its worker."""
        if conn is None or req.job not in conn.jobs:
            return
        del conn.jobs[req.job]
        conn.load.busy -= 1
        conn.load.queued_prefill -= req.prefill_pending
        req.prefill_pending = 0

    # ---- worker side ----------------------------------------------------------------------------

    def _send_worker(self, conn: WorkerConn, msg: Any) -> None:
        assert self.worker_sock is not None
        try:
            send_now(self.worker_sock, [conn.identity, encode(msg)])
        except zmq.ZMQError as exc:
            log.warning("worker_send_failed", worker=conn.id, error=str(exc))
            if exc.errno == zmq.EHOSTUNREACH:
                self.worker_dead(conn.id, "unreachable")

    def _send_identity(self, identity: bytes, msg: Any) -> None:
        assert self.worker_sock is not None
        with contextlib.suppress(zmq.ZMQError):
            send_now(self.worker_sock, [identity, encode(msg)])

    async def _worker_loop(self) -> None:
        assert self.worker_sock is not None
        while True:
            frames = await self.worker_sock.recv_multipart()
            try:
                self._on_worker_frames(frames)
            except Exception as exc:
                log.exception("worker_frame_crashed", error=str(exc))

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            log.warning("bad_worker_frame", identity=identity.hex(), reason=f"{len(frames) - 1} frames")
            return
        msg = self._worker_decoder.decode(frames[1])
        if isinstance(msg, Invalid):
            log.warning("bad_worker_frame", identity=identity.decode("utf-8", "replace"), code=msg.code, reason=msg.reason)
            return
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        conn = self.workers.get(identity.decode("utf-8", "replace"))
        if conn is None or (isinstance(msg, Heartbeat) and msg.incarnation != conn.hello.incarnation):
            self._send_identity(
                identity, Refuse(code=ErrorCode.NOT_FOUND, reason="this router does not know this worker; say hello")
            )
            return
        conn.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(conn, msg)
        elif isinstance(msg, JobDelta):
            self._on_delta(conn, msg)
        elif isinstance(msg, JobDone):
            self._on_done(conn, msg)
        elif isinstance(msg, JobError):
            self._on_job_error(conn, msg)

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if identity != msg.worker_id.encode():
            self._send_identity(identity, Refuse(code=ErrorCode.BAD_REQUEST, reason="ZMQ identity must equal worker_id"))
            return
        if msg.model_fingerprint != self.vocab.fingerprint:
            reason = (
                f"model fingerprint {msg.model_fingerprint[:16]} differs from the router's"
                f" {self.vocab.fingerprint[:16]} ({self.vocab.name})"
            )
            log.warning("worker_refused", worker=msg.worker_id, code="model_mismatch", reason=reason)
            self._send_identity(identity, Refuse(code=ErrorCode.MODEL_MISMATCH, reason=reason))
            return
        old = self.workers.get(msg.worker_id)
        if old is not None and old.hello.incarnation == msg.incarnation:
            old.last_seen = time.monotonic()  # a repeated hello: our accept crossed it
            self._send_identity(identity, Accept(worker_id=msg.worker_id, router_id=self.router_id))
            return
        if old is not None:
            self.worker_dead(msg.worker_id, f"new incarnation {msg.incarnation}")
        known = (msg.worker_id, msg.incarnation) not in self.seen  # a fresh process starts empty
        self.seen.add((msg.worker_id, msg.incarnation))
        slots = self.mirror.add_worker(msg.worker_id, msg.slots, contents_known=known, exact=msg.deterministic)
        self.workers[msg.worker_id] = WorkerConn(msg, slots)
        self.no_workers_since = None
        self._send_identity(identity, Accept(worker_id=msg.worker_id, router_id=self.router_id))
        log.info(
            "worker_accepted",
            worker=msg.worker_id,
            incarnation=msg.incarnation,
            slots=msg.slots,
            ctx_per_slot=msg.ctx_per_slot,
            device=msg.device,
            pid=msg.pid,
        )
        self._pump()

    def _on_heartbeat(self, conn: WorkerConn, msg: Heartbeat) -> None:
        conn.queue = msg.queue
        conn.state = WorkerState.DRAINING if msg.draining else WorkerState.READY
        for st in msg.slots:
            if st.slot >= len(conn.slots) or st.busy:
                continue
            slot = conn.slots[st.slot]
            if not self.mirror.check_idle(slot, st.n_tokens):
                self.metrics.mirror_mismatches += 1
                log.error(
                    "mirror_mismatch",
                    error_id=uuid.uuid4().hex[:12],
                    worker=conn.id,
                    slot=st.slot,
                    mirror=0,
                    reported=st.n_tokens,
                    via="heartbeat",
                )

    def _on_delta(self, conn: WorkerConn, msg: JobDelta) -> None:
        req = conn.jobs.get(msg.id)
        if req is None:
            return
        if req.prefill_pending:
            conn.load.queued_prefill -= req.prefill_pending
            req.prefill_pending = 0
        req.streamed.extend(np.frombuffer(msg.tokens, dtype="<i4").tolist())
        req.logprobs.extend(msg.logprobs)
        assert req.parser is not None
        piece = req.parser.feed(msg.text)
        if req.stream and not req.gone:
            req.started = True
            delta = delta_of(req, piece, msg.tokens, msg.logprobs)
            if msg.reused_tokens is not None:  # the job's first token: what the prompt cost is known now
                delta.usage = Usage(prompt_tokens=len(req.tokens), cached_tokens=msg.reused_tokens, completion_tokens=0)
            self._reply(req.client, req.envelope, delta)

    def _on_done(self, conn: WorkerConn, msg: JobDone) -> None:
        req = conn.jobs.get(msg.id)
        if req is None or req.slot is None:
            log.warning("unknown_job_done", worker=conn.id, job=msg.id)
            return
        self._release(conn, req)
        generated = np.frombuffer(msg.tokens, dtype="<i4").astype(np.int32)
        slot = req.slot
        if msg.slot != slot.index:
            mm = self.mirror.fail(slot, msg.id, req.tokens, generated, True, 0, "not-this-slot")
        else:
            mm = self.mirror.finish(slot, msg.id, req.tokens, generated, msg.slot_tokens, msg.slot_hash)
        if mm is not None:
            self.metrics.mirror_mismatches += 1
            log.error("mirror_mismatch", **mm.__dict__, reported_slot=msg.slot, via="job_done")
        if msg.reused_tokens >= self.params.min_match:
            slot.hits += 1
        slot.reused_total += msg.reused_tokens
        if mispredicted(req.predicted, msg.reused_tokens, msg.restored_tokens):
            log.warning("reuse_mispredicted", request_id=req.rid, job=msg.id, predicted=req.predicted, actual=msg.reused_tokens)
        t = msg.timings
        timings = Timings(
            queue_ms=req.queue_ms + t.queue_ms,
            prefill_ms=t.prefill_ms,
            decode_ms=t.decode_ms,
            ttft_ms=t.ttft_ms + req.queue_ms,
            total_ms=(time.monotonic() - req.arrived) * 1000,
        )
        self.metrics.finished(
            RequestRecord(
                req.rid, conn.id, slot.index, msg.prompt_tokens, req.predicted, msg.reused_tokens,
                msg.generated_tokens, msg.finish_reason, timings.ttft_ms, timings.queue_ms, req.attempts,
                msg.restored_tokens,
            )
        )  # fmt: skip
        log.info(
            "request_done",
            request_id=req.rid,
            job=msg.id,
            worker=conn.id,
            slot=slot.index,
            finish_reason=msg.finish_reason,
            predicted_reuse=req.predicted,
            reused=msg.reused_tokens,
            restored=msg.restored_tokens,
            prefilled=msg.prefilled_tokens,
            generated=msg.generated_tokens,
            ttft_ms=round(timings.ttft_ms, 1),
        )
        self._finish_req(req)
        assert req.parser is not None
        tail = req.parser.finish()
        if req.stream and not req.gone and (tail.content or tail.reasoning or tail.calls):
            self._reply(req.client, req.envelope, delta_of(req, tail, b"", []))
        req.choice = choice_of(req, msg)
        req.usage = Usage(
            prompt_tokens=msg.prompt_tokens, cached_tokens=msg.reused_tokens, completion_tokens=msg.generated_tokens
        )
        req.timings = timings
        self._complete(req)
        self._pump()

    def _on_job_error(self, conn: WorkerConn, msg: JobError) -> None:
        req = conn.jobs.get(msg.id)
        if req is None or req.slot is None:
            return
        self._release(conn, req)
        streamed = np.asarray(req.streamed, dtype=np.int32)
        mm = self.mirror.fail(req.slot, msg.id, req.tokens, streamed, msg.slot >= 0, msg.slot_tokens, msg.slot_hash)
        if mm is not None:
            self.metrics.mirror_mismatches += 1
            log.error("mirror_mismatch", **mm.__dict__, via="job_error")
        if msg.code == ErrorCode.DRAINING and not req.started and not req.cancelled:
            conn.state = WorkerState.DRAINING
            self._requeue(req)
        else:
            self._fail(req, msg.code, msg.message, error_id=msg.error_id)
        self._pump()

    def _requeue(self, req: Req) -> None:
        self.jobs.pop(req.job or "", None)
        req.state, req.job, req.worker, req.slot = ReqState.QUEUED, None, None, None
        req.queued_at, req.wait_since = time.monotonic(), None
        self.queue.insert(0, req)
        self.metrics.redispatched += 1
        log.info("request_requeued", request_id=req.rid, attempts=req.attempts)

    def worker_dead(self, worker: str, reason: str) -> None:
        """A worker is gone: purge its slots now, re-dispatch what it had not streamed, fail the rest."""
        conn = self.workers.pop(worker, None)
        if conn is None:
            return
        self.mirror.remove_worker(worker)
        self.metrics.dead_workers += 1
        self.metrics.worker_load.pop(worker, None)
        log.warning("worker_dead", worker=worker, incarnation=conn.hello.incarnation, reason=reason, jobs=len(conn.jobs))
        for req in list(conn.jobs.values()):
            self._release(conn, req)
            self._send_identity(conn.identity, JobCancel(id=req.job or ""))  # in case it is only slow
            if req.started or req.cancelled:
                if req.cancelled:
                    self._send_result_empty(req, "cancelled")
                else:
                    self._fail(req, ErrorCode.WORKER_LOST, f"worker {worker} died ({reason}) while streaming this request")
            else:
                self._requeue(req)
        if not any(w.state is WorkerState.READY for w in self.workers.values()) and self.no_workers_since is None:
            self.no_workers_since = time.monotonic()
        if self.on_worker_dead is not None:
            self.on_worker_dead(worker, reason)
        self._pump()

    def worker_exited(self, worker: str, incarnation: int, returncode: int | None) -> None:
        """From the supervisor: the process of this worker incarnation exited."""
        conn = self.workers.get(worker)
        if conn is not None and conn.hello.incarnation == incarnation:
            self.worker_dead(worker, f"process exited with status {returncode}")

    # ---- time -----------------------------------------------------------------------------------

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception as exc:
                log.exception("tick_crashed", error=str(exc))

    def tick(self, now: float) -> None:
        for conn in list(self.workers.values()):
            if now - conn.last_seen > self.cfg.heartbeat_timeout_s:
                self.worker_dead(conn.id, f"no heartbeat for {now - conn.last_seen:.1f} s")
        for req in list(self.queue):
            if req.deadline is not None and now >= req.deadline:
                self._fail(req, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued")
        if self.queue and not self.workers and self._no_workers_expired():
            for req in list(self.queue):
                self._fail(req, ErrorCode.NO_WORKERS, f"no worker connected for {self.cfg.no_workers_grace_s:g} s")
        if any(r.wait_since is not None for r in self.queue):
            self._pump()
        for conn in self.workers.values():
            self.metrics.worker_load[conn.id] = {"busy": conn.load.busy, "queued_prefill": conn.load.queued_prefill}
        self._check_drained(now)
        if now >= self._next_status:
            self._next_status = now + STATUS_EVERY_S
            notify(status=self.status_line())
        if self._watchdog_s is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self._watchdog_s
            notify(watchdog=True)

    # ---- status ---------------------------------------------------------------------------------

    def status(self, rid: str | None) -> StatusReply:
        now = time.monotonic()
        workers = [
            WorkerStatus(
                worker=c.id,
                incarnation=c.hello.incarnation,
                device=c.hello.device,
                state=c.state.value,
                queue=c.queue,
                restarts=self.restarts.get(c.id, 0),
                slots=[
                    SlotStatus(
                        slot=s.index,
                        busy=s.busy,
                        n_tokens=len(s.tokens),
                        request_id=(self.jobs[s.job].rid if s.job in self.jobs else None),
                        reused_total=s.reused_total,
                        last_used_s=round(now - s.last_used, 3),
                    )
                    for s in c.slots
                ],
            )
            for c in self.workers.values()
        ]
        return StatusReply(id=rid, model=self.vocab.name, policy=self.cfg.policy, queued=len(self.queue), workers=workers)
