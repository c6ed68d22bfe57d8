"""A worker reporting to two routers (`--connect A,B`, worker/links.py): each job's messages go to its own router; the
other router hears that the slot was taken and, when the job ends, what the slot holds and the saved states that
changed; a job naming a slot the other router's job holds is refused with slot_busy and never reaches the engine."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from protocol import (
    Accept,
    CacheEntry,
    Drain,
    ErrorCode,
    Job,
    JobDone,
    JobError,
    SlotTaken,
    SlotUpdate,
    Timings,
    encode,
    pack_tokens,
    token_hash,
    unpack_tokens,
    worker_to_router_decoder,
)
from worker.config import WorkerConfig
from worker.links import LINGER_MS, RouterLink
from worker.main import WorkerServer

DECODER = worker_to_router_decoder()


def received(router: zmq.Socket) -> list[Any]:
    got = []
    while router.poll(100):
        got.append(DECODER.decode(router.recv_multipart()[-1]))
    return got


def job(rid: str, slot: int) -> Job:
    return Job(id=rid, slot=slot, tokens=pack_tokens([1, 2, 3]))


def end(rid: str, slot: int, **fields: Any) -> JobDone:
    return JobDone(
        id=rid, slot=slot, finish_reason="length", text="", tokens=b"", prompt_tokens=3, reused_tokens=0,
        prefilled_tokens=3, generated_tokens=0, slot_tokens=3, slot_hash=token_hash([1, 2, 3]), timings=Timings(), **fields,
    )  # fmt: skip


def test_two_routers_each_get_their_jobs_and_hear_of_the_others_changes() -> None:
    ctx = zmq.Context()
    routers = []
    for name in ("a", "b"):
        r = ctx.socket(zmq.ROUTER)
        r.bind(f"inproc://router-{name}")
        routers.append(r)
    submitted: list[str] = []
    slots = [
        SimpleNamespace(tokens=[1, 2, 3, 4], n_exact=0, salt="", checkpoints=[]),
        SimpleNamespace(tokens=[], n_exact=0, salt="", checkpoints=[]),
    ]
    engine = SimpleNamespace(
        vocab=SimpleNamespace(path="/nonexistent.gguf"),
        after_step=None,
        submit=lambda j, sink: submitted.append(j.id),
        core=SimpleNamespace(table=slots, prefixes=SimpleNamespace(min_keep=lambda s: 0)),
    )
    cfg = WorkerConfig(model="/nonexistent.gguf", connect="inproc://router-a,inproc://router-b")
    server = WorkerServer(cfg, engine, ctx)  # type: ignore[arg-type]
    a, b = server.links
    ra, rb = routers
    server.ready_sent = True  # (no systemd here)
    try:
        for link, rid in ((a, "ra"), (b, "rb")):
            server.on_frame(link, encode(Accept(worker_id="w0", router_id=rid, features=["job_deltas", "slot_notices"])))
        server.take_job(a, job("x.ra.1", 0))
        assert submitted == ["x.ra.1"]
        assert received(rb) == [SlotTaken(slot=0, epoch=1)] and received(ra) == []

        server.take_job(b, job("y.rb.1", 0))  # slot 0 runs router a's job: refused at once, the engine never sees it
        (refusal,) = received(rb)
        assert isinstance(refusal, JobError) and refusal.code == ErrorCode.SLOT_BUSY and refusal.slot == -1
        assert submitted == ["x.ra.1"]

        saved = CacheEntry(id=9, n_tokens=2, hash=token_hash([7, 7]), nbytes=10, tokens=pack_tokens([7, 7]))
        server.sink_for(a)(end("x.ra.1", 0, cache_added=[saved], cache_dropped=[4]))  # (on the compute thread)
        server._forward()
        (own,) = received(ra)
        assert isinstance(own, JobDone) and own.id == "x.ra.1"
        (update,) = received(rb)
        assert isinstance(update, SlotUpdate) and (update.slot, update.epoch) == (0, 1)
        assert unpack_tokens(update.tokens) == [1, 2, 3, 4] and update.cache_added == [saved] and update.cache_dropped == [4]

        server.take_job(b, job("y.rb.2", 0))  # free again: router b's now, and router a hears it
        assert submitted == ["x.ra.1", "y.rb.2"]
        assert received(ra) == [SlotTaken(slot=0, epoch=2)]
        server.on_frame(a, encode(Job(id="y.rb.2", slot=1, tokens=pack_tokens([1]))))  # another router's id
        (dup,) = received(ra)
        assert isinstance(dup, JobError) and dup.code == ErrorCode.BAD_REQUEST and submitted == ["x.ra.1", "y.rb.2"]
    finally:
        for link in server.links:
            link.dealer.close(0)
        for r in routers:
            r.close(0)
        server.pull.close(0)
        ctx.destroy(linger=0)


def test_each_job_on_a_slot_has_its_own_epoch_and_frees_the_slot_before_its_router_hears_it_ended() -> None:
    ctx = zmq.Context()
    rb = ctx.socket(zmq.ROUTER)
    rb.bind("inproc://router-b2")
    slots = [SimpleNamespace(tokens=[5, 6], n_exact=0, salt="", checkpoints=[])]
    engine = SimpleNamespace(
        vocab=SimpleNamespace(path="/nonexistent.gguf"),
        after_step=None,
        submit=lambda j, sink: None,
        core=SimpleNamespace(table=slots, prefixes=SimpleNamespace(min_keep=lambda s: 0)),
    )
    cfg = WorkerConfig(model="/nonexistent.gguf", connect="inproc://router-a2,inproc://router-b2")
    server = WorkerServer(cfg, engine, ctx)  # type: ignore[arg-type]
    server.ready_sent = True
    a, b = server.links
    try:
        for link in (a, b):
            server.on_frame(link, encode(Accept(worker_id="w0", router_id=f"r{link.index}", features=["slot_notices"])))
        server.take_job(a, job("x.ra.1", 0))
        server.take_job(a, job("x.ra.2", 0))  # router a's second job waits behind its first on the slot
        assert received(rb) == [SlotTaken(slot=0, epoch=1), SlotTaken(slot=0, epoch=2)]
        claimed_when_pushed = []
        push = server.outbox.push_out

        def push_noting(link: Any, frame: bytes) -> None:
            if link is a:  # what is claimed when router a is told of its job's end
                claimed_when_pushed.append(server.claims.claimed())
            push(link, frame)

        server.outbox.push_out = push_noting  # type: ignore[method-assign]
        server.sink_for(a)(end("x.ra.1", 0))
        server._forward()
        (update,) = received(rb)
        assert isinstance(update, SlotUpdate) and (update.slot, update.epoch) == (0, 1)  # the slot as the first left it
        server.sink_for(a)(end("x.ra.2", 0))
        server._forward()
        assert [u.epoch for u in received(rb)] == [2]
        assert claimed_when_pushed == [{0}, set()]  # freed before router a hears its job ended (it may send the next)
    finally:
        for link in server.links:
            link.dealer.close(0)
        rb.close(0)
        server.pull.close(0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("connect", ["", " , ", "tcp://a:1,tcp://a:1"])
def test_a_connect_list_without_routers_or_with_one_twice_is_refused(connect: str) -> None:
    with pytest.raises(ValueError, match="--connect"):
        WorkerConfig(model="/nonexistent.gguf", connect=connect)


def test_a_message_with_no_handler_is_answered_with_an_error_naming_its_type() -> None:
    """The dispatch table ends in an explicit error: a message type the decoder reads and no handler takes (here one
    taken out of the table) is logged, counted and answered, never ignored."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://router-u")
    engine = SimpleNamespace(vocab=SimpleNamespace(path="/nonexistent.gguf"), after_step=None)
    server = WorkerServer(WorkerConfig(model="/nonexistent.gguf", connect="inproc://router-u"), engine, ctx)  # type: ignore[arg-type]
    (link,) = server.links
    try:
        del server.handlers[Drain]
        assert server.on_frame(link, encode(Drain())) is None
        assert server.unknown_messages == 1
        (err,) = received(router)
        assert isinstance(err, JobError) and err.code == ErrorCode.BAD_REQUEST and "'drain'" in err.message
    finally:
        link.dealer.close(0)
        router.close(0)
        server.pull.close(0)
        ctx.destroy(linger=0)


