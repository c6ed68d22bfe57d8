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
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec
import zmq
import zmq.asyncio

from chat.limits import Deadline, DeadlinePassed
from chat.request import ChatFormat
from chat.template import ChatTemplate
from common import logs
from common.inbox import Inbox
from common.notify import alive, notify, watchdog_interval_s
from common.projector import Projector
from common.vocab import Vocab
from common.weights import GGUFError, weights_fingerprint
from protocol import (
    Cancel,
    Delta,
    Deltas,
    Detokenize,
    Embed,
    Error,
    ErrorCode,
    Hello,
    Invalid,
    JobDeltas,
    MetricsReply,
    MetricsRequest,
    Refusal,
    Rerank,
    StatusRequest,
    Submit,
    Tokenize,
    Tokens,
    kind_of,
    worker_to_router_decoder,
)
from router import admission, exposition, sampling_defaults
from router.config import RouterConfig
from router.intake import ClientIntake
from router.metrics import Metrics
from router.mirror import Mirror
from router.models import ModelCore, Models, ServedModel, model_name, status
from router.outbox import Outbox
from router.prepare import Prepared, PrepareError, embed_inputs, prepare, rerank_inputs, tokens_reply
from router.preparing import SMALL_BYTES, SMALL_COST_S, Preparing
from router.prompt_tokens import PromptTokenizer
from router.requests import Req, WorkerConn
from router.scheduler import Out, Scheduler
from router.security import Gatekeeper, Security
from router.workers import Kill

log = logs.get(__name__)

TICK_S = 0.1
STATUS_EVERY_S = 1.0  # systemd STATUS= lines
CLOSE_LINGER_MS = 1000  # last replies (drain errors) get this long to leave when the sockets close
NO_MODEL = frozenset({Invalid, Cancel, StatusRequest, MetricsRequest})  # client messages that name no model


