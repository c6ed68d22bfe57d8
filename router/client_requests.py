"""A client's messages in the router process: each to its handler, which finds the model it names, prepares its
work on the preparing threads (router/preparing.py: the owners take turns; router/prepare.py bounds the cost) and
hands the outcome to that model's core (router/scheduler.py). Handling one that raises ends that request alone (an
`internal` error carrying its id and an error id for the log: Scheduler.crashed frees what it held).

Called by the shell (router/server.py) through the client intake (router/intake.py), on the event loop.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from chat.limits import Deadline, DeadlinePassed
from common import logs
from protocol import (
    Cancel,
    Detokenize,
    Embed,
    Error,
    ErrorCode,
    Invalid,
    MetricsReply,
    MetricsRequest,
    Refusal,
    Rerank,
    StatusRequest,
    Submit,
    Tokenize,
    Tokens,
    kind_of,
)
from router import admission, exposition
from router.config import RouterConfig
from router.models import ModelCore, Models, status
from router.prepare import Prepared, PrepareError, embed_inputs, prepare, rerank_inputs, tokens_reply
from router.preparing import SMALL_BYTES, SMALL_COST_S, Preparing
from router.scheduler import Scheduler

log = logs.get(__name__)

NO_MODEL = frozenset({Invalid, Cancel, StatusRequest, MetricsRequest})  # client messages that name no model


def owner_of(identity: bytes, msg: Submit | Tokenize | Detokenize | Embed | Rerank) -> str | bytes:
    """Whose share of the preparing threads a request counts against: the owner an HTTP front names (its API key's
    digest), else the ZMQ client that sent it."""
    return msg.owner or identity


class ClientRequests:
    """The handlers of a client's messages, over the served models (`models`; `core`: the default one's, which
    answers what names no model) and the preparing threads."""

    def __init__(
        self,
        cfg: RouterConfig,
        models: Models,
        core: Scheduler,
        preparing: Preparing,
        prepare_submit: Callable[..., Prepared] = prepare,
    ) -> None:
        self.cfg, self.models, self.core, self.preparing = cfg, models, core, preparing
        self.prepare_submit = prepare_submit  # (router/prepare.py `prepare`; the shell's, which a test replaces)
        self.handlers = dict(self.CLIENT_HANDLERS)  # (a test takes one out)

    @property
    def cores(self) -> list[Scheduler]:
        return [m.core for m in self.models]

    def handle(self, identity: bytes, envelope: tuple[bytes, ...], msg: Any, size: int = 0) -> None:
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
        name = self.handlers.get(type(msg))
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
            refusal = Refusal(ErrorCode.NOT_FOUND, self.models.unknown(msg.model or ""), param="model")
            self.core.refuse(identity, envelope, msg.id, refusal)
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
        first characters). Never one with an image: a few kB of PNG may unpack to megapixels that the projector's
        preprocessing resizes (the tiny Qwen2-VL projector's rows of 1 x 40,000 pixels: 12,800)."""
        if size > SMALL_BYTES:
            return False
        if isinstance(msg, Submit) and any(m.images() for m in msg.messages or ()):
            return False
        return model.prompts.cost.seconds(msgspec.msgpack.encode(msg).decode("latin-1"), exact=False) <= SMALL_COST_S

    def decode_off_loop(self, identity: bytes, size: int, work: Callable[[], Any], then: Callable[[Any], None]) -> None:
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
                self.core.refuse(identity, envelope, rid, Refusal(ErrorCode.BAD_REQUEST, str(outcome), param=outcome.param))
            elif isinstance(outcome, admission.Busy):  # (its refusal is a `queue_full`)
                self.core.refuse(identity, envelope, rid, outcome.refusal)
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
            core.refuse(identity, envelope, msg.id, refusal)
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
        owner = owner_of(identity, msg)
        refusal = admission.not_generative(model.name, model.vocab.causal, model.vocab.pooling)
        if refusal is not None or (refusal := self.preparing.admit(owner, "submit", size)) is not None:
            core.refuse(identity, envelope, msg.id, refusal)
            return
        req = core.accept(identity, envelope, msg)
        if req is None:
            return
        self.models.used(model, msg.keep_alive_s)
        shift_to = core.slot_context() if self.cfg.context_shift else None  # (no ready worker: not shifted)

        def work(deadline: Deadline) -> Prepared:  # (the deadline counts from the submit's arrival)
            return self.prepare_submit(msg, model.vocab, model.chat, model.prompts, shift_to=shift_to, deadline=deadline)

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