def test_a_link_whose_router_is_gone_closes_at_once_and_one_still_there_gets_what_waits() -> None:
    """`kvroute serve` stops its router before its workers: a worker's last heartbeat to it can never leave, and the
    close waited LINGER_MS (500 ms) for it on every stop. A link knows its router is gone from its socket's events."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    links = [RouterLink.open(i, f"tcp://127.0.0.1:{port}", ctx, f"w{i}", None, None) for i in range(2)]
    try:
        for link in links:
            link.dealer.send(b"hello")
        assert [router.recv_multipart()[1] for _ in links] == [b"hello", b"hello"]
        assert all(link.reachable() for link in links)
        links[0].dealer.send(b"last")  # the router is there: it gets it
        links[0].close()
        assert router.recv_multipart() == [b"w0", b"last"]
        router.close(0)
        deadline = time.monotonic() + 10
        while links[1].reachable():
            assert time.monotonic() < deadline, "no disconnect seen in 10 s"
            time.sleep(0.01)
        links[1].dealer.send(b"never taken")
        t0 = time.monotonic()
        links[1].close()
        assert time.monotonic() - t0 < LINGER_MS / 1000 / 2
    finally:
        ctx.destroy(linger=0)


def test_a_link_to_a_router_not_started_yet_keeps_its_messages() -> None:
    """Not gone is not the same as seen: a worker that says hello before its router binds (`kvroute serve` starts it
    first) has seen no connection, and its messages wait for the router as before."""
    ctx = zmq.Context()
    try:
        link = RouterLink.open(0, "tcp://127.0.0.1:1", ctx, "w", None, None)
        assert link.reachable()
        inproc = RouterLink.open(1, "inproc://router-later", ctx, "w", None, None)  # (inproc has no connection events)
        assert inproc.reachable()
    finally:
        ctx.destroy(linger=0)
