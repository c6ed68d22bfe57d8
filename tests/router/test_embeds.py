"""Embed requests in the router's core (router/embeds.py): placed on the ready worker with the least work, answered
from the worker's vectors, failed with a reason when the worker fails or dies; the mirror is not touched."""

from __future__ import annotations

import time

from scheduler_helpers import CLIENT, core, hello, jobs, submit, to_client

from protocol import Embed, Embeddings, EmbedDone, EmbedJob, Error, ErrorCode, JobCancel, JobError, Rerank, unpack_tokens
from router.scheduler import Out, Scheduler


def embed(s: Scheduler, rid: str = "e", inputs: list[list[int]] | None = None) -> list[Out]:
    given = inputs or [[2, 10, 11], [2, 12]]
    s.embed(CLIENT, (), Embed(id=rid, input=["x"] * len(given)), given)
    return s.take()


def test_an_embed_goes_to_the_worker_with_the_least_work_and_its_vectors_come_back() -> None:
    s = core()
    hello(s, "w0", slots=1)
    hello(s, "w1", slots=1)
    (running,) = jobs(submit(s, "a"))  # one worker's slot is busy now
    out = embed(s)
    (job,) = [o.msg for o in out if isinstance(o.msg, EmbedJob)]
    (to,) = [o.to for o in out if isinstance(o.msg, EmbedJob)]
    assert to.decode() != s.jobs[running.id].worker  # the other one
    assert [unpack_tokens(t) for t in job.inputs] == [[2, 10, 11], [2, 12]] and job.pooling == "mean"
    s.worker_message(to, EmbedDone(id=job.id, vectors=[bytes(8), bytes(8)], dims=2))
    (reply,) = to_client(s.take(), Embeddings)
    assert (reply.id, reply.dims, reply.prompt_tokens, len(reply.vectors)) == ("e", 2, 5, 2) and not s.embeds.running


def test_a_failed_or_lost_embed_ends_with_the_reason() -> None:
    s = core()
    hello(s, "w0")
    (job,) = [o.msg for o in embed(s, "e1") if isinstance(o.msg, EmbedJob)]
    s.worker_message(b"w0", JobError(id=job.id, code=ErrorCode.BAD_REQUEST, message="input 1 has 9000 tokens"))
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("e1", ErrorCode.BAD_REQUEST) and "9000" in err.message
    embed(s, "e2")
    s.worker_dead("w0", "test")
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("e2", ErrorCode.WORKER_LOST)


def test_with_no_worker_an_embed_waits_as_a_queued_request_does() -> None:
    s = core()
    assert not embed(s, "e1") and len(s.embeds.waiting) == 1  # (a model loading on demand: its worker is coming)
    (job,) = [o.msg for o in hello(s, "w0") if isinstance(o.msg, EmbedJob)]  # placed when one says hello
    assert job.id.startswith("e1.") and not s.embeds.waiting
    s.draining = True
    (err,) = to_client(embed(s, "e2"), Error)
    assert err.code == ErrorCode.DRAINING  # refused at once


def test_a_waiting_embed_fails_when_a_queued_request_would() -> None:
    s = core()
    s.table.expected = {"w0"}
    assert not embed(s, "e1")
    s.worker_failed("w0", "its model file is bad")  # no worker will come
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("e1", ErrorCode.NO_WORKERS) and "its model file is bad" in err.message
    s = core(no_workers_grace_s=0.05)
    assert not embed(s, "e2")
    time.sleep(0.06)
    s.tick(time.monotonic())  # none connected for the grace
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("e2", ErrorCode.NO_WORKERS) and "no worker connected" in err.message


def embed_job(out: list[Out]) -> tuple[EmbedJob, bytes]:
    (o,) = [o for o in out if isinstance(o.msg, EmbedJob)]
    return o.msg, o.to


def cancels(out: list[Out]) -> list[tuple[bytes, str]]:
    return [(o.to, o.msg.id) for o in out if o.worker and isinstance(o.msg, JobCancel)]


def test_a_cancel_answers_at_once_and_stops_the_job_on_its_worker() -> None:
    s = core()
    hello(s, "w0")
    job, to = embed_job(embed(s, "e1"))
    s.cancel(CLIENT, "e1")
    out = s.take()
    (err,) = to_client(out, Error)
    assert (err.id, err.code) == ("e1", ErrorCode.CANCELLED) and cancels(out) == [(b"w0", job.id)]
    assert s.embeds.running, "its worker's work until the job's end comes"
    s.worker_message(to, JobError(id=job.id, code=ErrorCode.CANCELLED, message="cancelled after 1 of 2 inputs"))
    assert not s.take() and not s.embeds.running  # (answered already)
    s.cancel(CLIENT, "e1")  # (an id no longer in flight: nothing)
    assert not s.take()


