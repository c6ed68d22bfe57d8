"""The router process's I/O shell: the client and worker sockets, the loops, the drain and systemd notify, around
the socket-free core (router/scheduler.py), which owns every request and worker record.

One asyncio task reads each socket and a ticker runs every 100 ms; every event goes to the core, and what the core
produced is sent right after (`_flush`). A send to a client that is gone, or to an unreachable worker, is
reported to the core as its own event. All state is owned by this loop: no locks.

- A frame a client sends that cannot be decoded gets an `error` reply naming the problem (and the request id when
  it can be read, even from a frame over the size cap); the loop goes on.
- A peer that does not read (its pipe is at the high-water mark) gets what is for it kept in order in a backlog,
  sent as it reads again; a client that stays behind for BACKLOG_TIMEOUT_S, or BACKLOG_MAX messages, is cut (its
  requests cancelled, logged), a worker is declared dead. Nothing is dropped without a log line.
- Workers the core wants killed (hung, or silent long after they were declared dead) go to `on_kill` (the
  supervisor, under `kvroute serve`; systemd's watchdog does it for units).
- A long prompt is rendered and tokenized on a thread (llama_tokenize releases the GIL), so the loop keeps
  serving everyone else; the request is in flight meanwhile.

Graceful stop (`shutdown()`, on SIGTERM): new submits get `draining` at once; accepted requests (queued or
running) go on and the loop stops when none is left, or after `drain_timeout_s`, when each request still open
gets a `draining` error and its job is cancelled. A second `shutdown()` gives up waiting. No accepted request
ends without a reply. `hangup()` (SIGHUP) changes nothing and says so in the log.

systemd: READY=1 once both sockets are bound; a STATUS= line (workers, busy slots, queue, served) every
second; WATCHDOG=1 from the ticker when the unit asks for it; STOPPING=1 when draining starts.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from chat.request import ChatFormat
from chat.template import ChatTemplate
from kvroute import logs
from kvroute.inbox import Inbox
from kvroute.notify import alive, notify, watchdog_interval_s
from kvroute.vocab import Vocab
from kvroute.weights import GGUFError, weights_fingerprint
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
    MetricsReply,
    MetricsRequest,
    Rerank,
    StatusRequest,
    Submit,
    Tokenize,
    Tokens,
    client_request_decoder,
    encode,
    unpack_tokens,
    worker_to_router_decoder,
)
from router import exposition
from router.config import RouterConfig
from router.metrics import Metrics
from router.mirror import Mirror
from router.models import ModelCore, Models, ServedModel, model_name, status
from router.prepare import PrepareError, prepare, text_chars, tokens_reply
from router.prompt_tokens import PromptTokenizer
from router.requests import Req, WorkerConn
from router.scheduler import Out, Scheduler
from router.security import Gatekeeper, Security
from router.workers import Kill

log = logs.get(__name__)

TICK_S = 0.1
STATUS_EVERY_S = 1.0  # systemd STATUS= lines
CLOSE_LINGER_MS = 1000  # last replies (drain errors) get this long to leave when the sockets close
# Text longer than this is tokenized on a thread: llama_tokenize takes ~3 us a token here (80 ms for a 130 kB,
# 26k-token conversation), which on the event loop would stall every other client for as long.
TOKENIZE_INLINE_CHARS = 16 * 1024
BACKLOG_MAX = 100_000  # messages kept for one peer that does not read
BACKLOG_TIMEOUT_S = 30.0  # how long a peer may stay behind


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
        cores = [self._model_core(spec, v, metrics) for spec, v in [(first, vocab), *(more or [])]]
        self.models = Models(cores, default=default_model, models_max=models_max, memory_mb=memory_mb)
        main = self.models.default or cores[0]
        self.vocab, self.chat, self.prompts, self.core = main.vocab, main.chat, main.prompts, main.core
        for m in cores:  # (the supervisor counts restarts in one table)
            m.core.restarts = m.core.table.restarts = self.core.restarts
        self.on_kill: Callable[[Kill], None] | None = None  # set by the supervisor of local workers
        # per peer (worker?, identity): messages waiting while its pipe is full, and since when
        self._backlog: dict[tuple[bool, bytes], collections.deque[Out]] = {}
        self._behind_since: dict[tuple[bool, bytes], float] = {}
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.client_sock: zmq.asyncio.Socket | None = None
        self.worker_sock: zmq.asyncio.Socket | None = None
        self._client_decoder = client_request_decoder(cfg.max_frame_bytes)
        self._worker_decoder = worker_to_router_decoder()
        self._drain_deadline = 0.0
        self._next_status = 0.0
        self._watchdog_s = watchdog_interval_s(cfg.alive_file)
        self._next_watchdog = 0.0
        # long texts are tokenized here, so that the event loop keeps serving (llama_tokenize releases the GIL)
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvroute-tokenize")
        self.gatekeeper: Gatekeeper | None = None
        self._raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None = None
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
        # (PromptTokenizer: a conversation's next prompt, only its new part tokenized)
        prompts = PromptTokenizer(vocab)
        core.remember_reply = prompts.remember  # (a chat reply's tokens, for the next turn's prompt)
        return ModelCore(spec, vocab, ChatFormat(template), prompts, core)

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
        self.client_sock = self._router_socket(self.cfg.client_endpoint, security, "clients")
        self.worker_sock = self._router_socket(self.cfg.worker_endpoint, security, "workers")
        # the same sockets without the asyncio wrapper: every read and send goes through these (Inbox says why)
        self._raw = (zmq.Socket.shadow(self.client_sock.underlying), zmq.Socket.shadow(self.worker_sock.underlying))

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
        notify(ready=True, status=self.status_line())
        assert self._raw is not None
        self._inboxes = [
            Inbox(self._raw[0], self._client_frames, self._flush),
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
            self._tokenizer.shutdown(wait=False, cancel_futures=True)
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
        """Send what the core produced; a send that fails becomes the core's next event (and is flushed too)."""
        for core in self.cores:
            while out := core.take():
                for o in batched(out):
                    key = (o.worker, o.to)
                    if key in self._backlog:
                        self._backlog[key].append(o)  # behind what already waits for this peer, in order
                    else:
                        self._send(o)
            for kill in core.take_kills():
                log.warning("worker_kill", worker=kill.worker, incarnation=kill.incarnation, pid=kill.pid, reason=kill.reason)
                if self.on_kill is not None:
                    self.on_kill(kill)
        for inbox in self._inboxes:  # (a send may have taken a socket's readiness edge)
            inbox.rearm()

    def _send(self, o: Out) -> bool:
        """Send one message; False when the peer's pipe is full (the message then waits in its backlog)."""
        assert self._raw is not None
        sock = self._raw[1] if o.worker else self._raw[0]
        try:
            sock.send_multipart([o.to, *o.envelope, encode(o.msg)], zmq.NOBLOCK)
        except zmq.Again:
            key = (o.worker, o.to)
            self._backlog.setdefault(key, collections.deque()).appendleft(o)
            self._behind_since.setdefault(key, time.monotonic())
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                log.warning("send_failed", worker=o.worker, error=str(exc), message=type(o.msg).__name__)
            elif o.worker:
                worker = o.to.decode("utf-8", "replace")
                self._core_of_worker(worker).worker_dead(worker, "unreachable")
            else:
                self._client_gone(o.to)
        return True

    def _catch_up(self, now: float) -> None:
        """Send what waits for peers whose pipes were full; cut the peers that stay behind too long."""
        for key, backlog in list(self._backlog.items()):
            del self._backlog[key]  # (so that `_send` puts a refused message back in a fresh one)
            while backlog and self._send(backlog.popleft()):
                pass
            if key in self._backlog:  # still full: what was left goes behind the refused message
                self._backlog[key].extend(backlog)
                backlog = self._backlog[key]
                since = self._behind_since[key]
                if len(backlog) > BACKLOG_MAX or now - since > BACKLOG_TIMEOUT_S:
                    self._cut(key, len(backlog), now - since)
            else:
                self._behind_since.pop(key, None)
        self._flush()

    def _cut(self, key: tuple[bool, bytes], waiting: int, behind_s: float) -> None:
        worker, identity = key
        del self._backlog[key], self._behind_since[key]
        peer = identity.decode("utf-8", "replace") if worker else identity.hex()
        log.warning("peer_cut", worker=worker, peer=peer, unsent=waiting, behind_s=round(behind_s, 1),
                    reason="it did not read its messages")  # fmt: skip
        self.core.metrics.peers_cut += 1
        if worker:
            self._core_of_worker(peer).worker_dead(peer, f"did not read its messages for {behind_s:.0f} s")
        else:
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        for core in self.cores:
            core.client_gone(identity)

    # ---- client side ----------------------------------------------------------------------------

    def _client_frames(self, frames: list[bytes]) -> None:
        try:
            self._on_client_frames(frames)
        except Exception as exc:  # never let one request take the loop down
            error_id = uuid.uuid4().hex[:12]
            log.exception("client_frame_crashed", error_id=error_id, error=str(exc))
            self.core.reply(frames[0], (), Error(code=ErrorCode.INTERNAL, message="internal error", error_id=error_id))

    def _on_client_frames(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        envelope: tuple[bytes, ...]
        if len(rest) == 2 and rest[0] == b"":
            envelope, payload = (b"",), rest[1]
        elif len(rest) == 1:
            envelope, payload = (), rest[0]
        else:
            self.core.metrics.bad_frames += 1
            message = f"expected one message frame, got {len(rest)}"
            self.core.reply(identity, (), Error(code=ErrorCode.BAD_REQUEST, message=message))
            return
        msg = self._client_decoder.decode(payload)
        if isinstance(msg, Invalid):
            self.core.metrics.bad_frames += 1
            log.info("bad_client_frame", code=msg.code, reason=msg.reason, request_id=msg.id)
            self.core.reply(identity, envelope, Error(id=msg.id, code=msg.code, message=msg.reason))
        elif isinstance(msg, Cancel):
            for core in self.cores:
                core.cancel(identity, msg.id)
        elif isinstance(msg, StatusRequest):
            self.core.reply(identity, envelope, status(self.models, msg.id, msg.cache_salt))
        elif isinstance(msg, MetricsRequest):
            text = exposition.text(self.cores, self.models)
            self.core.reply(identity, envelope, MetricsReply(id=msg.id, text=text))
        elif (model := self._model(identity, envelope, msg)) is None:
            return  # (the client was told which models there are)
        elif isinstance(msg, Submit):
            self._on_submit(identity, envelope, msg, model)
        elif isinstance(msg, Tokenize | Detokenize):
            self._on_tokenize(identity, envelope, msg, model)
        elif isinstance(msg, Embed):
            self._on_embed(identity, envelope, msg, model)
        else:
            self._on_rerank(identity, envelope, msg, model)

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

    def _on_embed(self, identity: bytes, envelope: tuple[bytes, ...], msg: Embed, model: ModelCore) -> None:
        """Texts tokenized as a prompt is (BOS by the model's rule, special-token text read as such; a long one on the
        tokenizing thread), then placed."""
        core, vocab = model.core, model.vocab
        self.models.used(model, None)
        if msg.pooling is None:  # (an embedding model's GGUF says how it was trained to pool: bge cls, e5 mean ...)
            msg.pooling = vocab.pooling if vocab.pooling in ("mean", "last", "cls") else "mean"  # type: ignore[assignment]
        if msg.tokens is not None:
            inputs = [unpack_tokens(t) for t in msg.tokens]
            n_vocab = vocab.n_vocab
            bad = next(((i, t) for i, ids in enumerate(inputs) for t in ids if not 0 <= t < n_vocab), None)
            if bad is not None:
                text = f"token id {bad[1]} of input {bad[0]} is outside the vocabulary (0..{n_vocab - 1})"
                core.reply(identity, envelope, Error(id=msg.id, code=ErrorCode.BAD_REQUEST, message=text, param="tokens"))
                return
            core.embed(identity, envelope, msg, inputs)
            return
        texts = msg.input or []

        def work() -> list[list[int]]:
            return [vocab.tokenize(t, add_special=True, parse_special=True) for t in texts]

        self._tokenized(sum(map(len, texts)), work, lambda inputs: core.embed(identity, envelope, msg, inputs))

    def _tokenized(self, chars: int, work: Callable[[], list[list[int]]], then: Callable[[list[list[int]]], None]) -> None:
        """`then(work())`: at once for short texts, else `work` on the tokenizing thread and `then` back on the loop."""
        if chars <= TOKENIZE_INLINE_CHARS:
            then(work())
            return

        def done(fut: asyncio.Future[list[list[int]]]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                then(fut.result())
                self._flush()

        asyncio.get_running_loop().run_in_executor(self._tokenizer, work).add_done_callback(done)

    def _on_rerank(self, identity: bytes, envelope: tuple[bytes, ...], msg: Rerank, model: ModelCore) -> None:
        """A reranker's (query, document) inputs made as llama-server makes them (kvroute/vocab.py), then placed like
        embed inputs; a model that is not a reranker is refused, naming what it is."""
        core, vocab = model.core, model.vocab
        if vocab.pooling != "rank":
            declared = f"declares {vocab.pooling} pooling" if vocab.pooling else "declares no pooling"
            text = (
                f"model {model.name!r} is not a reranker: its GGUF {declared}, and reranking needs a model with rank "
                "pooling (a cross-encoder such as bge-reranker or jina-reranker, or Qwen3-Reranker)"
            )
            core.reply(identity, envelope, Error(id=msg.id, code=ErrorCode.BAD_REQUEST, message=text, param="model"))
            return
        self.models.used(model, None)
        query, documents = msg.query, msg.documents

        def work() -> list[list[int]]:
            return [vocab.rerank_prompt(query, d) for d in documents]

        chars = len(query) * len(documents) + sum(map(len, documents))
        self._tokenized(chars, work, lambda inputs: core.embed(identity, envelope, msg, inputs))

    def _on_submit(self, identity: bytes, envelope: tuple[bytes, ...], msg: Submit, model: ModelCore) -> None:
        core = model.core
        if not model.vocab.causal:  # (its slots would hold no KV to generate from)
            core.metrics.requests[ErrorCode.BAD_REQUEST] += 1
            text = (
                f"model {model.name!r} cannot generate text: it is an encoder (its attention is bidirectional); "
                "it serves embeddings" + (" and reranking" if model.vocab.pooling == "rank" else "")
            )
            core.reply(identity, envelope, Error(id=msg.id, code=ErrorCode.BAD_REQUEST, message=text, param="model"))
            return
        req = core.accept(identity, envelope, msg)
        if req is None:
            return
        self.models.used(model, msg.keep_alive_s)
        shift_to = core.slot_context() if self.cfg.context_shift else None  # (no ready worker: not shifted)
        work = functools.partial(prepare, msg, model.vocab, model.chat, model.prompts, shift_to=shift_to)
        if text_chars(msg) <= TOKENIZE_INLINE_CHARS:
            try:
                core.prepared(req, work())
            except PrepareError as exc:
                core.prepared(req, exc)
            return

        def done(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled():
                core.prepared(req, fut.exception() or fut.result())
                self._flush()

        asyncio.get_running_loop().run_in_executor(self._tokenizer, work).add_done_callback(done)

    def _on_tokenize(self, identity: bytes, envelope: tuple[bytes, ...], msg: Tokenize | Detokenize, model: ModelCore) -> None:
        """Tokens or text, nothing generated; a long text is tokenized on the tokenizing thread."""
        work = functools.partial(tokens_reply, msg, model.vocab, model.chat)

        def reply(fut: asyncio.Future[Tokens] | None) -> None:
            try:
                answer: Any = work() if fut is None else fut.result()
            except PrepareError as exc:
                answer = Error(id=msg.id, code=ErrorCode.BAD_REQUEST, message=str(exc), param=exc.param)
            except Exception as exc:
                error_id = uuid.uuid4().hex[:12]
                log.exception("tokenize_crashed", error_id=error_id, request_id=msg.id, error=str(exc))
                answer = Error(id=msg.id, code=ErrorCode.INTERNAL, message="internal error", error_id=error_id)
            self.core.reply(identity, envelope, answer)
            if fut is not None:
                self._flush()

        if isinstance(msg, Tokenize) and text_chars(msg) > TOKENIZE_INLINE_CHARS:
            asyncio.get_running_loop().run_in_executor(self._tokenizer, work).add_done_callback(reply)
        else:
            reply(None)

    # ---- worker side ----------------------------------------------------------------------------

    def _worker_frames(self, frames: list[bytes]) -> None:
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
        for core in self.cores:
            core.tick(now)
        self.models.tick(now)
        self._flush()
        if self._backlog:
            self._catch_up(now)
        self._check_drained(now)
        if now >= self._next_status:
            self._next_status = now + STATUS_EVERY_S
            notify(status=self.status_line())
        if self._watchdog_s is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self._watchdog_s
            alive(self.cfg.alive_file)  # (from a tick of the event loop: a stuck loop says nothing)
