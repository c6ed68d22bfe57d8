"""A worker's events in the router's core: its hello, each message it sends after (heartbeats, a job's deltas, its
end or error, slot and cache reports), its death, its failure to start, its process's exit. Each moves the requests
it concerns through their transitions (router/lifecycle.py).

Failure rules: router/scheduler.py's docstring.
"""

from __future__ import annotations

import time
from typing import ClassVar

from common import logs
from protocol import (
    Accept,
    EmbedDone,
    ErrorCode,
    Heartbeat,
    Hello,
    JobCancel,
    JobDelta,
    JobDeltas,
    JobDone,
    JobError,
    Refusal,
    Refuse,
    SlotTaken,
    SlotUpdate,
    StateCopy,
    Usage,
    kind_of,
    token_array,
    unpack_tokens,
)
from router import handshake, outcomes
from router.client_replies import choice_of, delta_of
from router.lifecycle import Lifecycle, Out
from router.requests import Req, ReqState, WorkerConn, WorkerState

WorkerReport = Heartbeat | JobDelta | JobDeltas | JobDone | JobError | SlotTaken | SlotUpdate | EmbedDone | StateCopy

log = logs.get(__name__)


class WorkerEvents(Lifecycle):
    """What a worker's messages and its end do to the requests and records of its model's core."""

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
        StateCopy: "_state_copy",
    }

    def _state_copy(self, conn: WorkerConn, msg: StateCopy) -> None:
        copy = self.copies.arrived(msg.id, conn.id)
        if copy is not None:
            self._copy_came(copy, msg.state, "copied" if msg.state is not None else "gone", msg.gives)

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
        if req.preempting and not self._suspendable(req):
            req.preempting = False  # (its output began and it cannot be suspended: a preemption comes too late, it runs on)
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
            if req.conv is not None and req.index == 0:  # (a session's: its reply read here too, for its tool calls)
                attempt.parser.feed(msg.text, msg.generated_tokens)
                attempt.parser.finish()
                calls = choice_of(req, msg).finish_reason == "tool_calls"
                self.sessions.ended(req.conv, attempt.slot, calls, time.monotonic())
            self._pump()
            return
        tail = attempt.parser.finish()
        if req.stream and (tail.content or tail.reasoning or tail.calls):
            self._to_client(req, delta_of(req, tail, b"", []))
        req.choice = choice_of(req, msg)
        if req.conv is not None and req.index == 0:  # (a session's tool calls: its slot awaits its next turn)
            self.sessions.ended(req.conv, attempt.slot, req.choice.finish_reason == "tool_calls", time.monotonic())
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
        if req is None and (waiting := self.jobs.get(msg.id)) is not None and waiting.suspended is not None:
            self._suspended_lost(waiting, msg)  # (a suspended job ended on its worker: draining, its deadline)
            return
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
        elif msg.code == ErrorCode.PREEMPTED and msg.suspended and req.state is ReqState.RUNNING:
            self._suspend(req, conn, msg)
        elif msg.code == ErrorCode.PREEMPTED and req.state is ReqState.RUNNING and not req.started:
            req.preempting, req.preempted = False, req.preempted + 1  # (its slot keeps what it computed: reused)
            self.metrics.preemptions["handed"] += 1
            self.jobs.pop(req.job or "", None)
            self._enqueue(req, front=True)
            log.info("request_preempted", request_id=req.rid, worker=conn.id, slot=slot.index, kept=msg.slot_tokens)
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

    def _suspend(self, req: Req, conn: WorkerConn, msg: JobError) -> None:
        """Its job was suspended after its output began (a job of higher priority has its slot): back to the queue, at
        the front, to go on on the same worker (router/dispatch_queue.py), its output so far kept in its attempt."""
        attempt = req.attempt
        assert attempt is not None
        req.preempting, req.preempted = False, req.preempted + 1
        if unpack_tokens(msg.tokens) != attempt.streamed:  # (what the worker holds is not what the client has: a bug)
            self.metrics.mirror_mismatches += 1
            log.error("suspended_output_mismatch", request_id=req.rid, job=msg.id, worker=conn.id,
                      streamed=len(attempt.streamed), held=len(msg.tokens) // 4)  # fmt: skip
            req.suspended = attempt  # (so that its job is cancelled there)
            self._fail(req, Refusal(ErrorCode.INTERNAL, "the worker's record of this request's output is not the router's"))
            return
        self.metrics.preemptions["suspended"] += 1
        req.suspended = attempt
        self._enqueue(req, front=True)
        log.info("request_suspended", request_id=req.rid, job=msg.id, worker=conn.id, slot=attempt.slot.index,
                 generated=len(attempt.streamed), kept=msg.slot_tokens)  # fmt: skip

    def _suspended_lost(self, req: Req, msg: JobError) -> None:
        """A suspended job ended on its worker before it was resumed (the worker drains, or its deadline passed): its
        request fails, or ends as cancelled when the client cancelled it; one whose client has seen none of its output
        (not streamed) waits on to be placed anew, on any worker, when its worker drains."""
        started = self._let_go_suspended(req, msg.id)
        if msg.code == ErrorCode.DRAINING and not started:
            log.info("request_suspended_lost", request_id=req.rid, job=msg.id, placed_anew=True)
        elif msg.code == ErrorCode.CANCELLED:
            self._finish_empty(req, "cancelled")
        else:
            self._fail(req, Refusal(msg.code, f"{msg.message} (its job was suspended for one of higher priority)"))
        self._pump()

    def _let_go_suspended(self, req: Req, job: str) -> bool:
        """Forget a suspended request's job (it ended on its worker, or its worker died): whether its client has seen
        any of its output (then it goes nowhere else; else it waits on in the queue to be placed anew)."""
        started, req.suspended = req.started, None
        self.jobs.pop(job, None)
        return started

    def worker_dead(self, worker: str, reason: str) -> None:
        """A worker is gone: purge its slots now, re-dispatch what it had not streamed, fail the rest."""
        conn = self.table.remove(worker, reason)
        if conn is None:
            return
        for answer in self.embeds.lost(worker, reason):
            self._to_worker(conn, JobCancel(id=answer[0].job))  # in case it is only slow
            self._embed_reply(answer)
        for req in list(self.queue):
            if (held := req.suspended) is None or held.worker != worker:
                continue
            if self._let_go_suspended(req, held.job):  # (its job died with the worker; a request not started waits on)
                lost = f"worker {worker} died ({reason}) while this request's job was suspended there"
                self._fail(req, Refusal(ErrorCode.WORKER_LOST, lost))
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

    def worker_exited(self, worker: str, incarnation: int, returncode: int | None) -> None:
        """From the supervisor: the process of this worker incarnation exited."""
        conn = self.workers.get(worker)
        if conn is not None and conn.hello.incarnation == incarnation:
            self.worker_dead(worker, f"process exited with status {returncode}")
