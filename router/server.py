"""The router process's I/O shell: the client and worker sockets, the loops, the drain and systemd notify, around
the socket-free core (router/scheduler.py), which owns every request and worker record.

One asyncio task reads each socket and a ticker runs every 100 ms; every event goes to the core, and what the core
produced is sent right after (`_flush`). A send to a client that is gone, or to an unreachable worker, is
reported to the core as its own event. All state is owned by this loop: no locks.

- A frame a client sends that cannot be decoded gets an `error` reply naming the problem (and the request id when
  it can be read, even from a frame over the size cap); the loop goes on.
- A peer that does not read (its pipe is at the high-water mark) gets what is for it kept in order in a backlog,
  sent as it reads again (router/outbox.py); a client that stays behind for BACKLOG_TIMEOUT_S, or BACKLOG_MAX
  messages, is cut (its requests cancelled, logged), a worker is declared dead. Nothing is dropped without a log line.
- Workers the core wants killed (hung, or silent long after they were declared dead) go to `on_kill` (the
  supervisor, under `kvroute serve`; systemd's watchdog does it for units).
- Every request's preparation (its template, tokenizing, schema and grammar work, detokenizing) runs on the
  preparing threads (router/prepare.py bounds what it may cost), never on the loop, so the loop keeps serving
  everyone else; the request is in flight meanwhile.
- Any exception while a request is handled ends that request (an `internal` error carrying its id and an error id
  for the log) and frees what it held (Scheduler.crashed); the loop goes on.

Graceful stop (`shutdown()`, on SIGTERM): new submits get `draining` at once; accepted requests (queued or
running) go on and the loop stops when none is left, or after `drain_timeout_s`, when each request still open
gets a `draining` error and its job is cancelled. A second `shutdown()` gives up waiting. No accepted request
ends without a reply. `hangup()` (SIGHUP) changes nothing and says so in the log.

systemd: READY=1 once both sockets are bound; a STATUS= line (workers, busy slots, queue, served) every
second; WATCHDOG=1 from the ticker when the unit asks for it; STOPPING=1 when draining starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from chat.request import ChatFormat
from chat.template import ChatTemplate
from common import logs
from common.inbox import Inbox
from common.notify import alive, notify, watchdog_interval_s
from common.projector import Projector
from common.vocab import Vocab
from common.weights import GGUFError, weights_fingerprint
from protocol import (
    MAX_STATE_BYTES,
    Delta,
    Deltas,
    Hello,
    Invalid,
    JobDeltas,
    worker_to_router_decoder,
)
from router import sampling_defaults
from router.client_requests import ClientRequests
from router.config import RouterConfig
from router.intake import ClientIntake
from router.lifecycle import Out
from router.metrics import Metrics
from router.mirror import Mirror
from router.models import ModelCore, Models, ServedModel, model_name
from router.outbox import Outbox
from router.prepare import prepare
from router.preparing import Preparing
from router.prompt_tokens import PromptTokenizer
from router.requests import Req, WorkerConn
from router.scheduler import Scheduler
from router.security import Gatekeeper, Security
from router.workers import Kill

log = logs.get(__name__)

TICK_S = 0.1
STATUS_EVERY_S = 1.0  # systemd STATUS= lines
CLOSE_LINGER_MS = 1000  # last replies (drain errors) get this long to leave when the sockets close


def batched(out: list[Out]) -> list[Out]:
    """`out` with the Deltas a client takes together (Out.batch) joined into one `deltas` message per client, placed
    where its first one was; the client's other messages keep their order after its deltas before them."""
    if not any(o.batch for o in out):
        return out
    groups: dict[tuple[bytes, tuple[bytes, ...]], list[Delta]] = {}
    order: list[Out | tuple[Out, list[Delta]]] = []
    for o in out:
        key = (o.to, o.envelope)
        if o.batch:
            if key not in groups:
                groups[key] = []
                order.append((o, groups[key]))  # filled as the loop goes on
            groups[key].append(o.msg)
        else:
            if not o.worker:
                groups.pop(key, None)  # this client's later deltas go after this message
            order.append(o)
    return [
        o if isinstance(o, Out) else (o[0] if len(o[1]) == 1 else Out(o[0].to, Deltas(items=o[1]), o[0].envelope)) for o in order
    ]


