"""Embed requests in the router's core (router/embeds.py): placed on the ready worker with the least work, answered
from the worker's vectors, failed with a reason when the worker fails or dies; the mirror is not touched."""

from __future__ import annotations

import time

from scheduler_helpers import CLIENT, core, hello, jobs, submit, to_client

from protocol import Embed, Embeddings, EmbedDone, EmbedJob, Error, ErrorCode, JobError, unpack_tokens
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
