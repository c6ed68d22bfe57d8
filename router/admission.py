"""A client request's admission: what it is refused for, before and after its prompt is prepared, and its caps.

Pure checks (router/scheduler.py acts on them): a refusal is a `protocol.Refusal`, the worker's shape too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec

from common import logs
from protocol import Error, ErrorCode, Overflow, Refusal, Sampling
from router.prepare import PrepareError
from router.requests import Req
from router.workers import WorkerTable

log = logs.get(__name__)

# logprob entries (a token's own and its alternatives) one reply may carry, all choices together: each is ~100 bytes
# in the router and the client, and more in JSON; n=16 x 20 alternatives x 32k tokens would be gigabytes
MAX_REPLY_LOGPROBS = 1 << 19
RETRY_AFTER_MS = 1000  # what a `queue_full` tells the client to wait


def at_submit(
    draining: bool, repeated_id: str | None, waiting: int, n: int, limit: int, owned: int = 0, share: int = 0
) -> Refusal | None:
    """Why a submit of `n` choices is refused as it arrives: the router is draining, its id (`repeated_id`) is in
    flight already, `waiting` requests are ahead of it (queued or being tokenized: a flood of long prompts cannot
    pile up behind the tokenizer either), or its owner has `owned` requests in flight already and may have `share`
    (0: no share)."""
    if draining:
        return Refusal(ErrorCode.DRAINING, "the router is shutting down")
    if repeated_id is not None:
        return Refusal(ErrorCode.BAD_REQUEST, f"request id {repeated_id!r} is already in flight")
    if waiting + n > max(limit, n):
        return Refusal(ErrorCode.QUEUE_FULL, f"{waiting} requests are already waiting", retry_after_ms=RETRY_AFTER_MS)
    if share and owned + n > max(share, n):
        text = (
            f"{owned} requests of this API key are already waiting or running: its share of the queue and the slots "
            f"is {share} (--queue-share)"
        )
        return Refusal(ErrorCode.QUEUE_FULL, text, retry_after_ms=RETRY_AFTER_MS)
    return None


class Busy(Exception):
    """A request refused, or dropped after waiting too long, for want of a preparing thread (router/preparing.py):
    its `refusal` is the answer (`queue_full`)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


MAX_REPLY_ENDPOINTS = 4  # reply endpoints one client's requests in flight may name (a client binds one)


def not_generative(name: str, causal: bool, pooling: str | None) -> Refusal | None:
    """Why model `name` cannot take a submit: an encoder (its attention is bidirectional), whose slots would hold no
    KV to generate from; None when it can."""
    if causal:
        return None
    also = " and reranking" if pooling == "rank" else ""
    text = f"model {name!r} cannot generate text: it is an encoder (its attention is bidirectional); it serves embeddings{also}"
    return Refusal(ErrorCode.BAD_REQUEST, text, param="model")


def not_reranker(name: str, pooling: str | None) -> Refusal | None:
    """Why model `name` cannot rerank: its GGUF does not declare rank pooling; None when it can."""
    if pooling == "rank":
        return None
    declared = f"declares {pooling} pooling" if pooling else "declares no pooling"
    text = (
        f"model {name!r} is not a reranker: its GGUF {declared}, and reranking needs a model with rank pooling (a "
        "cross-encoder such as bge-reranker or jina-reranker, or Qwen3-Reranker)"
    )
    return Refusal(ErrorCode.BAD_REQUEST, text, param="model")


def reply_to_problem(reply_to: str, in_use: set[str]) -> str | None:
    """Why a submit's `reply_to` is not an endpoint workers may be told to connect to: not tcp://HOST:PORT (a port,
    not a wildcard host) or ipc://PATH, or one more than MAX_REPLY_ENDPOINTS for this client (`in_use`: those its
    requests in flight name). None when it is."""
    scheme, _, rest = reply_to.partition("://")
    if scheme == "ipc":
        ok = bool(rest)
    elif scheme == "tcp":
        host, _, port = rest.rpartition(":")
        ok = port.isdigit() and 0 < int(port) < 65536 and host.strip("[]") not in ("", "*", "0.0.0.0", "::")
    else:
        ok = False
    if not ok:
        return f"`reply_to` {reply_to[:80]!r} is not an endpoint workers can connect to: tcp://HOST:PORT or ipc://PATH"
    if reply_to not in in_use and len(in_use) >= MAX_REPLY_ENDPOINTS:
        return f"this client's requests name {len(in_use)} reply endpoints already; at most {MAX_REPLY_ENDPOINTS}"
    return None


