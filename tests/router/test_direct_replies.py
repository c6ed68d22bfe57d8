"""Direct replies in the router's core (PROTOCOL.md 4.4): a request whose client gave `reply_to` is placed with it, its
client gets `placed` and nothing per token, and the router still keeps the mirror exact from the job's first delta and
its end."""

from __future__ import annotations

from scheduler_helpers import CLIENT, PROMPT, core, done, hello, jobs, submit, to_client

from protocol import Delta, Error, ErrorCode, JobDelta, JobError, Placed, Result, pack_tokens, token_hash, unpack_tokens

REPLY = "tcp://127.0.0.1:40000"


def test_the_job_carries_reply_to_and_the_client_learns_where_its_output_comes_from() -> None:
    s = core()
    hello(s)
    out = submit(s, "a", reply_to=REPLY)
    (job,) = jobs(out)
    assert job.reply_to == REPLY and job.reply_key == ""
    (placed,) = to_client(out, Placed)
    assert (placed.id, placed.job, placed.worker, placed.slot) == ("a", job.id, "w0", job.slot)
    assert placed.prompt_tokens == len(PROMPT) and placed.format.family == "" and s.metrics.direct_jobs == 1


def test_no_token_goes_through_the_router_and_the_mirror_still_settles() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s, "a", reply_to=REPLY))
    s.worker_message(b"w0", JobDelta(id=job.id, text="", tokens=b"", reused_tokens=0))  # output began
    assert not s.take()
    req = s.requests[(CLIENT, "a", 0)]
    assert req.started and req.attempt is not None and req.attempt.prefill_pending == 0
    out = done(s, job, [7, 8, 9])
    assert not to_client(out, Result) and not to_client(out, Delta)  # the client makes the result from the worker's
    slot = s.mirror.workers["w0"][job.slot]
    assert list(slot.tokens) == [*PROMPT.tolist(), 7, 8] and s.metrics.mirror_mismatches == 0
    assert not s.requests


def test_a_failed_job_reports_its_tokens_for_the_mirror() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s, "a", reply_to=REPLY))
    s.worker_message(b"w0", JobDelta(id=job.id, text="", tokens=b"", reused_tokens=0))
    held = [*unpack_tokens(job.tokens), 7]
    err = JobError(id=job.id, code=ErrorCode.INTERNAL, message="boom", slot=job.slot, slot_tokens=len(held))
    err.slot_hash, err.tokens = token_hash(held), pack_tokens([7, 8])
    s.worker_message(b"w0", err)
    (error,) = to_client(s.take(), Error)
    assert error.id == "a" and error.code == ErrorCode.INTERNAL
    assert list(s.mirror.workers["w0"][job.slot].tokens) == held and s.metrics.mirror_mismatches == 0


def test_a_request_whose_worker_died_before_output_is_placed_again_and_the_client_told_again() -> None:
    s = core()
    hello(s, "w0")
    (first,) = jobs(submit(s, "a", reply_to=REPLY))
    hello(s, "w1")
    s.worker_dead("w0", "test")
    out = s.take()
    (again,) = jobs(out)
    (placed,) = to_client(out, Placed)
    assert placed.job == again.id != first.id and placed.worker == "w1" and again.reply_to == REPLY


def test_one_whose_output_began_fails_when_its_worker_dies() -> None:
    s = core()
    hello(s, "w0")
    (job,) = jobs(submit(s, "a", reply_to=REPLY))
    s.worker_message(b"w0", JobDelta(id=job.id, text="", tokens=b"", reused_tokens=0))
    s.worker_dead("w0", "test")
    (error,) = to_client(s.take(), Error)
    assert error.code == ErrorCode.WORKER_LOST and (CLIENT, "a", 0) not in s.requests


def test_several_choices_keep_their_replies_on_the_router() -> None:
    s = core()
    hello(s)
    out = submit(s, "a", reply_to=REPLY, n=2)
    assert not to_client(out, Placed) and all(j.reply_to == "" for j in jobs(out))
    for job in jobs(out):
        result = to_client(done(s, job, [5, 6]), Result)
    assert result and len(result[0].choices) == 2


def test_a_suspended_job_whose_client_reads_its_output_goes_on_under_the_same_placing() -> None:
    """Its client keeps reading the same job from the same worker: no second `placed` (which would tell it that its
    job's worker stopped after output began), and the mirror settles from the tokens the worker reports."""
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (bg,) = jobs(submit(s, "bg", PROMPT, reply_to=REPLY))
    s.worker_message(b"w0", JobDelta(id=bg.id, text="", tokens=b"", reused_tokens=0))  # output began
    s.take()
    out = submit(s, "fg", PROMPT + 1000, priority=1)
    assert [o.msg.preempt for o in out if o.worker and type(o.msg).__name__ == "JobCancel"] == [True]
    held = [*PROMPT.tolist(), 7]
    suspended = JobError(
        id=bg.id, code=ErrorCode.PREEMPTED, message="suspended", suspended=True, tokens=pack_tokens([7, 8]),
        slot=bg.slot, slot_tokens=len(held), slot_hash=token_hash(held),
    )  # fmt: skip
    s.worker_message(b"w0", suspended)
    (fg,) = jobs(s.take())
    out = done(s, fg, [1])
    (resumed,) = jobs(out)
    assert resumed.id == bg.id and resumed.resume and resumed.reply_to == REPLY
    assert unpack_tokens(resumed.tokens) == [*PROMPT.tolist(), 7, 8] and not to_client(out, Placed)
    done(s, bg, [7, 8, 9])  # (the worker's end: all it generated)
    assert s.metrics.mirror_mismatches == 0 and not s.requests and s.metrics.direct_jobs == 1  # (one job)
