"""The router's core without a socket: the life cycle of its requests, over the worker table (router/workers.py),
the queue and its placements (router/dispatch_queue.py) and the mirror (router/mirror.py). A client's events and time
are here; a worker's in router/worker_events.py; the records and transitions both drive in router/lifecycle.py.

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

import time
import uuid

from common import logs
from protocol import (
    Embed,
    ErrorCode,
    FailedWorker,
    JobCancel,
    JobImage,
    Refusal,
    Rerank,
    StatusReply,
    Submit,
)
from router import admission, views
from router.embeds import EmbedWait
from router.lifecycle import Out  # noqa: F401 (read from here by the shell and the tests)
from router.mirror import conversation_of
from router.prepare import Prepared
from router.requests import Req, ReqState, tenant
from router.worker_events import WorkerEvents
from router.workers import Kill

log = logs.get(__name__)

DEADLINE_GRACE_S = 1.0  # a worker ends a job at its deadline itself; the router steps in this much later


class Scheduler(WorkerEvents):
    """The router's state and the life cycle of its requests: a client's events and time here, a worker's in
    router/worker_events.py, the transitions and records they share in router/lifecycle.py. Owned by one thread
    (the shell's event loop)."""

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
        req.session, req.parent_session, req.priority = msg.session, msg.parent_session, msg.priority
        self.metrics.priorities[msg.priority] += 1
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
        req.conv = conversation_of(req.session, req.tokens)
        if req.conv is not None:  # (the pause since its tool calls is learned; a sub-agent's parent is known)
            req.parent_session = self.sessions.arrived(req.conv, req.parent_session, req.arrived).parent
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
            self.refuse(identity, envelope, rid, refusal)
            return
        pooling, normalize = ("rank", False) if isinstance(msg, Rerank) else (msg.pooling or "mean", msg.normalize)
        deadline = None if msg.deadline_ms is None else time.monotonic() + msg.deadline_ms / 1000.0
        wait = EmbedWait(identity, envelope, rid, inputs, pooling, normalize, msg.owner or "", deadline)
        self.embeds.waiting.append(wait)
        self._place_embeds()

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
        for copy in self.copies.expired(now):
            self._copy_came(copy, None, "late")
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