def test_a_waiting_embed_cancelled_or_its_client_gone_leaves_the_queue() -> None:
    s = core()
    embed(s, "e1")
    embed(s, "e2")
    s.cancel(CLIENT, "e1")
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("e1", ErrorCode.CANCELLED) and [w.rid for w in s.embeds.waiting] == ["e2"]
    s.client_gone(CLIENT)
    assert not s.take() and not s.embeds.waiting


def test_a_gone_client_has_its_running_embed_stopped_on_its_worker_silently() -> None:
    s = core()
    hello(s, "w0")
    job, to = embed_job(embed(s, "e1"))
    s.client_gone(CLIENT)
    out = s.take()
    assert cancels(out) == [(b"w0", job.id)] and not to_client(out, Error)
    s.worker_message(to, EmbedDone(id=job.id, vectors=[bytes(8), bytes(8)], dims=2))  # (it was done first)
    assert not s.take() and not s.embeds.running


def test_a_running_embed_past_its_deadline_fails_and_its_job_is_cancelled() -> None:
    s = core()
    hello(s, "w0")
    s.embed(CLIENT, (), Embed(id="e1", input=["x"], deadline_ms=50), [[2, 10]])
    job, to = embed_job(s.take())
    s.tick(time.monotonic())
    assert not s.take(), "before its deadline nothing happens"
    time.sleep(0.06)
    s.tick(time.monotonic())
    out = s.take()
    (err,) = to_client(out, Error)
    assert (err.id, err.code) == ("e1", ErrorCode.DEADLINE_EXCEEDED) and cancels(out) == [(b"w0", job.id)]
    s.tick(time.monotonic())
    assert not s.take(), "stopped once"
    s.worker_message(to, JobError(id=job.id, code=ErrorCode.CANCELLED, message="cancelled"))
    assert not s.take() and not s.embeds.running


def test_a_waiting_embed_past_its_deadline_fails() -> None:
    s = core()
    s.embed(CLIENT, (), Embed(id="late", input=["x"], deadline_ms=50), [[2, 10]])  # (no worker: it waits)
    s.tick(time.monotonic())
    assert not s.take() and s.embeds.waiting
    s.tick(time.monotonic() + 0.06)
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("late", ErrorCode.DEADLINE_EXCEEDED) and not s.embeds.waiting


def test_embeds_are_admitted_against_the_queue_and_counted_in_it() -> None:
    s = core(queue_size=2)
    assert not embed(s, "e1") and not embed(s, "e2")  # (no worker: both wait, filling the queue)
    (err,) = to_client(embed(s, "e3"), Error)
    assert (err.id, err.code) == ("e3", ErrorCode.QUEUE_FULL) and err.retry_after_ms
    (err,) = to_client(submit(s, "a"), Error)
    assert (err.id, err.code) == ("a", ErrorCode.QUEUE_FULL), "waiting embeds count in the submits' queue too"
    assert s.metrics.requests[ErrorCode.QUEUE_FULL] == 2


def test_an_owner_holds_at_most_its_share_of_the_queue_with_embeds_too() -> None:
    s = core(queue_size=8, queue_share=0.5)

    def owned_embed(rid: str, owner: str, rerank: bool = False) -> list[Out]:
        msg = Rerank(id=rid, query="q", documents=["d"], owner=owner) if rerank else Embed(id=rid, input=["x"], owner=owner)
        s.embed(CLIENT, (), msg, [[2, 10]])
        return s.take()

    refused = next(i for i in range(8) if owned_embed(f"a{i}", "key-a", rerank=i % 2 == 1))
    assert 0 < refused < 7 and len(s.embeds.waiting) == refused, "its share is full before the queue is"
    (err,) = to_client(owned_embed("a-more", "key-a"), Error)
    assert err.code == ErrorCode.QUEUE_FULL and "API key" in err.message
    (err,) = to_client(submit(s, "a-submit", owner="key-a"), Error)
    assert err.code == ErrorCode.QUEUE_FULL and "API key" in err.message, "its waiting embeds count for its submits"
    assert not owned_embed("b1", "key-b"), "another owner still gets in"


def test_a_dead_workers_embed_jobs_are_cancelled_there_too() -> None:
    s = core()
    hello(s, "w0")
    job, _ = embed_job(embed(s, "e1"))
    s.worker_dead("w0", "test")
    out = s.take()
    assert cancels(out) == [(b"w0", job.id)] and to_client(out, Error)[0].code == ErrorCode.WORKER_LOST
