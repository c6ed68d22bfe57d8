"""What a job's messages tell the router, besides the reply: a delta's tokens and text for the attempt, and at its
end how the slot's mirror settles, the worker's load and speed, and the request's figures (its timings across
attempts, the record the metrics keep, the log line).
"""

from __future__ import annotations

import time

import numpy as np

from chat.output_parser import Piece
from common import logs
from protocol import JobDelta, JobDone, JobError, Timings, token_array, unpack_tokens
from router.metrics import Metrics, RequestRecord, mispredicted
from router.mirror import Mirror
from router.requests import Req, WorkerConn

log = logs.get(__name__)


def output_began(conn: WorkerConn, req: Req) -> None:
    """The attempt's first token is out: its prompt is computed (no longer this worker's queued prefill), and the
    request can no longer be placed again."""
    attempt = req.attempt
    assert attempt is not None
    attempt.delivered += 1
    if attempt.prefill_pending:
        attempt.prefill_pending = 0
        conn.refresh()


def delta_taken(conn: WorkerConn, req: Req, msg: JobDelta) -> Piece:
    """A delta of the request's running attempt: its tokens kept, its text parsed; the piece for the client."""
    attempt = req.attempt
    assert attempt is not None
    if attempt.prefill_pending:
        attempt.prefill_pending = 0  # the prompt is computed: no longer this worker's queued prefill
        conn.refresh()
    tokens = unpack_tokens(msg.tokens)
    attempt.streamed.extend(tokens)
    attempt.logprobs.extend(msg.logprobs)
    return attempt.parser.feed(msg.text, len(tokens))


def settle_done(mirror: Mirror, metrics: Metrics, min_match: int, conn: WorkerConn, req: Req, msg: JobDone) -> Timings:
    """A job's end, read: the mirror of its slot, the worker's load and prefill speed, the slot's hit figures, the
    request's record. Returns the request's timings."""
    attempt = req.attempt
    assert attempt is not None
    settle_slot(mirror, metrics, req, msg)
    conn.refresh()
    conn.prefilled(msg.prefilled_tokens, msg.timings.prefill_ms)
    if msg.reused_tokens >= min_match:
        attempt.slot.hits += 1
    attempt.slot.reused_total += msg.reused_tokens
    timings = timings_of(req, msg)
    record_done(metrics, conn.id, req, msg, timings)
    return timings


def settle_slot(mirror: Mirror, metrics: Metrics, req: Req, msg: JobDone | JobError) -> None:
    """The slot of the job's attempt holds what the worker says (checked against what the router knows it was sent
    and streamed); a mismatch is counted and logged, and the slot's contents forgotten."""
    attempt = req.attempt
    assert attempt is not None
    slot = attempt.slot
    if isinstance(msg, JobDone):
        generated = token_array(msg.tokens)
        if msg.slot != slot.index:
            mm = mirror.fail(slot, msg.id, req.tokens, generated, True, 0, "not-this-slot")
        else:
            mm = mirror.finish(
                slot,
                msg.id,
                req.tokens,
                generated,
                msg.slot_tokens,
                msg.slot_hash,
                msg.slot_min_keep,
                msg.slot_n_exact,
                msg.slot_cuts,
            )
    else:
        streamed = np.asarray(attempt.streamed, dtype=np.int32)
        touched = msg.slot >= 0
        mm = mirror.fail(
            slot,
            msg.id,
            req.tokens,
            streamed,
            touched,
            msg.slot_tokens,
            msg.slot_hash,
            msg.slot_min_keep,
            msg.slot_n_exact,
            msg.slot_cuts,
        )
    if mm is not None:
        metrics.mirror_mismatches += 1
        via = "job_done" if isinstance(msg, JobDone) else "job_error"
        log.error("mirror_mismatch", **mm.__dict__, reported_slot=msg.slot, via=via)


def timings_of(req: Req, msg: JobDone) -> Timings:
    """The request's timings: the worker's, with the time it queued in the router (all its attempts) added."""
    t = msg.timings
    return Timings(
        queue_ms=req.queue_ms + t.queue_ms,
        prefill_ms=t.prefill_ms,
        decode_ms=t.decode_ms,
        ttft_ms=t.ttft_ms + req.queue_ms,
        total_ms=(time.monotonic() - req.arrived) * 1000,
    )


def record_done(metrics: Metrics, worker: str, req: Req, msg: JobDone, timings: Timings) -> None:
    """Count a finished job in the metrics and log it (with a warning where its reuse was mispredicted)."""
    attempt = req.attempt
    assert attempt is not None
    slot = attempt.slot
    prompt, reused, restored = msg.prompt_tokens, msg.reused_tokens, msg.restored_tokens
    if msg.resumed_reused is not None:  # (a resumed job: the record is of its last placing, the one predicted)
        prompt, reused, restored = prompt + attempt.resumed, msg.resumed_reused, msg.resumed_restored
    if mispredicted(attempt.predicted, reused, restored):
        log.warning("reuse_mispredicted", request_id=req.rid, job=msg.id, predicted=attempt.predicted, actual=reused)
    metrics.finished(
        RequestRecord(
            req.rid, worker, slot.index, prompt, attempt.predicted, reused,
            msg.generated_tokens, msg.finish_reason, timings.ttft_ms, timings.queue_ms, req.attempts,
            restored,
        ),
        count_outcome=not req.ended,
    )  # fmt: skip
    log.info(
        "request_done",
        request_id=req.rid,
        job=msg.id,
        worker=worker,
        slot=slot.index,
        finish_reason=msg.finish_reason,
        predicted_reuse=attempt.predicted,
        reused=reused,
        restored=restored,
        prefilled=msg.prefilled_tokens,
        generated=msg.generated_tokens,
        ttft_ms=round(timings.ttft_ms, 1),
        **({"resumed": attempt.resumed} if attempt.resumed else {}),
    )
