"""router/outcomes.py with plain data: how a job's end settles its slot's mirror, and the request's figures."""

from __future__ import annotations

import time

import numpy as np

from chat.output import OutputSpec
from protocol import JobDone, JobError, Sampling, Timings, pack_tokens, token_hash
from router.metrics import Metrics
from router.mirror import Mirror
from router.outcomes import record_done, settle_slot, timings_of
from router.requests import Attempt, Req

PROMPT = np.arange(1, 11, dtype=np.int32)


def running(mirror: Mirror, predicted: int = 0) -> Req:
    (slot,) = mirror.add_worker("w0", 1)
    req = Req(b"c", [], "r1", Sampling(), False, None, tokens=PROMPT)
    req.attempt = Attempt("j1", "w0", slot, predicted, 10, OutputSpec().parser())
    mirror.assign(slot, "j1", PROMPT)
    return req


def done(slot_tokens: int, slot_hash: str, reused: int = 0, **kw) -> JobDone:
    timings = Timings(queue_ms=2.0, prefill_ms=5.0, decode_ms=7.0, ttft_ms=8.0, total_ms=15.0)
    fields = dict(
        id="j1", slot=0, finish_reason="length", text="", tokens=pack_tokens([77]), prompt_tokens=10,
        reused_tokens=reused, prefilled_tokens=10 - reused, generated_tokens=1, slot_tokens=slot_tokens,
        slot_hash=slot_hash, timings=timings,
    )  # fmt: skip
    return JobDone(**{**fields, **kw})


def test_a_job_done_settles_its_slot_or_counts_a_mismatch():
    mirror, metrics = Mirror(), Metrics()
    req = running(mirror)
    settle_slot(mirror, metrics, req, done(11, token_hash([*range(1, 11), 77]), slot_n_exact=9))
    slot = req.attempt.slot
    assert slot.tokens.tolist() == [*range(1, 11), 77] and slot.n_exact == 9 and metrics.mirror_mismatches == 0

    req = running(Mirror())
    settle_slot(mirror, metrics, req, done(11, "not-what-it-holds"))
    assert metrics.mirror_mismatches == 1 and req.attempt.slot.dirty


def test_a_job_error_that_never_touched_the_slot_leaves_what_it_held():
    mirror, metrics = Mirror(), Metrics()
    req = running(mirror)
    settle_slot(mirror, metrics, req, done(11, token_hash([*range(1, 11), 77])))  # an earlier job left 11 tokens
    mirror.assign(req.attempt.slot, "j2", np.arange(50, 60, dtype=np.int32))
    settle_slot(mirror, metrics, req, JobError(id="j2", code="internal", message="x"))  # (slot -1: not touched)
    assert metrics.mirror_mismatches == 0 and req.attempt.slot.tokens.tolist() == [*range(1, 11), 77]


def test_the_timings_add_the_routers_queue_and_the_record_is_counted():
    mirror, metrics = Mirror(), Metrics()
    req = running(mirror, predicted=4)
    req.queue_ms, req.arrived, req.attempts = 3.0, time.monotonic() - 1.0, 1
    msg = done(11, token_hash([*range(1, 11), 77]), reused=4, restored_tokens=0)
    timings = timings_of(req, msg)
    assert (timings.queue_ms, timings.ttft_ms, timings.prefill_ms) == (5.0, 11.0, 5.0) and timings.total_ms >= 1000
    record_done(metrics, "w0", req, msg, timings)
    assert metrics.reused_tokens == metrics.predicted_reuse_tokens == 4 and metrics.reuse_mispredictions == 0
    assert metrics.requests["length"] == 1
