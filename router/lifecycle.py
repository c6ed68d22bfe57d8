"""A request's records and the transitions of its life cycle (router/scheduler.py lists them: enqueue, dispatch,
requeue, cancel, finish, fail), over the worker table (router/workers.py), the queue and its placements
(router/dispatch_queue.py) and the mirror (router/mirror.py); and what each sends, appended to `outbox` (`Out`
records) for the I/O shell (router/server.py) to send after the event. Embed and rerank requests are placed and
answered here too (router/embeds.py).

The events that drive these transitions are router/worker_events.py's (a worker's messages, its death) and
router/scheduler.py's (a client's, time).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from common import logs
from common.slots import worth_copy
from protocol import (
    Choice,
    Delta,
    Error,
    ErrorCode,
    JobCancel,
    Placed,
    Refusal,
    StateBlob,
    StateFetch,
    Timings,
    Usage,
)
from router import admission, sampling_defaults
from router.client_replies import result_of
from router.config import RouterConfig
from router.dispatch_queue import DispatchQueue, job_message
from router.embeds import EmbedReq, Embeds, EmbedWait
from router.metrics import Metrics
from router.mirror import Mirror, Sessions
from router.requests import Attempt, Req, ReqState, WorkerConn
from router.select import Dispatch
from router.state_copies import PendingCopy, StateCopies
from router.workers import WorkerTable

log = logs.get(__name__)


@dataclass(frozen=True)
class Out:
    """A message to send: to a client (with its envelope) or, with `worker`, to a worker."""

    to: bytes  # ZMQ identity
    msg: Any
    envelope: tuple[bytes, ...] = ()
    worker: bool = False
    batch: bool = False  # a Delta its client takes inside a `deltas` message with others (Submit.batch_deltas)


class Lifecycle:
    """The router's records of one model's requests and workers, and the transitions between a request's states.
    Owned by one thread (the shell's event loop)."""

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
        self.sessions = Sessions(cfg.tool_wait_s, self.metrics.retention)  # conversations awaiting their slots
        self.table = WorkerTable(cfg, self.mirror, self.metrics)
        self.workers = self.table.workers  # by id (the same dict: the views, the shell and the tests read it)
        self.restarts, self.expected, self.failed = self.table.restarts, self.table.expected, self.table.failed
        self.queue = DispatchQueue(cfg, self.mirror, self.metrics, self.table)
        self.params = self.queue.params
        self.requests: dict[tuple[bytes, str, int], Req] = {}  # by (client, request id, choice)
        self.jobs: dict[str, Req] = {}
        self.embeds = Embeds(router_id)
        self.copies = StateCopies()  # jobs waiting for a state copied from another worker
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
        if isinstance(msg, JobCancel) and self.copies.holds(msg.id):
            self.copies.defer(msg.id, msg)  # (after its job, which waits for a state copied from another worker)
            return
        self.outbox.append(Out(conn.identity, msg, worker=True))

    def reply(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any) -> None:
        self.outbox.append(Out(identity, msg, envelope))

    def refuse(self, identity: bytes, envelope: tuple[bytes, ...], rid: str | None, refusal: Refusal) -> None:
        """Refuse a client's request that is not in flight: counted by its code, answered with its error."""
        self.metrics.requests[refusal.code] += 1
        self.reply(identity, envelope, refusal.error(rid))

    # ---- transitions ------------------------------------------------------------------------------

    def _enqueue(self, req: Req, front: bool = False) -> None:
        req.state, req.attempt = ReqState.QUEUED, None
        req.queued_at, req.wait_since = time.monotonic(), None
        self.requests[req.key] = req
        self.queue.push(req, front)

    def _dispatch(self, req: Req, d: Dispatch) -> None:
        conn = self.workers[d.slot.worker]
        slot, tokens, resumed = d.slot, req.place_tokens, req.suspended
        # (a suspended job goes on under its own id, on the worker that holds it)
        job = resumed.job if resumed is not None else f"{req.rid[:100]}.{self.router_id[:8]}.{next(self._job_ids)}"
        prefix_cache = self.cfg.prefix_cache and not slot.dirty
        now = time.monotonic()
        awaited = self.sessions.placed(req.conv if req.index == 0 else None, slot, now)
        self.mirror.assign(slot, job, tokens, req.salt, req.session)
        self.queue.remove(req)
        if resumed is None:  # (a suspended job's wait is not queueing: its output had begun; its total time has it)
            req.queue_ms += (now - req.queued_at) * 1000
            self.metrics.queue_wait_ms.observe((now - req.queued_at) * 1000)
        req.state, req.attempts = ReqState.RUNNING, req.attempts + 1
        req.attempt = Attempt(job, conn.id, slot, d.reuse, len(tokens) - d.reuse, req.output.parser())
        if resumed is not None:  # (its reply so far goes on: what was streamed and parsed)
            req.attempt.parser, req.attempt.streamed = resumed.parser, resumed.streamed
            req.attempt.logprobs, req.attempt.delivered = resumed.logprobs, resumed.delivered
            req.attempt.resumed = len(tokens) - len(req.tokens)
            self.metrics.preemptions["resumed"] += 1
        if not conn.jobs:
            conn.progress_at = now  # progress is expected from now on
        self.jobs[job] = req
        conn.jobs[job] = req
        conn.refresh()
        kind = "guarded" if d.guarded else "restore" if d.restore else "affinity" if d.affinity else "cold"
        self.metrics.decisions[kind] += 1
        sampling = admission.open_capped(req.sampling, self.cfg.default_max_tokens, conn.hello.ctx_per_slot - len(req.tokens))
        message = job_message(req, d, job, prefix_cache, now, sampling, awaited=",".join(awaited))
        req.suspended = None
        source = self.workers.get(d.copy_from.worker) if d.copy_from is not None else None
        if d.copy_from is not None and source is not None:  # the job goes once the state's copy has come
            self.copies.wait(PendingCopy(message, conn.id, source.id, d.without_copy, now))
            seeded = req.sampling.seed is not None
            fetch = StateFetch(id=job, entry=d.copy_from.key[1], tokens=message.tokens, salt=req.salt, seeded=seeded)
            self._to_worker(source, fetch)
        else:
            if d.copy_from is not None:
                self._reuse_is(req, d.without_copy)
            self._to_worker(conn, message)
        # the client reads the job's output from the worker: it learns where, and how to read it (a resumed job's client
        # reads on: the same job, on the same worker)
        if req.direct and resumed is None:
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

    def _copy_came(self, copy: PendingCopy, state: StateBlob | None, outcome: str, gives: int = 0) -> None:
        """A job that waited for a state copied from another worker goes to its worker: with the state, or (gone, late)
        without it. Not when the job is no longer its request's (its worker died: placed again). What it reuses is
        predicted again from what the state sent gives (`gives`: the saving worker may have sent a longer one, that
        superseded the one the mirror knew), by the rule its worker restores with."""
        conn, req = self.workers.get(copy.worker), self.jobs.get(copy.job.id)
        if conn is None or req is None or req.worker != copy.worker:
            self.metrics.state_copies["dropped"] += 1
            return
        self.metrics.state_copies[outcome] += 1
        if state is None:
            self._reuse_is(req, copy.without_copy)
            log.info("state_copy_missed", request_id=req.rid, job=copy.job.id, source=copy.source, outcome=outcome)
            self._to_worker(conn, msgspec.structs.replace(copy.job, predicted_reuse=copy.without_copy))
        else:
            self.metrics.state_copy_bytes += len(state.data) + sum(len(c.data) for c in state.checkpoints)
            n = len(state.tokens) // 4
            reuse = gives if gives > copy.without_copy and worth_copy(gives - copy.without_copy, n) else copy.without_copy
            self._reuse_is(req, reuse)  # (what it gives: usually what its placing counted on)
            self._to_worker(conn, msgspec.structs.replace(copy.job, state=state, predicted_reuse=reuse))
        for msg in copy.later:
            self._to_worker(conn, msg)

    def _reuse_is(self, req: Req, reuse: int) -> None:
        """What the request reuses is not what its placing counted on (its copy did not come, or gives another length)."""
        attempt = req.attempt
        assert attempt is not None
        attempt.predicted, attempt.prefill_pending = reuse, len(req.tokens) - reuse
        conn = self.workers.get(attempt.worker)
        if conn is not None:
            conn.refresh()

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
        if (suspended := req.suspended) is not None:  # (its job, waiting on its worker to go on, ends there too)
            req.suspended = None
            self.jobs.pop(suspended.job, None)
            conn = self.table.get(suspended.worker)
            if conn is not None:
                self._to_worker(conn, JobCancel(id=suspended.job))

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

    # ---- dispatch ---------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Dispatch the queued requests that have a slot now (router/dispatch_queue.py), and waiting embeds."""
        for req, d in self.queue.placements():
            self._dispatch(req, d)
        if self.cfg.preempt and len(self.queue):
            self._preempt()
        if self.embeds.waiting:
            self._place_embeds()

    def _preempt(self) -> None:
        """Priority's last step: the first waiting request of the highest priority, when no worker it may go to has an
        idle slot, has a running job of a lower priority handed back (JobCancel.preempt): one that has not begun its
        output is ended before its first token, its slot keeping what it computed (a client reading its output from
        the worker is told where it goes: `Placed` again); one that has is suspended where its worker can resume it
        exactly (`suspendable`), its slot keeping its prompt and output, and goes on later on that worker, from that
        slot or what its worker saved of it in host RAM (`Job.resume`), its stream paused meanwhile. Either way the
        job's request goes back to the queue, behind it, and is placed again, reusing what it computed; a job that
        has not begun its output is taken first, then the one with the most prompt left. One at a time; a request
        takes one slot so and loses one at most, so nothing churns. Not for a request whose owner holds its share of
        the slots while another owner's request waits (--queue-share)."""
        top = max(self.queue, key=lambda r: r.priority)  # (the first of the highest: the queue is oldest first)
        if top.priority <= -1 or top.took_slot or any(r.preempting for r in self.jobs.values()):
            return
        shares = self.queue.running_shares()
        if shares is not None and shares.over(top.owner):
            return  # (its owner holds its share of the slots while another's request waits: it is not placed now)
        conns = self.table.loads_for(top)
        if not conns or any(c.load.busy < len(c.slots) for c in conns):
            return  # (no worker to take from, or an idle slot it is placed on, or waits beside by choice)
        pending = {r: r.attempt.prefill_pending for c in conns for r in c.jobs.values() if r.attempt is not None}
        victims = [
            r for r, left in pending.items()
            if r.state is ReqState.RUNNING and r.priority < top.priority and not r.preempted and r.n == 1
            and (left > 0 or self._suspendable(r))
        ]  # fmt: skip
        if not victims:
            return
        victim = max(victims, key=lambda r: pending[r])  # (the one with the most prompt left to compute)
        conn = self.table.get(victim.worker)
        if conn is None or victim.job is None:
            return
        victim.preempting, top.took_slot = True, True
        self.metrics.preemptions["asked"] += 1
        log.info("preempt", request_id=victim.rid, job=victim.job, worker=conn.id, priority=victim.priority,
                 for_request=top.rid, for_priority=top.priority)  # fmt: skip
        self._to_worker(conn, JobCancel(id=victim.job, preempt=True))

    def _suspendable(self, req: Req) -> bool:
        """Whether a job that has begun its output can be suspended and resumed exactly (worker/admission.py
        `suspendable`): not a seeded one, none with images, and not on a worker in deterministic mode (a client reading
        its output from the worker reads on: the job keeps its id and its worker)."""
        conn = self.table.get(req.worker)
        deterministic = conn is None or conn.hello.deterministic
        return req.sampling.seed is None and not req.images and not deterministic

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

    def none_can_come(self) -> str | None:
        return self.table.none_can_come()
