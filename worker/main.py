"""`kvroute worker`: the engine behind a ZMQ DEALER speaking the router<->worker contract (protocol/).

The I/O thread (this module's loop) owns the DEALER socket; the compute thread (worker.engine) owns the
llama context. Engine messages reach the I/O thread through an inproc PUSH/PULL pair, one PUSH per
producing thread.

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
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import zmq

from kvroute import logs
from kvroute.client import secure_client_socket
from kvroute.config import UsageError, add_args, from_args
from kvroute.model import resolve_model
from kvroute.notify import alive, notify, watchdog_interval_s
from kvroute.start_record import START_FAILED_EXIT, StartRecord, default_path
from kvroute.weights import GGUFError, weights_fingerprint
from protocol import (
    Accept,
    CacheEntry,
    Drain,
    ErrorCode,
    Heartbeat,
    Hello,
    Invalid,
    Job,
    JobCancel,
    JobDelta,
    JobDeltas,
    JobError,
    Message,
    Refuse,
    encode,
    router_to_worker_decoder,
)
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.faults import Faults
from worker.startcheck import first_decode, identity

log = logs.get(__name__)

BEAT_S = 1.0
POLL_S = 0.1
EXIT_REFUSED = 3
PERSIST_S = 30.0  # on a graceful stop, the disk tier's writes get this long
HELD_WAIT_S = 2.0  # a hello waits this long for the compute thread to say what the slots hold, then says "unknown"


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
        server.zctx.destroy(linger=2000)  # the last results and heartbeat leave before the process does


def checked_engine(cfg: WorkerConfig) -> Engine | None:
    """Load the model and decode a few tokens before saying hello (worker/startcheck.py); None: this worker crashed
    at start too often with this build and model, and says so instead of trying again."""
    model = resolve_model(cfg.model)
    record = StartRecord(Path(cfg.start_record) if cfg.start_record else default_path(cfg.worker_id), identity(str(model)))
    count, reason = record.crashes()
    if count and (frames := record.fault_frames()):
        log.error("previous_start_crashed", reason=reason, python_stack=frames)
    refusal = record.refusal()
    if refusal is not None:
        log.error("worker_start_refused", reason=refusal, start_record=str(record.path))
        print(f"kvroute worker {cfg.worker_id}: {refusal} (start record: {record.path})", file=sys.stderr)
        return None
    with record.stage("load"):
        engine = Engine(cfg)
    t0 = time.monotonic()
    with record.stage("first_decode"):
        Faults.from_env().at_start("first-decode", cfg.worker_id)
        # on the compute thread, as every decode after it (worker/llama.py `decode` says why)
        engine.start().call(lambda core: first_decode(core.llama)).result()
    record.passed()
    log.info("first_decode_ok", ms=round((time.monotonic() - t0) * 1000, 1))
    return engine


class WorkerServer:
    """Hello until accepted, then heartbeats and jobs. `serve` returns the exit status."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, ctx: zmq.Context | None = None) -> None:
        self.cfg, self.engine = cfg, engine
        self.zctx = ctx or zmq.Context.instance()
        self.inproc = f"inproc://kvroute-worker-out-{uuid.uuid4().hex}"
        self.pull = self.zctx.socket(zmq.PULL)
        self.pull.bind(self.inproc)
        self._push = threading.local()
        self._deltas: list[JobDelta] = []  # this step's, until the engine's after_step sends them together
        self._deltas_lock = threading.Lock()
        self.step_deltas = False  # the router reads job_deltas (its accept said so)
        engine.after_step = self.flush_deltas
        self.decoder = router_to_worker_decoder()
        self.accepted = False
        self.ready_sent = False
        self.draining = False
        self.router_id: str | None = None
        # every process start is a new incarnation, so a router never mistakes it for the process before it
        self.incarnation = cfg.incarnation if cfg.incarnation is not None else time.time_ns() // 1_000_000
        self.told_held = False  # the last hello said what the slots hold (else a new router means clearing them)
        self.watched_progress = -1
        try:
            self.weights = weights_fingerprint(engine.vocab.path)
        except (GGUFError, OSError) as exc:
            log.warning("no_weights_fingerprint", reason=str(exc))
            self.weights = ""

    def sink(self, msg: Message) -> None:
        """Called by the compute thread: hand a message to the I/O thread. Deltas wait for the step's end
        (`flush_deltas`): the router's cost is per message more than per token. A router that did not say it reads
        `job_deltas` (an older one) gets each delta alone."""
        if isinstance(msg, JobDelta) and self.step_deltas:
            with self._deltas_lock:
                self._deltas.append(msg)
            return
        self.flush_deltas()  # a job's deltas go before its JobDone or JobError
        self._push_out(encode(msg))

    def flush_deltas(self) -> None:
        """The deltas of the step just made, as one message (one delta: a plain JobDelta)."""
        with self._deltas_lock:
            deltas, self._deltas = self._deltas, []
        if deltas:
            self._push_out(encode(deltas[0] if len(deltas) == 1 else JobDeltas(items=deltas)))

    def _push_out(self, frame: bytes) -> None:
        sock = getattr(self._push, "sock", None)
        if sock is None:
            sock = self._push.sock = self.zctx.socket(zmq.PUSH)
            sock.connect(self.inproc)
        sock.send(frame)

    def hello(self) -> Hello:
        llama = self.engine.llama
        cached: list[CacheEntry] = []
        try:
            held, cached = self.engine.held().result(timeout=HELD_WAIT_S)
        except TimeoutError:
            held = None
            log.warning("slots_unknown", reason=f"the compute thread did not answer in {HELD_WAIT_S:g} s")
        self.told_held = held is not None
        return Hello(
            worker_id=self.cfg.worker_id,
            incarnation=self.incarnation,
            slots=self.cfg.slots,
            ctx_per_slot=self.engine.n_ctx,
            model_fingerprint=self.engine.vocab.fingerprint,
            device=llama.device,
            kv_bytes=llama.info.kv_bytes,
            n_batch=self.cfg.n_batch,
            deterministic=self.cfg.deterministic,
            pid=os.getpid(),
            weights_fingerprint=self.weights,
            held=held,
            cached=cached,
        )

    def heartbeat(self) -> Heartbeat:
        e = self.engine
        return Heartbeat(
            worker_id=self.cfg.worker_id,
            incarnation=self.incarnation,
            slots=e.slot_states(),
            queue=e.queue_len,
            draining=e.draining or self.draining,
            counters=e.figures(),
            progress=e.progress,
        )

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

    def _forward(self, dealer: zmq.Socket) -> None:
        """Send everything the engine produced so far."""
        while True:
            try:
                dealer.send(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _start_drain(self, dealer: zmq.Socket) -> None:
        self.draining = True
        self.engine.drain()
        dealer.send(encode(self.heartbeat()))  # the router stops routing here now, not at the next beat
        handed = self.engine.hand_back(running=False).result()
        self._forward(dealer)
        log.info("draining", handed_back=handed, timeout_s=self.cfg.drain_timeout_s, reason="signal")
        notify(stopping=True, status=self.status_line())

    def _drained(self, dealer: zmq.Socket, deadline: float) -> bool:
        """True once nothing runs any more (after the deadline, running jobs are handed back first)."""
        if self.engine.has_work().result():
            if time.monotonic() < deadline:
                return False
            handed = self.engine.hand_back(running=True).result()
            log.warning("drain_timeout", handed_back=handed, timeout_s=self.cfg.drain_timeout_s)
        self._forward(dealer)
        dealer.send(encode(self.heartbeat()))
        log.info("drained", jobs_done=self.engine.counters.jobs_done)
        persisted = self.engine.persist(PERSIST_S)  # the disk tier keeps what the slots and host RAM hold
        if persisted:
            log.info("persisted", states=persisted)
        return True

    def serve(self, stop: threading.Event) -> int:
        dealer = self.zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.cfg.worker_id.encode())
        dealer.setsockopt(zmq.LINGER, 2000)  # the last results leave even when the worker exits right after
        secure_client_socket(dealer, self.cfg.curve_key, self.cfg.router_key)
        dealer.connect(self.cfg.connect)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        log.info("worker_started", endpoint=self.cfg.connect, slots=self.cfg.slots, ctx_per_slot=self.engine.n_ctx)
        next_beat = 0.0
        drain_deadline: float | None = None
        watchdog_s = watchdog_interval_s(self.cfg.alive_file)
        next_watchdog = 0.0
        try:
            while True:
                now = time.monotonic()
                if stop.is_set() and drain_deadline is None:
                    if not self.accepted:
                        log.info("stopped", reason="signal before the router accepted this worker")
                        return 0
                    drain_deadline = now + self.cfg.drain_timeout_s
                    self._start_drain(dealer)
                if drain_deadline is not None and self._drained(dealer, drain_deadline):
                    return 0
                if now >= next_beat:
                    if next_beat and now - next_beat > BEAT_S:  # the router may declare this worker dead soon
                        log.warning("heartbeat_late", late_s=round(now - next_beat, 2))
                    dealer.send(encode(self.heartbeat() if self.accepted else self.hello()))
                    next_beat = now + BEAT_S
                    notify(status=self.status_line())
                if watchdog_s is not None and now >= next_watchdog:
                    next_watchdog = now + watchdog_s
                    self.watchdog()
                # a signal interrupts nothing here: look at least every POLL_S so draining starts at once
                wait_s = min(next_beat - time.monotonic(), POLL_S) if drain_deadline is None else 0.05
                events = dict(poller.poll(timeout=max(1, int(wait_s * 1000))))
                if self.pull in events:
                    self._forward(dealer)
                if dealer in events:
                    while True:
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        status = self.on_frame(dealer, frames[-1])
                        if status is not None:
                            return status
                        if not self.accepted:
                            next_beat = 0.0  # Refuse(not_found): say hello again now
            return 0
        finally:
            dealer.close()
            self.pull.close(linger=0)

    def on_frame(self, dealer: zmq.Socket, frame: bytes) -> int | None:
        """Handle one message from the router. Returns an exit status to stop serving, else None."""
        msg = self.decoder.decode(frame)
        if isinstance(msg, Invalid):
            log.warning("bad_frame", code=msg.code.value, reason=msg.reason, request_id=msg.id)
            if msg.id is not None:
                dealer.send(encode(JobError(id=msg.id, code=msg.code.value, message=msg.reason)))
            else:
                dealer.send(encode(JobError(id="?", code=msg.code.value, message=msg.reason)))
            return None
        if isinstance(msg, Job):
            self.engine.submit(msg, self.sink)
        elif isinstance(msg, JobCancel):
            self.engine.cancel(msg.id)
        elif isinstance(msg, Accept):
            if not self.accepted:
                log.info("accepted", router_id=msg.router_id)
            if self.router_id is not None and msg.router_id != self.router_id:
                log.info("router_restarted", router_id=msg.router_id, slots_reported=self.told_held)
                if not self.told_held:  # the new router's mirror is empty: make it the truth
                    self.engine.reset()
            self.router_id, self.accepted = msg.router_id, True
            self.step_deltas = "job_deltas" in msg.features
            if not self.ready_sent:  # model loaded and accepted: this worker can serve
                self.ready_sent = True
                notify(ready=True, status=self.status_line())
        elif isinstance(msg, Refuse):
            if msg.code == ErrorCode.NOT_FOUND:
                if self.accepted:
                    log.info("router_forgot_us", reason=msg.reason)
                    # the router answered for our jobs already, or never knew them: end them, keep the KV; the
                    # next hello says what each slot holds (the compute thread takes it after this)
                    self.engine.forget_jobs()
                self.accepted = False
                return None
            log.error("refused", code=msg.code, reason=msg.reason)
            return EXIT_REFUSED
        elif isinstance(msg, Drain):
            log.info("draining")
            self.engine.drain()
        return None