class Router:
    """The router process: sockets and loops around one core per served model (router/models.py). `await run()`
    serves until `stop()`. `vocab`, `chat`, `prompts` and `core` are the default (or first) model's."""

    def __init__(
        self,
        cfg: RouterConfig,
        vocab: Vocab,
        *,
        context: zmq.asyncio.Context | None = None,
        more: list[tuple[ServedModel, Vocab]] | None = None,
        served: ServedModel | None = None,
        default_model: str | None = None,
        models_max: int = 0,
        memory_mb: float = 0,
    ) -> None:
        self.cfg = cfg
        self.router_id = uuid.uuid4().hex[:12]
        self.ctx = context or zmq.asyncio.Context.instance()
        first = served or ServedModel(name=model_name(vocab), path=str(vocab.path))
        metrics = Metrics()  # one for every model's core: counters are the router's
        if more and cfg.mmproj:
            raise ValueError("--mmproj is one model's projector: with several models give each its `mmproj` in the models file")
        cores = [self._model_core(spec, v, metrics) for spec, v in [(first, vocab), *(more or [])]]
        self.models = Models(cores, default=default_model, models_max=models_max, memory_mb=memory_mb)
        main = self.models.default or cores[0]
        self.vocab, self.chat, self.prompts, self.core = main.vocab, main.chat, main.prompts, main.core
        for m in cores:  # (the supervisor counts restarts in one table)
            m.core.restarts = m.core.table.restarts = self.core.restarts
        self.on_kill: Callable[[Kill], None] | None = None  # set by the supervisor of local workers
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.client_sock: zmq.asyncio.Socket | None = None
        self.worker_sock: zmq.asyncio.Socket | None = None
        self._worker_decoder = worker_to_router_decoder()
        self._drain_deadline = 0.0
        self._next_status = 0.0
        self._watchdog_s = watchdog_interval_s(cfg.alive_file)
        self._next_watchdog = 0.0
        # (a request's preparation off the loop, the threads shared fairly between clients: router/preparing.py)
        self.preparing = Preparing(cfg.prepare_timeout_s, self.core.metrics, self._flush)
        # (`prepare` looked up at each call, in this module: a test replaces it here)
        self.clients = ClientRequests(cfg, self.models, self.core, self.preparing, lambda *a, **kw: prepare(*a, **kw))
        self.intake = ClientIntake(
            cfg.max_frame_bytes, self.clients.handle, self.clients.decode_off_loop, self.core.reply, self.core.metrics
        )
        self.gatekeeper: Gatekeeper | None = None
        self._raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None = None
        self.outbox: Outbox | None = None  # (made with the sockets, in `bind`)
        self._inboxes: list[Inbox] = []

    def _model_core(self, spec: ServedModel, vocab: Vocab, metrics: Metrics) -> ModelCore:
        cfg = self.cfg
        bos = vocab.piece(vocab.bos).decode("utf-8", "replace") if vocab.bos is not None else ""
        eos = vocab.piece(vocab.eos).decode("utf-8", "replace") if vocab.eos is not None else ""
        template = ChatTemplate.choose(vocab.chat_template, cfg.chat_template, cfg.chat_format, bos_text=bos, eos_text=eos)
        try:
            weights = weights_fingerprint(vocab.path)
        except (GGUFError, OSError) as exc:
            log.warning("no_weights_fingerprint", model=spec.name, reason=str(exc), effect="workers' weights are not compared")
            weights = ""
        core = Scheduler(
            cfg, fingerprint=vocab.fingerprint, model=spec.name, router_id=self.router_id, weights=weights, metrics=metrics
        )
        core.sampling = sampling_defaults.resolve(dict(spec.sampling), cfg.sampling_flags(), vocab.meta)
        log.info("sampling_defaults", model=spec.name or model_name(vocab), defaults=core.sampling.described(),
                 not_applied=core.sampling.not_applied or None)  # fmt: skip
        # (PromptTokenizer: a conversation's next prompt, only its new part tokenized)
        prompts = PromptTokenizer(vocab)
        threading.Thread(target=prompts.warm, name="kvroute-prompt-index", daemon=True).start()  # (beside the workers' start)
        core.remember_reply = prompts.remember  # (a chat reply's tokens, for the next turn's prompt)
        generic = cfg.generic_tools if spec.generic_tools is None else spec.generic_tools
        chat = ChatFormat(template, generic_tools=generic)
        mmproj = spec.mmproj or cfg.mmproj
        if mmproj:  # (images placed in prompts as the workers will compute them: common/projector.py)
            chat.vision = Projector(mmproj, vocab.model_ptr)
            log.info("vision_projector", model=spec.name or model_name(vocab), mmproj=mmproj)
        return ModelCore(spec, vocab, chat, prompts, core)

    @property
    def client_handlers(self) -> dict[type, str]:
        """Each client message type's handler (router/client_requests.py; a test takes one out)."""
        return self.clients.handlers

    @property
    def cores(self) -> list[Scheduler]:
        return [m.core for m in self.models]

    def _core_of_worker(self, worker: str) -> Scheduler:
        m = self.models.by_worker.get(worker)
        return m.core if m is not None else self.core

    # the core's records, for the supervisor, status lines and tests
    @property
    def metrics(self) -> Metrics:
        return self.core.metrics

    @property
    def workers(self) -> dict[str, WorkerConn]:
        return self.core.workers

    @property
    def requests(self) -> dict[tuple[bytes, str, int], Req]:
        return self.core.requests

    @property
    def mirror(self) -> Mirror:
        return self.core.mirror

    @property
    def restarts(self) -> dict[str, int]:
        return self.core.restarts

    @property
    def draining(self) -> bool:
        return self.core.draining

    # ---- lifecycle ------------------------------------------------------------------------------

    def bind(self) -> None:
        """Read the keys and bind both sockets. A bad key setup raises ValueError naming the flag."""
        security = Security.from_config(self.cfg)
        self.gatekeeper = Gatekeeper(self.ctx, security)  # its ZAP handler is bound before any CURVE socket
        for endpoint in security.insecure:
            log.warning("insecure_bind", endpoint=endpoint, reason="no CURVE keys: anyone who can reach it gets in")
        for endpoint in security.unauthenticated:
            log.warning(
                "workers_unauthenticated",
                endpoint=endpoint,
                reason="any process on this host may join as a worker and receive every tenant's prompts: give "
                "--curve-key with --worker-keys, or an ipc:// --worker-endpoint in a directory only this user enters",
            )
        self.client_sock = self._router_socket(self.cfg.client_endpoint, security, "clients")
        self.worker_sock = self._router_socket(self.cfg.worker_endpoint, security, "workers")
        # the same sockets without the asyncio wrapper: every read and send goes through these (Inbox says why)
        self._raw = (zmq.Socket.shadow(self.client_sock.underlying), zmq.Socket.shadow(self.worker_sock.underlying))
        self.outbox = Outbox(*self._raw, self._lost)

    def _router_socket(self, endpoint: str, security: Security, domain: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        security.secure(sock, domain)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        # frames over the cap still get a `too_large` reply; only far larger ones drop the connection
        cap = 4 * self.cfg.max_frame_bytes + 4096
        sock.setsockopt(zmq.MAXMSGSIZE, cap + MAX_STATE_BYTES if domain == "workers" else cap)  # (states copied)
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):  # (only this user: the directory decides who reaches it before this)
            with contextlib.suppress(OSError):
                os.chmod(endpoint[len("ipc://") :], 0o600)
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
            models=self.models.names(),
            curve=sorted(self.gatekeeper.security.allowed) if self.gatekeeper else [],
        )
        self.ready.set()
        # what start-up made (vocabularies, templates, caches: ~50k objects, a full collection of which took 76 ms
        # here) is left out of the collector's full passes, which stop every thread, this loop too
        gc.freeze()
        notify(ready=True, status=self.status_line())
        assert self._raw is not None
        self._inboxes = [
            Inbox(self._raw[0], self.intake.frames, self._flush),
            Inbox(self._raw[1], self._worker_frames, self._flush),
        ]
        tasks = [asyncio.ensure_future(self._ticker()), *(self.gatekeeper.tasks() if self.gatekeeper else [])]
        try:
            await self._stop.wait()
        finally:
            for inbox in self._inboxes:
                inbox.close()
            self._inboxes = []
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
            self.preparing.shutdown()
            log.info("router_stopped", router_id=self.router_id)

    def stop(self) -> None:
        """Stop now (requests still open get no reply: tests and the drain's last step use this)."""
        self._stop.set()

    def shutdown(self) -> None:
        """Graceful stop (SIGTERM): refuse new requests, let accepted ones finish within drain_timeout_s."""
        now = time.monotonic()
        in_flight = sum(len(c.requests) for c in self.cores)
        if self.core.draining:
            log.info("router_drain_cut_short", in_flight=in_flight)
            self._drain_deadline = now  # a second signal: give up waiting
        else:
            for core in self.cores:
                core.draining = True
            self._drain_deadline = now + self.cfg.drain_timeout_s
            log.info("router_draining", in_flight=in_flight, timeout_s=self.cfg.drain_timeout_s)
            notify(stopping=True, status=self.status_line())
        self._check_drained(now)

    def hangup(self) -> None:
        """SIGHUP: nothing is reloaded (settings are read at start; `systemctl restart` drains first)."""
        status = self.status_line()
        log.info("sighup", action="none", reason="settings are read at start; restart to change them", status=status)
        notify(status=status)

    def status_line(self) -> str:
        if len(self.cores) == 1:
            return self.core.status_line()
        return "; ".join(f"{m.name}: {m.core.status_line()}" for m in self.models)

    def _check_drained(self, now: float) -> None:
        if not self.core.draining:
            return
        if any(c.requests or c.embeds.running or c.embeds.waiting for c in self.cores) and now < self._drain_deadline:
            return
        for core in self.cores:
            core.drain_expired()
        self._flush()
        log.info("router_drained", timeout_s=self.cfg.drain_timeout_s)
        self.stop()

    # ---- sending --------------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send what the core produced (router/outbox.py); a send that fails becomes the core's next event (and is
        flushed too)."""
        for core in self.cores:
            while out := core.take():
                assert self.outbox is not None
                for o in batched(out):
                    self.outbox.put(o)
            for kill in core.take_kills():
                log.warning("worker_kill", worker=kill.worker, incarnation=kill.incarnation, pid=kill.pid, reason=kill.reason)
                if self.on_kill is not None:
                    self.on_kill(kill)
        for inbox in self._inboxes:  # (a send may have taken a socket's readiness edge)
            inbox.rearm()

    def _lost(self, worker: bool, identity: bytes, reason: str, cut: bool) -> None:
        """The outbox could not reach a peer (`cut`: it stayed behind): a worker is dead, a client's requests end."""
        if cut:
            self.core.metrics.peers_cut += 1
        if worker:
            name = identity.decode("utf-8", "replace")
            self._core_of_worker(name).worker_dead(name, reason)
        else:
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        for core in self.cores:
            core.client_gone(identity)

    # ---- worker side ----------------------------------------------------------------------------

    def _worker_frames(self, frames: list[bytes]) -> None:
        try:
            self._on_worker_frames(frames)
        except Exception as exc:
            error_id = uuid.uuid4().hex[:12]
            log.error("worker_frame_crashed", error_id=error_id, error=repr(exc), exc_info=exc)
            self._job_crashed(frames, error_id)

    def _job_crashed(self, frames: list[bytes], error_id: str) -> None:
        """A worker's message about jobs raised while it was handled: the requests of those jobs end with an internal
        error (their jobs cancelled, their slots' contents forgotten), so that none of them waits forever."""
        msg = self._worker_decoder.decode(frames[1]) if len(frames) == 2 else None
        items = msg.items if isinstance(msg, JobDeltas) else [msg]
        for item in items:
            job = getattr(item, "id", None)
            for core in self.cores:
                req = core.jobs.get(job) if isinstance(job, str) else None
                if req is not None:
                    try:
                        core.crashed(req, error_id)
                    except Exception as again:
                        log.error("request_crash_unsettled", error_id=error_id, job=job, error=repr(again), exc_info=again)
        self._flush()

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            log.warning("bad_worker_frame", identity=identity.hex(), reason=f"{len(frames) - 1} frames")
            return
        msg = self._worker_decoder.decode(frames[1])
        if isinstance(msg, Invalid):
            log.warning("bad_worker_frame", identity=identity.decode("utf-8", "replace"), code=msg.code, reason=msg.reason)
        elif isinstance(msg, Hello):
            m = self.models.for_hello(msg.model, msg.model_fingerprint, msg.weights_fingerprint)
            expected = self.models.by_worker.get(msg.worker_id)
            if expected is not None and expected is not m:  # (a worker id belongs to one model's core)
                expected.core.worker_dead(msg.worker_id, f"it said hello for model {m.name}")
            self.models.by_worker[msg.worker_id] = m
            m.core.hello(identity, msg)
        else:
            self._core_of_worker(identity.decode("utf-8", "replace")).worker_message(identity, msg)

    def worker_exited(self, worker: str, incarnation: int, returncode: int | None) -> None:
        """From the supervisor: the process of this worker incarnation exited."""
        self._core_of_worker(worker).worker_exited(worker, incarnation, returncode)
        self.models.tick(time.monotonic())  # (a load waiting for this one's room starts now, not at the next tick)
        self._flush()

    def expect_workers(self, workers: set[str], model: str | None = None) -> None:
        """From the supervisor: the local workers it runs (for `model`, or the default model)."""
        m = self.models.by_name[model] if model is not None else (self.models.default or self.models.cores[0])
        m.core.expected |= workers
        for w in workers:
            self.models.by_worker[w] = m

    def worker_failed(self, worker: str, reason: str) -> None:
        """From the supervisor: this worker will not be started again (it crashed at start too often)."""
        core = self._core_of_worker(worker)
        core.worker_failed(worker, reason)
        m = self.models.by_worker.get(worker)
        if m is not None:
            self.models.failed(m)
        self._flush()

    # ---- time -----------------------------------------------------------------------------------

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception as exc:
                log.exception("tick_crashed", error=str(exc))

    def tick(self, now: float) -> None:
        self.preparing.expire(now)
        for core in self.cores:
            core.tick(now)
        self.models.tick(now)
        self._flush()
        if self.outbox is not None and self.outbox.backlog:
            self.outbox.catch_up(now)
            self._flush()
        self._check_drained(now)
        if now >= self._next_status:
            self._next_status = now + STATUS_EVERY_S
            notify(status=self.status_line())
        if self._watchdog_s is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self._watchdog_s
            alive(self.cfg.alive_file)  # (from a tick of the event loop: a stuck loop says nothing)
