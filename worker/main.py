"""`kvroute worker`: the engine behind a ZMQ DEALER speaking the router<->worker contract (protocol/).

The I/O thread (this module's loop) owns the DEALER socket; the compute thread (worker.engine) owns the
llama context. Engine messages reach the I/O thread through an inproc PUSH/PULL pair, one PUSH per
producing thread.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import uuid

import zmq

from kvroute import logs
from kvroute.cli import UsageError
from kvroute.config import add_args, from_args
from protocol import (
    Accept,
    Drain,
    ErrorCode,
    Heartbeat,
    Hello,
    Invalid,
    Job,
    JobCancel,
    JobError,
    Message,
    Refuse,
    encode,
    router_to_worker_decoder,
)
from worker.config import WorkerConfig
from worker.engine import Engine

log = logs.get(__name__)

BEAT_S = 1.0
EXIT_REFUSED = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    logs.setup(process=f"worker-{args.worker_id}")
    try:
        cfg = from_args(WorkerConfig, args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    engine = Engine(cfg).start()
    server = WorkerServer(cfg, engine)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return server.serve(stop)
    finally:
        engine.stop()


class WorkerServer:
    """Hello until accepted, then heartbeats and jobs. `serve` returns the exit status."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, ctx: zmq.Context | None = None) -> None:
        self.cfg, self.engine = cfg, engine
        self.zctx = ctx or zmq.Context.instance()
        self.inproc = f"inproc://kvroute-worker-out-{uuid.uuid4().hex}"
        self.pull = self.zctx.socket(zmq.PULL)
        self.pull.bind(self.inproc)
        self._push = threading.local()
        self.decoder = router_to_worker_decoder()
        self.accepted = False
        self.router_id: str | None = None

    def sink(self, msg: Message) -> None:
        """Called by the compute thread: hand an encoded message to the I/O thread."""
        sock = getattr(self._push, "sock", None)
        if sock is None:
            sock = self._push.sock = self.zctx.socket(zmq.PUSH)
            sock.connect(self.inproc)
        sock.send(encode(msg))

    def hello(self) -> Hello:
        llama = self.engine.llama
        return Hello(
            worker_id=self.cfg.worker_id,
            incarnation=self.cfg.incarnation,
            slots=self.cfg.slots,
            ctx_per_slot=self.engine.n_ctx,
            model_fingerprint=self.engine.vocab.fingerprint,
            device=llama.device,
            kv_bytes=llama.info.kv_bytes,
            n_batch=self.cfg.n_batch,
            deterministic=self.cfg.deterministic,
            pid=os.getpid(),
        )

    def heartbeat(self) -> Heartbeat:
        e = self.engine
        return Heartbeat(
            worker_id=self.cfg.worker_id,
            incarnation=self.cfg.incarnation,
            slots=e.slot_states(),
            queue=e.queue_len,
            draining=e.draining,
        )

    def serve(self, stop: threading.Event) -> int:
        dealer = self.zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.cfg.worker_id.encode())
        dealer.setsockopt(zmq.LINGER, 500)
        dealer.connect(self.cfg.connect)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        log.info("worker_started", endpoint=self.cfg.connect, slots=self.cfg.slots, ctx_per_slot=self.engine.n_ctx)
        next_beat = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    dealer.send(encode(self.heartbeat() if self.accepted else self.hello()))
                    next_beat = now + BEAT_S
                events = dict(poller.poll(timeout=max(1, int((next_beat - time.monotonic()) * 1000))))
                if self.pull in events:
                    while True:  # forward everything the engine produced
                        try:
                            dealer.send(self.pull.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
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
                log.info("router_restarted", router_id=msg.router_id)
                self.engine.reset()
            self.router_id, self.accepted = msg.router_id, True
        elif isinstance(msg, Refuse):
            if msg.code == ErrorCode.NOT_FOUND:
                log.info("router_forgot_us", reason=msg.reason)
                self.accepted = False
                return None
            log.error("refused", code=msg.code, reason=msg.reason)
            return EXIT_REFUSED
        elif isinstance(msg, Drain):
            log.info("draining")
            self.engine.drain()
        return None