def when_prepared(req: Req, workers: WorkerTable, queued: int, grace_s: float) -> Refusal | None:
    """Why a request with its prompt ready cannot be queued, or None."""
    if not len(req.tokens):
        return Refusal(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
    ready = workers.ready()
    if not ready and workers.none_for(grace_s):
        return Refusal(ErrorCode.NO_WORKERS, "no worker is connected")
    if ready and not any(w.fits(req) for w in ready):
        return overflow_refusal(req, max(w.hello.ctx_per_slot for w in ready))
    if ready and (too_large := reply_too_large(req, max(w.hello.ctx_per_slot for w in ready))) is not None:
        return Refusal(ErrorCode.BAD_REQUEST, too_large, param="logprobs")
    if queued + req.n > max(workers.queue_limit(), req.n):
        return Refusal(ErrorCode.QUEUE_FULL, f"{queued} requests are already waiting", retry_after_ms=RETRY_AFTER_MS)
    return None


def reply_too_large(req: Req, ctx: int) -> str | None:
    """Why the reply a request may make is too large to build (its logprobs, at most as many tokens as it may
    generate, or as fit beside its prompt), or None."""
    k = req.sampling.logprobs
    if k is None:
        return None
    room = max(0, ctx - len(req.tokens))
    tokens = room if req.sampling.max_tokens is None else min(req.sampling.max_tokens, room)
    entries = req.n * tokens * (1 + k)
    if entries <= MAX_REPLY_LOGPROBS:
        return None
    return (
        f"the reply could hold {entries} logprobs (n={req.n} x up to {tokens} tokens x {1 + k}: each token's and its top "
        f"{k}), more than the {MAX_REPLY_LOGPROBS} one reply may carry; ask for fewer choices, fewer top logprobs or "
        "a smaller max_tokens"
    )


def prepare_failed(req: Req, exc: BaseException) -> Error:
    """The reply to a request whose prompt could not be prepared: the client's mistake, named, or an internal error
    with an id (logged)."""
    if isinstance(exc, PrepareError):
        return Refusal(ErrorCode.BAD_REQUEST, str(exc), param=exc.param).error(req.rid)
    if isinstance(exc, Busy):
        return exc.refusal.error(req.rid)
    error_id = uuid.uuid4().hex[:12]
    log.error("tokenize_crashed", error_id=error_id, request_id=req.rid, error=repr(exc))
    return Error(id=req.rid, code=ErrorCode.INTERNAL, message="internal error", error_id=error_id)


def defaulted(sampling: Sampling, unset: Sequence[str], defaults: dict[str, float | int]) -> Sampling:
    """The fields a request left to the server (`sampling_unset`) get the model's defaults (router/sampling_defaults.py)."""
    given = {k: defaults[k] for k in unset if k in defaults}
    return msgspec.structs.replace(sampling, **given) if given else sampling


def open_capped(sampling: Sampling, cap: int, room: int) -> Sampling:
    """--default-max-tokens: a request that set no output cap gets this many at most (never more than the slot's
    `room` after its prompt, which it would get without one)."""
    if cap > 0 and sampling.max_tokens is None and room > cap:
        return msgspec.structs.replace(sampling, max_tokens=cap)
    return sampling


def capped(sampling: Sampling, cap: int) -> Sampling:
    """--max-tokens: a request asking for more (or for no limit) gets the cap."""
    if cap > 0 and (sampling.max_tokens is None or sampling.max_tokens > cap):
        return msgspec.structs.replace(sampling, max_tokens=cap)
    return sampling


def overflow_refusal(req: Req, ctx: int) -> Refusal:
    """A context overflow: its numbers, and its words made from them (each API words its own message from the
    numbers); what --context-shift dropped, if it tried."""
    numbers = Overflow(prompt_tokens=len(req.tokens), max_tokens=req.sampling.max_tokens, context=ctx)
    s = req.shift
    shifted = f" (after --context-shift dropped {s.messages} messages, {s.tokens} tokens)" if s is not None else ""
    return Refusal(ErrorCode.CONTEXT_OVERFLOW, numbers.message(shifted), overflow=numbers)
