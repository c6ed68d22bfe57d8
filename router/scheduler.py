"""The router's core without a socket: the life cycle of its requests, over the worker table (router/workers.py),
the queue and its placements (router/dispatch_queue.py) and the mirror (router/mirror.py).

Every event is a method call: `accept` and `prepared` (a submit, before and after its prompt is rendered and
tokenized), `cancel`, `client_gone`, `hello`, `worker_message` (heartbeat, job_delta, job_done, job_error),
`worker_dead`, `tick`, `drain_expired`. What an event sends is appended to `outbox` (`Out` records), which the
I/O shell (router/server.py) takes and sends afterwards. A send that fails comes back as another event
(`client_gone`, `worker_dead`), after the first one is over: no event runs inside another.

A request (one per choice: a request with n > 1 has n, sharing one `group`) is in one state at a time, changed
only by these transitions, each moving it between containers in the same step:

    accept    -> TOKENIZING   in `requests` (its prompt is being rendered and tokenized)
    enqueue   -> QUEUED       in `requests` and `queue`
    dispatch  -> RUNNING      also in `jobs` and its worker's `jobs`; its slot busy in the mirror
    requeue   -> QUEUED       back at the head of `queue` (its worker died or handed it back before any output)
    cancel    -> CANCELLING   a running one: the worker is told, and its job's end finishes it
    finish    -> DONE         out of every container (`fail` is a finish with an error reply)

Worker load (busy slots, prefill still to compute) is derived from the mirror and the running jobs whenever it is
read, never counted up and down beside them.

Failure rules:
- A worker silent for `heartbeat_timeout_s`, whose process exited, or that is hung (it has jobs and its engine's
  step count has not moved for `hung_after_s`), is dead at once: its slots leave the index in the same event, its
  requests that have not streamed to their client are queued again at the front, the others end with
  `worker_lost`. A hung worker, and a silent one still silent after `hung_after_s`, is also to be killed
  (`kills`: the shell hands them to the supervisor, which restarts it).
- A request that was running on `max_worker_deaths` workers when they died fails (`worker_lost`) instead of
  taking the next worker down too; a request that was on one dying worker runs on a worker with no other such
  request, so that the next death tells which request caused it.
- A worker that says hello after the router forgot it (the router restarted, or declared it dead) reports what
  each slot holds; the mirror starts from that, so the conversations it holds stay cached.
- A request goes only to a worker whose slots can hold it; one no ready worker can hold for `no_workers_grace_s`
  gets `context_overflow`.
- A queued request whose deadline passes gets `deadline_exceeded`, and so does a running one whose worker has not
  ended it a second after (its job is cancelled); with no worker for `no_workers_grace_s`, queued and new requests
  get `no_workers`. An embed or rerank request gets `deadline_exceeded` when its deadline passes, waiting or
  running (its job is cancelled on its worker).
- An error ends the request at once; a choice still running is cancelled and stays CANCELLING until its job's end
  tells what the slot holds (the mirror stays exact).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from common import logs
from protocol import (
    Accept,
    Choice,
    Delta,
    Embed,
    EmbedDone,
    Error,
    ErrorCode,
    FailedWorker,
    Heartbeat,
    Hello,
    JobCancel,
    JobDelta,
    JobDeltas,
    JobDone,
    JobError,
    JobImage,
    Placed,
    Refusal,
    Refuse,
    Rerank,
    SlotTaken,
    SlotUpdate,
    StatusReply,
    Submit,
    Timings,
    Usage,
    kind_of,
    token_array,
    unpack_tokens,
)
from router import admission, handshake, outcomes, sampling_defaults, views
from router.client_replies import choice_of, delta_of, result_of
from router.config import RouterConfig
from router.dispatch_queue import DispatchQueue, job_message
from router.embeds import EmbedReq, Embeds, EmbedWait
from router.metrics import Metrics
from router.mirror import Mirror
from router.prepare import Prepared
from router.requests import Attempt, Req, ReqState, WorkerConn, WorkerState, tenant
from router.select import Dispatch
from router.workers import Kill, WorkerTable

WorkerReport = Heartbeat | JobDelta | JobDeltas | JobDone | JobError | SlotTaken | SlotUpdate | EmbedDone

log = logs.get(__name__)

DEADLINE_GRACE_S = 1.0  # a worker ends a job at its deadline itself; the router steps in this much later


@dataclass(frozen=True)
class Out:
    """A message to send: to a client (with its envelope) or, with `worker`, to a worker."""

    to: bytes  # ZMQ identity
    msg: Any
    envelope: tuple[bytes, ...] = ()
    worker: bool = False
    batch: bool = False  # a Delta its client takes inside a `deltas` message with others (Submit.batch_deltas)


class Scheduler:
    """The router's state and the life cycle of its requests. Owned by one thread (the shell's event loop)."""

    def __init__(
        self,
        cfg: RouterConfig,
        *,
        fingerprint: str,
        model: str,
        router_id: str,
        weights: str = "",
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.fingerprint, self.model, self.router_id = fingerprint, model, router_id
        self.weights = weights  # the model file's weights fingerprint ("" : not checked)
        self.mirror = Mirror()
        self.metrics = metrics or Metrics()  # (several models' cores share the router's)
        self.table = WorkerTable(cfg, self.mirror, self.metrics)
        self.workers = self.table.workers  # by id (the same dict: the views, the shell and the tests read it)
        self.restarts, self.expected, self.failed = self.table.restarts, self.table.expected, self.table.failed
        self.queue = DispatchQueue(cfg, self.mirror, self.metrics, self.table)
        self.params = self.queue.params
        self.requests: dict[tuple[bytes, str, int], Req] = {}  # by (client, request id, choice)
        self.jobs: dict[str, Req] = {}
        self.embeds = Embeds(router_id)
        self.draining = False
        # (prompt, add_bos, prompt tokens, reply tokens, tenant) of a finished chat job: router/prompt_tokens.py `remember`
        self.remember_reply: Callable[[str, bool, np.ndarray, np.ndarray, str], None] = lambda *_: None
        self.outbox: list[Out] = []
        self._job_ids = itertools.count(1)
        self._rid = itertools.count(1)
        # what a request leaves to the server: the operator's, else llama-server's, until router/server.py gives the
        # model's (its GGUF's values)
        self.sampling = sampling_defaults.resolve({}, cfg.sampling_flags(), lambda _key: None)

    def take(self) -> list[Out]:
        """The messages the last events produced (the outbox is emptied)."""
        out, self.outbox = self.outbox, []
        return out

    # ---- sending ----------------------------------------------------------------------------------

    def _to_client(self, req: Req, msg: Any) -> None:
        if req.reply_to is not None:
            self.outbox.append(Out(req.reply_to, msg, tuple(req.envelope), batch=req.batch_deltas and isinstance(msg, Delta)))

    def _to_worker(self, conn: WorkerConn, msg: Any) -> None:
        self.outbox.append(Out(conn.identity, msg, worker=True))

    def reply(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any) -> None:
        self.outbox.append(Out(identity, msg, envelope))

    # ---- transitions ------------------------------------------------------------------------------

    def _enqueue(self, req: Req, front: bool = False) -> None:
        req.state, req.attempt = ReqState.QUEUED, None
        req.queued_at, req.wait_since = time.monotonic(), None
        self.requests[req.key] = req
        self.queue.push(req, front)

    def _dispatch(self, req: Req, d: Dispatch) -> None:
        conn = self.workers[d.slot.worker]
        slot = d.slot
        job = f"{req.rid[:100]}.{self.router_id[:8]}.{next(self._job_ids)}"  # (unique among routers side by side)
        prefix_cache = self.cfg.prefix_cache and not slot.dirty
        self.mirror.assign(slot, job, req.tokens, req.salt)
        self.queue.remove(req)
        now = time.monotonic()
        req.queue_ms += (now - req.queued_at) * 1000
        self.metrics.queue_wait_ms.observe((now - req.queued_at) * 1000)
        req.state, req.attempts = ReqState.RUNNING, req.attempts + 1
        req.attempt = Attempt(job, conn.id, slot, d.reuse, len(req.tokens) - d.reuse, req.output.parser())
        if not conn.jobs:
            conn.progress_at = now  # progress is expected from now on
        self.jobs[job] = req
        conn.jobs[job] = req
        conn.refresh()
        kind = "guarded" if d.guarded else "restore" if d.restore else "affinity" if d.affinity else "cold"
        self.metrics.decisions[kind] += 1
        sampling = admission.open_capped(req.sampling, self.cfg.default_max_tokens, conn.hello.ctx_per_slot - len(req.tokens))
        self._to_worker(conn, job_message(req, d, job, prefix_cache, now, sampling))
        if req.direct:  # the client reads the job's output from the worker: it learns where, and how to read it
            self.metrics.direct_jobs += 1
            shift = req.shift
            self._to_client(
                req,
                Placed(
                    id=req.rid,
                    job=job,
                    worker=conn.id,
                    slot=slot.index,
                    format=req.output.wire(),
                    prompt_tokens=len(req.tokens),
                    queue_ms=req.queue_ms,
                    dropped_messages=shift.messages if shift else 0,
                    dropped_tokens=shift.tokens if shift else 0,
                ),
            )

    def _requeue(self, req: Req) -> None:
        """Back to the front of the queue, to be placed again (its worker died, or refused it)."""
        self._leave_worker(req)
        self.jobs.pop(req.job or "", None)
        self._enqueue(req, front=True)
        self.metrics.redispatched += 1
        log.info("request_requeued", request_id=req.rid, attempts=req.attempts, deaths=req.deaths)

    def _cancel(self, req: Req) -> None:
        """Stop a choice: one not running yet ends now (an empty `cancelled` choice), a running one is told to stop."""
        if req.state in (ReqState.QUEUED, ReqState.TOKENIZING):
            self._finish_empty(req, "cancelled")
        elif req.state is ReqState.RUNNING:
            req.state = ReqState.CANCELLING
            conn = self.table.get(req.worker)
            if conn is not None and req.job:
                self._to_worker(conn, JobCancel(id=req.job))

    def _finish(self, req: Req) -> None:
        """Forget a choice: out of the queue, the request table and the job tables; its worker's load drops."""
        self._leave_worker(req)
        req.state = ReqState.DONE
        self.requests.pop(req.key, None)
        self.queue.remove(req)
        if req.job:
            self.jobs.pop(req.job, None)

    def _leave_worker(self, req: Req) -> None:
        conn = self.table.get(req.worker)
        if conn is not None and req.job in conn.jobs:
            del conn.jobs[req.job]
            conn.refresh()

    def _fail(self, req: Req, refusal: Refusal) -> None:
        """End the request with an error: every choice of it (the others' jobs are cancelled), one reply."""
        if req.state is ReqState.DONE:
            return  # already ended (another choice of it failed first)
        reply_to = req.reply_to if all(r.reply_to is not None for r in req.choices) else None
        for r in req.choices:
            r.reply_to, r.ended = None, True  # nothing more is sent for any choice, nor counted
            if not self._on_worker(r):
                self._finish(r)
            elif r.state is ReqState.RUNNING:
                self._cancel(r)  # its job's end still updates the mirror, then finishes it
        self.metrics.requests[refusal.code] += 1
        log.info("request_failed", request_id=req.rid, job=req.job, code=refusal.code, message=refusal.message)
        if reply_to is not None:
            self.outbox.append(Out(reply_to, refusal.error(req.rid), tuple(req.envelope)))

    def _on_worker(self, req: Req) -> bool:
        """Whether the request's job is on a connected worker (its end is still to come)."""
        conn = self.table.get(req.worker)
        return conn is not None and req.job in conn.jobs

    def _finish_empty(self, req: Req, reason: str) -> None:
        """End a choice that produced nothing (cancelled before it ran)."""
        self._finish(req)
        if not req.ended:
            self.metrics.requests[reason] += 1
        waited = (time.monotonic() - req.arrived) * 1000
        req.choice = Choice(index=req.index, finish_reason=reason, text="", tokens=b"")
        req.usage = Usage(prompt_tokens=len(req.tokens), cached_tokens=0, completion_tokens=0)
        req.timings = Timings(queue_ms=waited, total_ms=waited)
        self._complete(req)

    def _complete(self, req: Req) -> None:
        """A choice ended: the result goes out once every choice of the request has ended."""
        choices = req.choices
        if any(r.choice is None for r in choices):
            return
        lead = choices[0]
        result = result_of(choices, lead.worker or "", lead.slot.index if lead.slot else -1)
        if lead.shift is not None:  # the client is told its prompt is not the one it sent
            result.dropped_messages, result.dropped_tokens = lead.shift.messages, lead.shift.tokens
        self._to_client(lead, result)

    # ---- client events ----------------------------------------------------------------------------

    def accept(self, identity: bytes, envelope: tuple[bytes, ...], msg: Submit) -> Req | None:
        """A submit arrived: the request, in flight from now on (its prompt is to be prepared and handed to
        `prepared`), or None when it is refused at once (draining, an id already in flight)."""
        rid = msg.id or f"r{next(self._rid)}-{uuid.uuid4().hex[:8]}"
        repeated = rid if (identity, rid, 0) in self.requests else None
        refusal = self._at_submit(repeated, msg.n, msg.owner)
        if refusal is None and msg.reply_to and msg.n == 1 and not envelope:
            in_use = {r.direct for r in self.requests.values() if r.client == identity and r.direct}
            problem = admission.reply_to_problem(msg.reply_to, in_use)
            refusal = None if problem is None else Refusal(ErrorCode.BAD_REQUEST, problem, param="reply_to")
        if refusal is not None:
            if refusal.code != ErrorCode.BAD_REQUEST:  # (a repeated id is the client's bug, not an answer to its load)
                self.metrics.requests[refusal.code] += 1
            self.reply(identity, envelope, refusal.error(rid))
            return None
        deadline = None if msg.deadline_ms is None else time.monotonic() + msg.deadline_ms / 1000.0
        sampling = admission.defaulted(msg.sampling, msg.sampling_unset, self.sampling.values)
        sampling = admission.capped(sampling, self.cfg.max_tokens)
        # REQ sockets take exactly one reply per request: no deltas for them
        req = Req(identity, list(envelope), rid, sampling, msg.stream and not envelope, deadline, msg.n)
        req.salt, req.owner, req.batch_deltas = tenant(msg.cache_salt), msg.owner or "", msg.batch_deltas
        if msg.reply_to and msg.n == 1 and not envelope:  # (n > 1: the choices' one result is made here)
            req.direct, req.direct_key = msg.reply_to, msg.reply_key or ""
        self.requests[req.key] = req
        return req

    def _at_submit(self, repeated: str | None, n: int, owner: str | None) -> Refusal | None:
        """admission.at_submit over the queue's figures: the requests waiting (queued, being prepared, and embed
        requests waiting for a worker), and of them the owner's."""
        waiting = len(self.queue) + sum(r.state is ReqState.TOKENIZING for r in self.requests.values())
        waiting += len(self.embeds.waiting)
        # (requests being prepared count as waiting, but as many of them as there are free slots will not queue: a
        # burst on an idle server fills its slots and its queue, not its queue alone)
        limit, free, owned, share = self.table.queue_limit(), self.table.free_slots(), 0, 0
        if owner and self.cfg.queue_share < 1:  # (its share of the queue and of the slots: waiting and running count)
            share = self.table.owner_share()
            owned = sum(r.owner == owner and r.state is not ReqState.DONE for r in self.requests.values())
            owned += self.embeds.owned(owner)
        return admission.at_submit(self.draining, repeated, waiting, n, limit + free, owned, share)

    def prepared(self, req: Req, outcome: Prepared | BaseException) -> None:
        """The request's prompt is ready (or could not be): refuse it with a reason, or queue its choices."""
        if req.state is not ReqState.TOKENIZING:
            return  # ended meanwhile (cancelled, client gone, router draining)
        if isinstance(outcome, BaseException):
            self._finish(req)
            self._to_client(req, admission.prepare_failed(req, outcome))
            return
        req.tokens, req.constraint, req.output = outcome.tokens, outcome.constraint, outcome.output
        req.prompt_text, req.prompt_bos = outcome.text, outcome.add_bos
        req.images = tuple(JobImage(start=i.start, n_tokens=i.n_tokens, data=i.data) for i in outcome.images)
        req.shift = outcome.shift
        if req.shift is not None:
            shift = req.shift
            log.info("context_shift", request_id=req.rid, dropped_messages=shift.messages, dropped_tokens=shift.tokens)
        refusal = admission.when_prepared(req, self.table, len(self.queue), self.cfg.no_workers_grace_s)
        if refusal is not None:
            self._finish(req)
            self.metrics.requests[refusal.code] += 1
            self._to_client(req, refusal.error(req.rid))
            return
        if req.n > 1:
            req.group = [req]
            req.group.extend(req.sibling(i) for i in range(1, req.n))
        for r in req.choices:
            self._enqueue(r)
            if self.cfg.policy == "round-robin":
                self.queue.pin(r)  # its worker is picked now, as it arrives
        log.info("request_queued", request_id=req.rid, prompt_tokens=len(req.tokens), n=req.n, queued=len(self.queue))
        self._pump()

    def embed(self, identity: bytes, envelope: tuple[bytes, ...], msg: Embed | Rerank, inputs: list[list[int]]) -> None:
        """An embed or rerank request, tokenized: admitted as a submit is (`_at_submit`: refused while draining, or
        when the queue or its owner's share of it is full), then to the ready worker with the least work
        (router/embeds.py); with none ready it waits as a queued request does (`_place_embeds`). Its deadline counts
        from now."""
        rid = msg.id or f"e{next(self._rid)}-{uuid.uuid4().hex[:8]}"
        refusal = self._at_submit(None, 1, msg.owner)
        if refusal is not None:
            self.metrics.requests[refusal.code] += 1
            self.reply(identity, envelope, refusal.error(rid))
            return
        pooling, normalize = ("rank", False) if isinstance(msg, Rerank) else (msg.pooling or "mean", msg.normalize)
        deadline = None if msg.deadline_ms is None else time.monotonic() + msg.deadline_ms / 1000.0
        wait = EmbedWait(identity, envelope, rid, inputs, pooling, normalize, msg.owner or "", deadline)
        self.embeds.waiting.append(wait)
        self._place_embeds()

    def _place_embeds(self) -> None:
        """The waiting embed and rerank requests to ready workers, in order; with none ready they fail when a queued
        request would: no worker will come (each failed at start), or none was connected for `no_workers_grace_s`."""
        while self.embeds.waiting and (conn := self.embeds.place(list(self.workers.values()))) is not None:
            w = self.embeds.waiting.popleft()
            job = self.embeds.start(conn, w)
            log.info("embed_placed", request_id=w.rid, job=job.id, worker=conn.id, inputs=len(w.inputs))
            self._to_worker(conn, job)
        if not self.embeds.waiting:
            return
        failed = self.none_can_come()
        if failed is not None:
            why = f"no worker can serve this request: {failed}"
        elif not self.workers and self.table.none_for(self.cfg.no_workers_grace_s):
            why = f"no worker connected for {self.cfg.no_workers_grace_s:g} s"
        else:
            return
        self._embed_replies(self.embeds.fail_waiting(ErrorCode.NO_WORKERS, why))

    def _embed_reply(self, answer: tuple[Any, Any] | None) -> None:
        if answer is not None and answer[0].client:
            req, msg = answer
            self.reply(req.client, req.envelope, msg)

    def _embed_replies(self, answers: list[tuple[Any, Any]]) -> None:
        for answer in answers:
            self._embed_reply(answer)

    def _stop_embeds(self, stopped: list[EmbedReq | EmbedWait], code: str | None, message: str) -> None:
        """Stopped embed requests (router/embeds.py `stop`): each answered with an error `code` (None: not at all, its
        client is gone), and a running one's job cancelled on its worker (its end, still to come, answers nobody)."""
        for r in stopped:
            log.info("embed_stopped", request_id=r.rid, code=code or "client_gone", running=isinstance(r, EmbedReq))
            if code is not None and r.client:
                self.reply(r.client, r.envelope, Error(id=r.rid, code=code, message=message))
            if isinstance(r, EmbedReq):
                r.client = b""
                conn = self.table.get(r.worker)
                if conn is not None:
                    self._to_worker(conn, JobCancel(id=r.job))

    def cancel(self, identity: bytes, rid: str) -> None:
        stopped = self.embeds.stop(lambda r: r.client == identity and r.rid == rid)
        self._stop_embeds(stopped, ErrorCode.CANCELLED, "the request was cancelled before its answer")
        lead = self.requests.get((identity, rid, 0))
        if lead is None:
            return
        for req in lead.choices:
            log.info("request_cancel", request_id=rid, choice=req.index, job=req.job, state=req.state.value)
            self._cancel(req)

    def crashed(self, req: Req, error_id: str) -> None:
        """Handling an event of this request raised (a bug, logged under `error_id`): it ends now with an `internal`
        error carrying its id and `error_id`, and frees what it held: its place in the queue, and for a choice on a
        worker its job (cancelled: its end, if it comes, is an unknown job's) and its slot, whose contents are then
        unknown (the mirror forgets them; the next job there starts from a cleared slot)."""
        for r in req.choices:
            conn = self.table.get(r.worker)
            if conn is not None and r.job in conn.jobs:
                self._to_worker(conn, JobCancel(id=r.job or ""))
                self._leave_worker(r)
                if r.attempt is not None and r.attempt.slot.job == r.job:
                    self.mirror.lost(r.attempt.slot)
                    conn.refresh()
            self.jobs.pop(r.job or "", None)
        lead = next((r for r in req.choices if r.state is not ReqState.DONE), None)
        if lead is not None:
            self._fail(lead, Refusal(ErrorCode.INTERNAL, "internal error", error_id=error_id))

    def client_gone(self, identity: bytes) -> None:
        """The client's connection is gone: its requests end, silently."""
        self._stop_embeds(self.embeds.stop(lambda r: r.client == identity), None, "")
        for req in [r for r in self.requests.values() if r.client == identity]:
            log.info("client_gone", request_id=req.rid, job=req.job)
            req.reply_to = None
            self._cancel(req)

    # ---- dispatch ---------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Dispatch the queued requests that have a slot now (router/dispatch_queue.py), and waiting embeds."""
        for req, d in self.queue.placements():
            self._dispatch(req, d)
        if self.embeds.waiting:
            self._place_embeds()

    # ---- worker events ----------------------------------------------------------------------------

    def hello(self, identity: bytes, msg: Hello) -> None:
        refusal = handshake.refusal(identity, msg, self.fingerprint, self.weights, self.model)
        if refusal is not None:
            if refusal.code == ErrorCode.MODEL_MISMATCH:
                log.warning("worker_refused", worker=msg.worker_id, code="model_mismatch", reason=refusal.reason)
            self.outbox.append(Out(identity, refusal, worker=True))
            return
        conn = self.table.repeated(msg)
        if conn is None:
            if msg.worker_id in self.workers:
                self.worker_dead(msg.worker_id, f"new incarnation {msg.incarnation}")
            conn = self.table.join(msg)
        features = ["job_deltas", "slot_notices"]
        self._to_worker(conn, Accept(worker_id=msg.worker_id, router_id=self.router_id, features=features))
        self._pump()

    def worker_message(self, identity: bytes, msg: WorkerReport) -> None:
        """A message from a worker that said hello; one that did not is told to."""
        conn = self.workers.get(identity.decode("utf-8", "replace"))
        if conn is None or (isinstance(msg, Heartbeat) and msg.incarnation != conn.hello.incarnation):
            reason = "this router does not know this worker; say hello"
            self.outbox.append(Out(identity, Refuse(code=ErrorCode.NOT_FOUND, reason=reason), worker=True))
            return
        conn.last_seen = time.monotonic()
        handler = self.WORKER_HANDLERS.get(type(msg))
        if handler is None:  # (a type the decoder knows and this table does not: say so, never guess)
            self.metrics.unknown_messages += 1
            log.warning("unknown_worker_message", worker=conn.id, kind=kind_of(msg))
            return
        getattr(self, handler)(conn, msg)

    # each message a worker sends after its hello, and the name of its handler (a method, looked up at each call)
    WORKER_HANDLERS: ClassVar[dict[type, str]] = {
        Heartbeat: "_heartbeat",
        JobDelta: "_job_delta",
        JobDeltas: "_job_deltas",
        JobDone: "_job_done",
        JobError: "_job_error",
        EmbedDone: "_embed_done",
        SlotTaken: "_slot_taken",  # (another router's job: routers side by side over one fleet)
        SlotUpdate: "_slot_update",
    }

    def _heartbeat(self, conn: WorkerConn, msg: Heartbeat) -> None:
        self.table.heartbeat(conn, msg)

    def _embed_done(self, conn: WorkerConn, msg: EmbedDone) -> None:
        self._embed_reply(self.embeds.done(msg))

    def _slot_taken(self, conn: WorkerConn, msg: SlotTaken) -> None:
        self.table.slot_taken(conn, msg)

    def _job_deltas(self, conn: WorkerConn, msg: JobDeltas) -> None:
        for delta in msg.items:  # one engine step's deltas
            self._job_delta(conn, delta)

    def _slot_update(self, conn: WorkerConn, msg: SlotUpdate) -> None:
        self.table.slot_update(conn, msg)
        self._pump()

    def _job_delta(self, conn: WorkerConn, msg: JobDelta) -> None:
        req = conn.jobs.get(msg.id)
        if req is None or req.attempt is None:
            return
        if req.direct:  # (its worker sends the router only the job's first delta, without text: output has begun)
            outcomes.output_began(conn, req)
            return
        piece = outcomes.delta_taken(conn, req, msg)
        if req.stream and req.reply_to is not None:
            delta = delta_of(req, piece, msg.tokens, msg.logprobs)
            if msg.reused_tokens is not None:  # the job's first token: what the prompt cost is known now
                delta.usage = Usage(prompt_tokens=len(req.tokens), cached_tokens=msg.reused_tokens, completion_tokens=0)
            req.attempt.delivered += 1
            self._to_client(req, delta)

    def _job_done(self, conn: WorkerConn, msg: JobDone) -> None:
        self.table.cache_changed(conn, msg)
        req = conn.jobs.get(msg.id)
        if req is None or req.attempt is None:
            log.warning("unknown_job_done", worker=conn.id, job=msg.id)
            return
        self._leave_worker(req)
        attempt = req.attempt
        timings = outcomes.settle_done(self.mirror, self.metrics, self.params.min_match, conn, req, msg)
        if req.prompt_text:  # the next turn's prompt may hold this reply: its tokens as the model wrote them
            self.remember_reply(req.prompt_text, req.prompt_bos, req.tokens, token_array(msg.tokens), req.salt)
        self._finish(req)
        if req.direct:  # its client has the job's output and end from the worker, and makes the result
            self._pump()
            return
        tail = attempt.parser.finish()
        if req.stream and (tail.content or tail.reasoning or tail.calls):
            self._to_client(req, delta_of(req, tail, b"", []))
        req.choice = choice_of(req, msg)
        req.usage = Usage(
            prompt_tokens=msg.prompt_tokens,
            cached_tokens=msg.reused_tokens,
            completion_tokens=msg.generated_tokens,
            reasoning_tokens=attempt.parser.reasoning_tokens,
        )
        req.timings = timings
        self._complete(req)
        self._pump()

    def _job_error(self, conn: WorkerConn, msg: JobError) -> None:
        self.table.cache_changed(conn, msg)
        if msg.id in self.embeds.running:
            self._embed_reply(self.embeds.failed(msg.id, msg.code, msg.message, msg.error_id))
            return
        req = conn.jobs.get(msg.id)
        if req is None or req.attempt is None:
            return
        self._leave_worker(req)
        slot = req.attempt.slot
        if req.direct:
            req.attempt.streamed = unpack_tokens(msg.tokens)
        outcomes.settle_slot(self.mirror, self.metrics, req, msg)
        conn.refresh()
        if msg.code == ErrorCode.DRAINING and req.state is ReqState.RUNNING and not req.started:
            conn.state = WorkerState.DRAINING
            self._requeue(req)
        elif msg.code == ErrorCode.SLOT_BUSY and req.state is ReqState.RUNNING and not req.started:
            self.mirror.refused(slot)  # another router's job holds it: placed again, elsewhere or after it
            conn.refresh()
            self.metrics.slot_conflicts += 1
            log.info("slot_conflict", request_id=req.rid, worker=conn.id, slot=slot.index)
            self._requeue(req)
        elif req.state is ReqState.CANCELLING:
            self._finish_empty(req, "cancelled")
        else:
            self._fail(req, Refusal(msg.code, msg.message, overflow=msg.overflow, error_id=msg.error_id))
        self._pump()

    def worker_dead(self, worker: str, reason: str) -> None:
        """A worker is gone: purge its slots now, re-dispatch what it had not streamed, fail the rest."""
        conn = self.table.remove(worker, reason)
        if conn is None:
            return
        for answer in self.embeds.lost(worker, reason):
            self._to_worker(conn, JobCancel(id=answer[0].job))  # in case it is only slow
            self._embed_reply(answer)
        for req in list(conn.jobs.values()):
            self._to_worker(conn, JobCancel(id=req.job or ""))  # in case it is only slow
            del conn.jobs[req.job or ""]
            req.deaths += 1
            if req.state is ReqState.CANCELLING:
                self._finish_empty(req, "cancelled")
            elif req.started:
                self._fail(req, Refusal(ErrorCode.WORKER_LOST, f"worker {worker} died ({reason}) while streaming this request"))
            elif req.deaths >= self.cfg.max_worker_deaths:
                log.warning("poison_request", request_id=req.rid, deaths=req.deaths)
                self._fail(
                    req,
                    Refusal(
                        ErrorCode.WORKER_LOST,
                        f"{req.deaths} workers died while running this request (the last: {worker}, {reason}); it is"
                        f" not sent to another (--max-worker-deaths {self.cfg.max_worker_deaths})",
                    ),
                )
            else:
                self._requeue(req)
        self._pump()

    def worker_failed(self, worker: str, reason: str) -> None:
        self.failed[worker] = reason
        self._fail_hopeless()
        if self.embeds.waiting:
            self._place_embeds()

    def _fail_hopeless(self) -> bool:
        """Queued requests fail at once, with the reason, when no worker will come to serve them."""
        failed = self.none_can_come() if self.queue else None
        if failed is None:
            return False
        for req in list(self.queue):
            self._fail(req, Refusal(ErrorCode.NO_WORKERS, f"no worker can serve this request: {failed}"))
        return True

    def none_can_come(self) -> str | None:
        return self.table.none_can_come()

    def worker_exited(self, worker: str, incarnation: int, returncode: int | None) -> None:
        """From the supervisor: the process of this worker incarnation exited."""
        conn = self.workers.get(worker)
        if conn is not None and conn.hello.incarnation == incarnation:
            self.worker_dead(worker, f"process exited with status {returncode}")

    # ---- time -------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        for worker, reason in self.table.overdue(now):
            self.worker_dead(worker, reason)
        for req in list(self.requests.values()):
            if req.deadline is None or now < req.deadline or req.state is ReqState.DONE or req.ended:
                continue
            if req.state is ReqState.QUEUED:
                self._fail(req, Refusal(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was queued"))
            elif req.state is ReqState.RUNNING and now >= req.deadline + DEADLINE_GRACE_S:
                self._fail(req, Refusal(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while the request was running"))
        late = self.embeds.stop(lambda r: r.deadline is not None and now >= r.deadline)
        self._stop_embeds(late, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the answer was computed")
        self._unfit(now)
        if not self._fail_hopeless() and self.queue and not self.workers and self.table.none_for(self.cfg.no_workers_grace_s):
            for req in list(self.queue):
                self._fail(req, Refusal(ErrorCode.NO_WORKERS, f"no worker connected for {self.cfg.no_workers_grace_s:g} s"))
        if any(r.wait_since is not None for r in self.queue):
            self._pump()
        if self.embeds.waiting:
            self._place_embeds()

    def _unfit(self, now: float) -> None:
        """Queued requests that no ready worker can hold (the one that could left) wait `no_workers_grace_s` for
        one to come back, then get `context_overflow`."""
        ready = self.table.ready()
        if not ready:
            return
        for req in list(self.queue):
            if any(w.fits(req) for w in ready):
                req.unfit_since = None
            elif req.unfit_since is None:
                req.unfit_since = now
            elif now - req.unfit_since >= self.cfg.no_workers_grace_s:
                self._fail(req, admission.overflow_refusal(req, max(w.hello.ctx_per_slot for w in ready)))

    def take_kills(self) -> list[Kill]:
        return self.table.take_kills()

    def slot_context(self) -> int | None:
        return self.table.slot_context()

    def queue_limit(self) -> int:
        return self.table.queue_limit()

    def drain_expired(self) -> None:
        """The drain's time is up: every request still open ends with `draining` (its job cancelled)."""
        for req in list(self.requests.values()):
            if req.state is ReqState.DONE or req.ended:
                continue
            if req.state is ReqState.CANCELLING:
                self._finish_empty(req, "cancelled")  # what a cancelled request gets, a little early
            else:  # (a running choice's job is cancelled)
                self._fail(req, Refusal(ErrorCode.DRAINING, "the router stopped before this request finished (drain timeout)"))
        for job in list(self.embeds.running):
            self._embed_reply(self.embeds.failed(job, ErrorCode.DRAINING, "the router stopped before these embeddings", None))
        self._embed_replies(self.embeds.fail_waiting(ErrorCode.DRAINING, "the router stopped before these embeddings"))

    # ---- views ------------------------------------------------------------------------------------

    def status(self, rid: str | None, cache_salt: str | None = None) -> StatusReply:
        """Every worker and slot; a slot holding another tenant's prompt than the asker's (`cache_salt`) shows only
        whether it is busy."""
        workers = views.worker_statuses(self.workers.values(), self.jobs, self.restarts, tenant(cache_salt))
        failed = [FailedWorker(worker=w, reason=r) for w, r in sorted(self.failed.items())]
        return StatusReply(
            id=rid, model=self.model, policy=self.cfg.policy, queued=len(self.queue), workers=workers, failed=failed
        )

    def status_line(self) -> str:
        """One line for systemd's STATUS=: workers, busy slots, queue, requests served."""
        in_flight = len(self.requests) if self.draining else None
        return views.status_line(self.workers.values(), self.metrics.requests, len(self.queue), in_flight)
