"""`kvroute worker`, the process and its sockets: it speaks the router<->worker contract (protocol/) and hands each job
to the engine's thread (worker/engine.py), which runs the compute core (worker/core.py).

The I/O thread (this module's loop) owns the sockets: a DEALER per router (worker/links.py), those to the clients that
read their output themselves (worker/direct_replies.py); the compute thread owns the llama context. What the compute
thread sends reaches the I/O thread through an inproc PUSH/PULL pair, one PUSH per producing thread (worker/outbox.py).

Signals: SIGTERM/SIGINT drain the worker: it takes no new job (JobError `draining`, which the router
re-dispatches), tells the router at once (a Heartbeat with draining=True: no more jobs are routed here),
hands back the jobs still waiting for a slot, lets running jobs finish for up to --drain-timeout-s, hands
back whatever still runs then, writes every slot's state and host-RAM entry to the disk tier (--cache-dir; up to
PERSIST_S), and exits 0. SIGHUP changes nothing and is logged.

systemd: READY=1 once the model is loaded and the router accepted this worker; a STATUS= line (busy
slots, queue, jobs done) with every heartbeat; STOPPING=1 when draining starts.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import zmq

from common import logs
from common.config import UsageError, add_args, from_args
from common.model import ModelError, resolve_model
from common.notify import alive, notify, watchdog_interval_s
from common.socket_security import secure_client_socket
from common.start_record import START_FAILED_EXIT, StartRecord, default_path
from protocol import (
    Accept,
    Drain,
    EmbedJob,
    ErrorCode,
    Invalid,
    Job,
    JobCancel,
    JobError,
    JobStart,
    Message,
    Refusal,
    Refuse,
    SlotTaken,
    StateCopy,
    StateFetch,
    encode,
    kind_of,
    router_to_worker_decoder,
)
from worker import state_copies
from worker.config import WorkerConfig
from worker.core import EngineCore
from worker.direct_replies import ReplySockets
from worker.engine import Engine
from worker.faults import Faults
from worker.links import LINGER_MS, RouterLink, SlotClaims
from worker.outbox import Outbox
from worker.reports import Reports
from worker.startcheck import first_decode, identity

log = logs.get(__name__)

BEAT_S = 1.0
POLL_S = 0.1
EXIT_REFUSED = 3
PERSIST_S = 30.0  # on a graceful stop, the disk tier's writes get this long


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    logs.setup(process=f"worker-{args.worker_id}")
    try:
        cfg = from_args(WorkerConfig, args)
        Faults.from_env()  # a malformed KVROUTE_FAULTS stops start-up with one line, before the model loads
        probe: zmq.Socket[bytes]
        with zmq.Context.instance().socket(zmq.DEALER) as probe:  # unreadable keys stop start-up before the model loads
            secure_client_socket(probe, cfg.curve_key, cfg.router_key)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    stop = threading.Event()  # set before the model is loaded too: then the worker exits once loaded
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: log.info("sighup", action="none", reason="settings are read at start"))
    engine = checked_engine(cfg)
    if engine is None:
        return START_FAILED_EXIT
    server = WorkerServer(cfg, engine)
    try:
        t0 = time.monotonic()
        while not engine.guide_tokenizer.wait(0.1):  # its build stalls the whole process for a second: not while serving
            if stop.is_set():
                return 0
        log.info("guide_tokenizer_ready", seconds=round(time.monotonic() - t0, 2))
        return server.serve(stop)
    finally:
        engine.stop()
        server.zctx.destroy(linger=LINGER_MS)  # (the links and reply sockets close with theirs)


def checked_engine(cfg: WorkerConfig) -> Engine | None:
    """Load the model and decode a few tokens before saying hello (worker/startcheck.py); None: this worker crashed
    at start too often with this build and model, and says so instead of trying again."""
    missing: ModelError | None = None
    try:
        model = resolve_model(cfg.model)
    except ModelError as exc:
        model, missing = Path(cfg.model or ""), exc
    path = Path(cfg.start_record) if cfg.start_record else default_path(cfg.worker_id)
    record = StartRecord(path, identity(str(model)), "this CPU" if cfg.gpu is None else f"GPU {cfg.gpu}")
    if missing is not None:
        refused(record, cfg, str(missing))
        return None
    count, reason = record.crashes()
    if count and (frames := record.fault_frames()):
        log.error("previous_start_crashed", reason=reason, python_stack=frames)
    refusal = record.refusal()
    if refusal is not None:
        log.error("worker_start_refused", reason=refusal, start_record=str(record.path))
        print(f"kvroute worker {cfg.worker_id}: {refusal} (start record: {record.path})", file=sys.stderr)
        return None
    try:
        with record.stage("load"):
            engine = Engine(cfg)
    except ModelError as exc:  # a file llama.cpp cannot load, or no memory for it: starting again changes nothing
        refused(record, cfg, str(exc))
        return None
    t0 = time.monotonic()
    with record.stage("first_decode"):
        Faults.from_env().at_start("first-decode", cfg.worker_id)
        # on the compute thread, as every decode after it (worker/llama.py `decode` says why)
        engine.start().call(lambda core: first_decode(core.llama)).result()
    record.passed()
    log.info("first_decode_ok", ms=round((time.monotonic() - t0) * 1000, 1))
    return engine


def refused(record: StartRecord, cfg: WorkerConfig, reason: str) -> None:
    """This start cannot succeed (its model does not load): said once, in the log and the start record, whose
    supervisor then gives up on this worker with the reason instead of restarting it in a loop."""
    record.refuse(reason)
    log.error("model_not_loaded", reason=reason, start_record=str(record.path))
    print(f"kvroute worker {cfg.worker_id}: {reason}", file=sys.stderr)


class WorkerServer:
    """Hello until accepted, then heartbeats and jobs, to each router of `--connect` (worker/links.py). `serve`
    returns the exit status."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, ctx: zmq.Context | None = None) -> None:
        self.cfg, self.engine = cfg, engine
        self.zctx = ctx or zmq.Context.instance()
        self.inproc = f"inproc://kvroute-worker-out-{uuid.uuid4().hex}"
        self.pull = self.zctx.socket(zmq.PULL)  # what the other threads send (worker/outbox.py)
        self.pull.bind(self.inproc)
        self.links = [
            RouterLink.open(i, e, self.zctx, cfg.worker_id, cfg.curve_key, cfg.router_key) for i, e in enumerate(cfg.routers)
        ]
        self.claims = SlotClaims()
        self.outbox = Outbox(self.zctx, self.inproc, self.links, self.claims, engine)
        self.replies = ReplySockets(self.zctx)  # to clients that read their jobs' output themselves (Job.reply_to)
        self.direct_jobs: dict[tuple[str, str], set[str]] = {}  # reply endpoint -> its jobs (I/O thread; pruned by sweep)
        engine.after_step = self.flush_deltas
        self.decoder = router_to_worker_decoder()
        self.handlers = dict(self.HANDLERS)  # (a test takes one out)
        self.unknown_messages = 0  # (a message type with no handler: a bug, each logged and answered)
        self.ready_sent = False
        self.draining = False
        self.watched_progress = -1
        self.reports = Reports(cfg, engine, self.links, self.claims)  # the hello and the heartbeats

    @property
    def side_by_side(self) -> bool:
        """This worker reports to several routers."""
        return len(self.links) > 1

    @property
    def accepted(self) -> bool:
        return any(link.accepted for link in self.links)

    def sink_for(self, link: RouterLink) -> Callable[[Message], None]:
        """The sink of a job of `link`'s router (worker/outbox.py)."""
        return self.outbox.sink_for(link)

    def flush_deltas(self) -> None:
        """After every engine step: its deltas leave (worker/outbox.py)."""
        self.outbox.flush_deltas()

    def watchdog(self) -> None:
        """systemd's WATCHDOG=1 (and --alive-file touched), but only while the engine is idle or has stepped since the
        last one: a compute thread stuck in llama_decode stops the pings, and systemd (WatchdogSec=) or a liveness
        probe restarts the worker."""
        progress = self.engine.progress
        if progress != self.watched_progress or not self.engine.working():
            alive(self.cfg.alive_file)
        else:
            log.warning("watchdog_withheld", reason="jobs are running and the engine made no progress", progress=progress)
        self.watched_progress = progress

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        e = self.engine
        states = e.slot_states()
        c = e.counters
        head = "draining; " if self.draining else "" if self.accepted else "waiting for the router; "
        return (
            f"{head}slots {sum(s.busy for s in states)}/{len(states)} busy, queue {e.queue_len},"
            f" jobs done {c.jobs_done}, failed {c.jobs_failed},"
            f" host cache {len(e.host)} entries / {e.host.nbytes >> 20} MiB"
        )

    def _forward(self) -> None:
        """Send everything the engine produced so far, each message to its router or client."""
        while True:
            try:
                parts = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 3:
                self._reply(parts[0].decode(), parts[1].decode(), parts[2])
            else:
                self.links[parts[0][0]].send(parts[1], may_drop=self.side_by_side)

    def _reply(self, endpoint: str, key: str, frame: bytes) -> None:
        """To a client's endpoint; when it is stalled (worker/direct_replies.py), the jobs still writing there are cancelled:
        nobody reads what they make."""
        if self.replies.send(endpoint, key, frame):
            return
        for job in self.direct_jobs.pop((endpoint, key), set()):
            if any(job in link.jobs for link in self.links):
                self.engine.cancel(job)

    def _prune_direct_jobs(self) -> None:
        """Forget the jobs that ended (no router's link holds them any more)."""
        held = set().union(*(link.jobs for link in self.links))
        for target in list(self.direct_jobs):
            self.direct_jobs[target] &= held
            if not self.direct_jobs[target]:
                del self.direct_jobs[target]

    def _beat(self) -> None:
        """A heartbeat to every router that accepted this worker, a hello to the others."""
        beat = encode(self.reports.heartbeat(self.draining))
        for link in self.links:
            link.send(beat if link.accepted else encode(self.reports.hello(link)), may_drop=self.side_by_side)

    def _beat_now(self) -> None:
        """A heartbeat to every router at once, not at the next beat."""
        beat = encode(self.reports.heartbeat(self.draining))
        for link in self.links:
            link.send(beat, may_drop=self.side_by_side)

    def _start_drain(self) -> None:
        self.draining = True
        self.engine.drain()
        self._beat_now()  # the routers stop routing here now, not at the next beat
        handed = self.engine.hand_back(running=False).result()
        self._forward()
        log.info("draining", handed_back=handed, timeout_s=self.cfg.drain_timeout_s, reason="signal")
        notify(stopping=True, status=self.status_line())

    def _drained(self, deadline: float) -> bool:
        """True once nothing runs any more (after the deadline, running jobs are handed back first)."""
        if self.engine.has_work().result():
            if time.monotonic() < deadline:
                return False
            handed = self.engine.hand_back(running=True).result()
            log.warning("drain_timeout", handed_back=handed, timeout_s=self.cfg.drain_timeout_s)
        self._forward()
        self._beat_now()
        log.info("drained", jobs_done=self.engine.counters.jobs_done)
        persisted = self.engine.persist(PERSIST_S)  # the disk tier keeps what the slots and host RAM hold
        if persisted:
            log.info("persisted", states=persisted)
        return True

    def serve(self, stop: threading.Event) -> int:
        poller = zmq.Poller()
        for link in self.links:
            poller.register(link.dealer, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        endpoints = ",".join(link.endpoint for link in self.links)
        log.info("worker_started", endpoint=endpoints, slots=self.cfg.slots, ctx_per_slot=self.engine.n_ctx)
        next_beat = 0.0
        drain_deadline: float | None = None
        watchdog_s = watchdog_interval_s(self.cfg.alive_file)
        next_watchdog = 0.0
        try:
            while True:
                now = time.monotonic()
                if stop.is_set() and drain_deadline is None:
                    if not self.accepted:
                        log.info("stopped", reason="signal before a router accepted this worker")
                        return 0
                    drain_deadline = now + self.cfg.drain_timeout_s
                    self._start_drain()
                if drain_deadline is not None and self._drained(drain_deadline):
                    return 0
                if now >= next_beat:
                    if next_beat and now - next_beat > BEAT_S:  # a router may declare this worker dead soon
                        log.warning("heartbeat_late", late_s=round(now - next_beat, 2))
                    self._beat()
                    self.replies.sweep(now)
                    for link in self.links:
                        link.reachable()  # (reads its connection events: they do not pile up)
                    self._prune_direct_jobs()
                    next_beat = now + BEAT_S
                    notify(status=self.status_line())
                if watchdog_s is not None and now >= next_watchdog:
                    next_watchdog = now + watchdog_s
                    self.watchdog()
                # a signal interrupts nothing here: look at least every POLL_S so draining starts at once
                wait_s = min(next_beat - time.monotonic(), POLL_S) if drain_deadline is None else 0.05
                events = dict(poller.poll(timeout=max(1, int(wait_s * 1000))))
                if self.pull in events:
                    self._forward()
                for link in self.links:
                    if link.dealer not in events:
                        continue
                    while True:
                        try:
                            frames = link.dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        status = self.on_frame(link, frames[-1])
                        if status is not None:
                            return status
                        if not link.accepted:
                            next_beat = 0.0  # Refuse(not_found): say hello again now (once, however many refusals)
            return 0
        finally:
            for link in self.links:
                link.close()
            self.replies.close()
            self.pull.close(linger=0)

    def on_frame(self, link: RouterLink, frame: bytes) -> int | None:
        """Handle one message from a router. Returns an exit status to stop serving, else None."""
        msg = self.decoder.decode(frame)
        if isinstance(msg, Invalid):
            log.warning("bad_frame", code=msg.code.value, reason=msg.reason, request_id=msg.id)
            link.send(encode(JobError(id=msg.id or "?", code=msg.code.value, message=msg.reason)), may_drop=self.side_by_side)
            return None
        name = self.handlers.get(type(msg))
        if name is None:  # (a type the decoder knows and this table does not: say so, never guess)
            self.unknown_messages += 1
            kind = kind_of(msg)
            log.warning("unknown_message", kind=kind, endpoint=link.endpoint)
            refusal = Refusal(ErrorCode.BAD_REQUEST, f"this worker does not serve {kind!r} messages")
            link.send(encode(refusal.job_error(getattr(msg, "id", None) or "?")), may_drop=self.side_by_side)
            return None
        return getattr(self, name)(link, msg)

    # each message a router sends, and the name of its handler (a method, looked up at each call; an exit status it
    # returns stops the worker)
    HANDLERS: ClassVar[dict[type, str]] = {
        Job: "take_job",
        EmbedJob: "take_embed",
        JobCancel: "cancel",
        Accept: "on_accept",
        Refuse: "refused",
        Drain: "drain",
        StateFetch: "send_state",
    }

    def take_embed(self, link: RouterLink, msg: EmbedJob) -> None:
        link.jobs.add(msg.id)
        self.engine.embed(msg, lambda done: self.outbox.sink(link, done))

    def cancel(self, link: RouterLink, msg: JobCancel) -> None:
        if msg.id in link.jobs:
            self.engine.cancel(msg.id, msg.preempt)

    def on_accept(self, link: RouterLink, msg: Accept) -> None:
        if not link.accepted:
            log.info("accepted", router_id=msg.router_id, endpoint=link.endpoint)
        if link.accept(msg.router_id, msg.features):
            log.info("router_restarted", router_id=msg.router_id, slots_reported=link.told_held)
            # the new router's mirror is empty: make it the truth (with other routers, their mirrors are; a
            # router told nothing marks every slot unknown, and the next job on each clears it)
            if not link.told_held and not self.side_by_side:
                self.engine.reset()  # (its jobs end without a word)
                link.jobs.clear()
        if not self.ready_sent:  # model loaded and accepted: this worker can serve
            self.ready_sent = True
            notify(ready=True, status=self.status_line())

    def refused(self, link: RouterLink, msg: Refuse) -> int | None:
        if msg.code == ErrorCode.NOT_FOUND:
            if link.accepted:
                log.info("router_forgot_us", reason=msg.reason, endpoint=link.endpoint)
                # the router answered for our jobs already, or never knew them: end them, keep the KV; the
                # next hello says what each slot holds (the compute thread takes it after this)
                self.forget_jobs(link)
            link.accepted = False
            return None
        log.error("refused", code=msg.code, reason=msg.reason, endpoint=link.endpoint)
        return EXIT_REFUSED

    def send_state(self, link: RouterLink, msg: StateFetch) -> None:
        """A copy of a state saved in host RAM, for another worker (worker/state_copies.py); none when it is gone."""
        entry, gives = state_copies.chosen(self.engine.host, msg, self.engine.core.prefixes.restorable)
        state = state_copies.blob_of(entry) if entry is not None else None
        log.info("state_sent", fetch=msg.id, entry=msg.entry, sent=entry.id if entry else None, gives=gives,
                 nbytes=len(state.data) if state else 0)  # fmt: skip
        link.send(encode(StateCopy(id=msg.id, state=state, gives=gives)), may_drop=self.side_by_side)

    def drain(self, link: RouterLink, msg: Drain) -> None:
        log.info("draining")
        self.engine.drain()

    def take_job(self, link: RouterLink, job: Job) -> None:
        """A job to the engine, unless another router's jobs hold the slot it names (or its id is another's)."""
        if self.side_by_side:
            if any(job.id in other.jobs for other in self.links if other is not link):
                refusal = Refusal(ErrorCode.BAD_REQUEST, "job id in use by another router")
                link.send(encode(refusal.job_error(job.id)), may_drop=True)
                return
            if job.slot >= 0:
                epoch = self.claims.claim(link.index, job.id, job.slot)
                if epoch is None:
                    log.info("slot_conflict", job=job.id, slot=job.slot, endpoint=link.endpoint)
                    refusal = Refusal(ErrorCode.SLOT_BUSY, f"slot {job.slot} runs another router's job")
                    link.send(encode(refusal.job_error(job.id)), may_drop=True)
                    return
                taken = encode(SlotTaken(slot=job.slot, epoch=epoch))
                for other in self.links:
                    if other is not link and other.accepted and other.notices:
                        other.send(taken, may_drop=True)
        link.jobs.add(job.id)
        if job.reply_to:  # (sent from this thread before any output, which this thread forwards: it arrives first)
            self.direct_jobs.setdefault((job.reply_to, job.reply_key or ""), set()).add(job.id)
            self._reply(job.reply_to, job.reply_key or "", encode(JobStart(id=job.id)))
            self.engine.submit(job, self.outbox.direct_sink(link, job))
        else:
            self.engine.submit(job, self.sink_for(link))

    def forget_jobs(self, link: RouterLink) -> None:
        """End this router's jobs without a word; other routers learn what the slots those jobs held hold now."""
        ids, link.jobs = link.jobs, set()
        if not self.side_by_side:
            self.engine.forget_jobs()
            return

        def forget(core: EngineCore) -> None:  # on the compute thread: no job starts on those slots in between
            core.forget_jobs(ids)
            for slot, epoch, owner in filter(None, map(self.claims.release, ids)):
                frame = encode(self.outbox.slot_update(slot, epoch))
                for other in self.links:
                    if other.index != owner and other.notices:
                        self.outbox.push_out(other, frame)

        self.engine.call(forget)