def owner_of(identity: bytes, msg: Submit | Tokenize | Detokenize | Embed | Rerank) -> str | bytes:
    """Whose share of the preparing threads a request counts against: the owner an HTTP front names (its API key's
    digest), else the ZMQ client that sent it."""
    return msg.owner or identity


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
        self.client_handlers = dict(self.CLIENT_HANDLERS)  # (a test takes one out)
        self._worker_decoder = worker_to_router_decoder()
        self._drain_deadline = 0.0
        self._next_status = 0.0
        self._watchdog_s = watchdog_interval_s(cfg.alive_file)
        self._next_watchdog = 0.0
        # (a request's preparation off the loop, the threads shared fairly between clients: router/preparing.py)
        self.preparing = Preparing(cfg.prepare_timeout_s, self.core.metrics, self._flush)
        self.intake = ClientIntake(cfg.max_frame_bytes, self._handle, self._decode_off_loop, self.core.reply, self.core.metrics)
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
        core.remember_reply = prompts.remember  # (a chat reply's tokens, for the next turn's prompt)
        chat = ChatFormat(template)
        mmproj = spec.mmproj or cfg.mmproj
        if mmproj:  # (images placed in prompts as the workers will compute them: common/projector.py)
            chat.vision = Projector(mmproj, vocab.model_ptr)
            log.info("vision_projector", model=spec.name or model_name(vocab), mmproj=mmproj)
        return ModelCore(spec, vocab, chat, prompts, core)

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
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_frame_bytes + 4096)
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

    # ---- client side ----------------------------------------------------------------------------

    def _handle(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any, size: int = 0) -> None:
        """A client's message, `size` bytes of frame."""
        try:
            self._on_client_message(identity, envelope, msg, size)
        except Exception as exc:  # never let one request take the loop down, nor stay in flight
            self._crashed(identity, envelope, getattr(msg, "id", None), exc)

    def _crashed(self, identity: bytes, envelope: tuple[bytes, ...], rid: str | None, exc: BaseException) -> None:
        """Handling request `rid` of this client raised: it ends with an internal error carrying its id and an error
        id for the log, and frees what it held (its place in the queue, its job and slot)."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request_crashed", error_id=error_id, request_id=rid, error=repr(exc), exc_info=exc)
        for core in self.cores:
            req = core.requests.get((identity, rid or "", 0))
            if req is not None:
                try:
                    core.crashed(req, error_id)
                except Exception as again:
                    log.error("request_crash_unsettled", error_id=error_id, request_id=rid, error=repr(again), exc_info=again)
                return
        self.core.metrics.requests[ErrorCode.INTERNAL] += 1
        self.core.reply(identity, envelope, Error(id=rid, code=ErrorCode.INTERNAL, message="internal error", error_id=error_id))

    def _on_client_message(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any, size: int) -> None:
        name = self.client_handlers.get(type(msg))
        if name is None:  # (a type the decoder knows and this table does not: say so, never guess)
            self._unknown_message(identity, envelope, msg)
        elif type(msg) in NO_MODEL:
            getattr(self, name)(identity, envelope, msg)
        elif (model := self._model(identity, envelope, msg)) is not None:  # (else the client was told which models)
            getattr(self, name)(identity, envelope, msg, model, size)

    # each client message type and the name of its handler (a method, looked up at each call); those in NO_MODEL take
    # no model; the others take the model and the frame's size (what their preparation may cost)
    CLIENT_HANDLERS: ClassVar[dict[type, str]] = {
        Invalid: "_on_invalid",
        Cancel: "_on_cancel",
        StatusRequest: "_on_status",
        MetricsRequest: "_on_metrics",
        Submit: "_on_submit",
        Tokenize: "_on_tokenize",
        Detokenize: "_on_tokenize",
        Embed: "_on_embed",
        Rerank: "_on_rerank",
    }

    def _unknown_message(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any) -> None:
        self.core.metrics.unknown_messages += 1
        kind = kind_of(msg)
        log.warning("unknown_client_message", kind=kind, request_id=getattr(msg, "id", None))
        error = Error(
            id=getattr(msg, "id", "") or "", code=ErrorCode.BAD_REQUEST, message=f"this router does not serve {kind!r} messages"
        )
        self.core.reply(identity, envelope, error)

    def _on_invalid(self, identity: bytes, envelope: tuple[bytes, ...], msg: Invalid) -> None:
        self.core.metrics.bad_frames += 1
        log.info("bad_client_frame", code=msg.code, reason=msg.reason, request_id=msg.id)
        self.core.reply(identity, envelope, Error(id=msg.id, code=msg.code, message=msg.reason))

    def _on_cancel(self, identity: bytes, envelope: tuple[bytes, ...], msg: Cancel) -> None:
        for core in self.cores:
            core.cancel(identity, msg.id)

    def _on_status(self, identity: bytes, envelope: tuple[bytes, ...], msg: StatusRequest) -> None:
        self.core.reply(identity, envelope, status(self.models, msg.id, msg.cache_salt))

    def _on_metrics(self, identity: bytes, envelope: tuple[bytes, ...], msg: MetricsRequest) -> None:
        self.core.reply(identity, envelope, MetricsReply(id=msg.id, text=exposition.text(self.cores, self.models)))

    def _model(
        self, identity: bytes, envelope: tuple[bytes, ...], msg: Submit | Tokenize | Detokenize | Embed | Rerank
    ) -> ModelCore | None:
        """The model a request names, or None after telling the client that no model answers to that name."""
        m = self.models.find(msg.model)
        if m is None:
            self.core.metrics.requests[ErrorCode.NOT_FOUND] += 1
            error = Error(id=msg.id, code=ErrorCode.NOT_FOUND, message=self.models.unknown(msg.model or ""), param="model")
            self.core.reply(identity, envelope, error)
        return m

    def _on_embed(self, identity: bytes, envelope: tuple[bytes, ...], msg: Embed, model: ModelCore, size: int) -> None:
        """Texts tokenized as a prompt is (BOS by the model's rule, special-token text read as such), or token ids
        checked, on a preparing thread; then placed."""
        core, vocab = model.core, model.vocab
        self.models.used(model, None)
        if msg.pooling is None:  # (an embedding model's GGUF says how it was trained to pool: bge cls, e5 mean ...)
            msg.pooling = vocab.pooling if vocab.pooling in ("mean", "last", "cls") else "mean"  # type: ignore[assignment]

        def work(deadline: Deadline) -> list[list[int]]:
            return embed_inputs(msg, vocab, model.prompts.cost, deadline)

        def then(inputs: list[list[int]]) -> None:
            core.embed(identity, envelope, msg, inputs)

        self._prepared_then(identity, envelope, msg, model, "embed", size, work, then)

    @staticmethod
    def _small(msg: Submit | Tokenize | Detokenize | Embed | Rerank, size: int, model: ModelCore) -> bool:
        """Whether preparing `msg` is cheap (router/preparing.py's small-work thread): a small frame whose texts
        llama.cpp tokenizes fast (estimated on the message's bytes: its texts, and field names without special tokens'
        first characters)."""
        if size > SMALL_BYTES:
            return False
        return model.prompts.cost.seconds(msgspec.msgpack.encode(msg).decode("latin-1"), exact=False) <= SMALL_COST_S

    def _decode_off_loop(self, identity: bytes, size: int, work: Callable[[], Any], then: Callable[[Any], None]) -> None:
        """A large frame's decoding, on a preparing thread as its client's work (router/intake.py)."""
        self.preparing.submit(identity, "decode", size, lambda _deadline: work(), then)

    def _prepared_then(
        self,
        identity: bytes,
        envelope: tuple[bytes, ...],
        msg: Tokenize | Detokenize | Embed | Rerank,
        model: ModelCore,
        kind: str,
        size: int,
        work: Callable[[Deadline], Any],
        then: Callable[[Any], None],
    ) -> None:
        """`then(work(deadline))` for a request with one reply (embed, rerank, tokenize): `work` on a preparing thread,
        as its owner's work; a refusal or a crash of either is that reply (an error carrying the request's id)."""
        rid = msg.id

        def settle(outcome: Any) -> None:
            if isinstance(outcome, PrepareError | DeadlinePassed):
                self.core.metrics.requests[ErrorCode.BAD_REQUEST] += 1
                self.core.reply(identity, envelope, Refusal(ErrorCode.BAD_REQUEST, str(outcome), param=outcome.param).error(rid))
            elif isinstance(outcome, admission.Busy):
                self.core.metrics.requests[ErrorCode.QUEUE_FULL] += 1
                self.core.reply(identity, envelope, outcome.refusal.error(rid))
            elif isinstance(outcome, BaseException):
                self._crashed(identity, envelope, rid, outcome)
            else:
                try:
                    then(outcome)
                except Exception as exc:
                    self._crashed(identity, envelope, rid, exc)

        self.preparing.submit(owner_of(identity, msg), kind, size, work, settle, small=self._small(msg, size, model))

    def _on_rerank(self, identity: bytes, envelope: tuple[bytes, ...], msg: Rerank, model: ModelCore, size: int) -> None:
        """A reranker's (query, document) inputs made as llama-server makes them (common/vocab.py), then placed like
        embed inputs; a model that is not a reranker is refused, naming what it is."""
        core, vocab = model.core, model.vocab
        if (refusal := admission.not_reranker(model.name, vocab.pooling)) is not None:
            core.metrics.requests[refusal.code] += 1
            core.reply(identity, envelope, refusal.error(msg.id))
            return
        self.models.used(model, None)
        query, documents = msg.query, msg.documents

        def work(deadline: Deadline) -> list[list[int]]:
            return rerank_inputs(query, documents, vocab, model.prompts.cost, deadline)

        def then(inputs: list[list[int]]) -> None:
            core.embed(identity, envelope, msg, inputs)

        self._prepared_then(identity, envelope, msg, model, "rerank", size, work, then)

    def _on_submit(self, identity: bytes, envelope: tuple[bytes, ...], msg: Submit, model: ModelCore, size: int) -> None:
        core = model.core
        if (refusal := admission.not_generative(model.name, model.vocab.causal, model.vocab.pooling)) is not None:
            core.metrics.requests[refusal.code] += 1
            core.reply(identity, envelope, refusal.error(msg.id))
            return
        owner = owner_of(identity, msg)
        if (refusal := self.preparing.admit(owner, "submit", size)) is not None:
            core.metrics.requests[refusal.code] += 1
            core.reply(identity, envelope, refusal.error(msg.id))
            return
        req = core.accept(identity, envelope, msg)
        if req is None:
            return
        self.models.used(model, msg.keep_alive_s)
        shift_to = core.slot_context() if self.cfg.context_shift else None  # (no ready worker: not shifted)

        def work(deadline: Deadline) -> Prepared:  # (the deadline counts from the submit's arrival)
            return prepare(msg, model.vocab, model.chat, model.prompts, shift_to=shift_to, deadline=deadline)

        def then(outcome: Prepared | BaseException) -> None:
            try:
                core.prepared(req, outcome)
            except Exception as exc:
                self._crashed(identity, envelope, req.rid, exc)

        self.preparing.submit(owner, "submit", size, work, then, small=self._small(msg, size, model))

    def _on_tokenize(
        self, identity: bytes, envelope: tuple[bytes, ...], msg: Tokenize | Detokenize, model: ModelCore, size: int
    ) -> None:
        """Tokens or text, nothing generated; the work on a preparing thread."""

        def work(deadline: Deadline) -> Tokens:
            return tokens_reply(msg, model.vocab, model.chat, model.prompts.cost, deadline)

        def then(answer: Tokens) -> None:
            self.core.reply(identity, envelope, answer)

        kind = "tokenize" if isinstance(msg, Tokenize) else "detokenize"
        self._prepared_then(identity, envelope, msg, model, kind, size, work, then)

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
