"""The router's server logic against scripted fake workers over real ZMQ sockets (no model)."""

from __future__ import annotations

import time

import msgpack
import zmq
from router_client import RawClient
from router_helpers import FakeWorker, endpoints, start_router

from protocol import (
    Accept,
    Cancel,
    Delta,
    Error,
    Job,
    JobCancel,
    Refuse,
    Result,
    Sampling,
    StatusReply,
    StatusRequest,
    Submit,
    encode,
    pack_tokens,
    router_reply_decoder,
    unpack_tokens,
)
from router.config import RouterConfig


def submit(rid: str, tokens: list[int], **kw) -> Submit:
    return Submit(id=rid, tokens=pack_tokens(tokens), sampling=Sampling(max_tokens=8), **kw)


def test_refuses_a_worker_with_another_vocabulary(fake_router, vocab):
    _rt, _, wep = fake_router
    w = FakeWorker(wep, "w0", vocab)
    reply = w.hello(fingerprint="0" * 32)
    assert isinstance(reply, Refuse) and reply.code == "model_mismatch" and "fingerprint" in reply.reason
    w.close()


def test_routes_the_next_turn_to_the_slot_holding_its_history(fake_router, vocab):
    rt, cep, wep = fake_router
    w0, w1 = FakeWorker(wep, "w0", vocab), FakeWorker(wep, "w1", vocab)
    assert isinstance(w0.hello(), Accept) and isinstance(w1.hello(), Accept)
    c = RawClient(cep)
    turn1 = list(range(100, 140))
    c.send(submit("a1", turn1))
    owner = w0 if w0.sock.poll(2000) else w1
    job = owner.recv()
    assert isinstance(job, Job) and job.predicted_reuse == 0 and unpack_tokens(job.tokens) == turn1
    owner.delta(job, [7])
    owner.done(job, [7, 8, 9])
    deltas, res = c.recv_until_end("a1")
    assert [d.tokens for d in deltas] == [pack_tokens([7])]
    assert isinstance(res, Result) and res.worker == owner.id and res.usage.cached_tokens == 0
    # turn 2 extends turn 1 + the reply: it goes to the same slot and the router predicts the reuse
    turn2 = [*turn1, 7, 8, 9, 50, 51]
    c.send(submit("a2", turn2))
    job2 = owner.recv()
    assert job2.slot == job.slot and job2.predicted_reuse == len(turn1) + 2
    owner.done(job2, [1])
    _, res2 = c.recv_until_end("a2")
    assert res2.usage.cached_tokens == job2.predicted_reuse and res2.slot == job.slot
    rec = rt.router.metrics.recent[-1]
    assert rec.predicted_reuse == rec.reused_tokens == len(turn1) + 2
    assert rt.router.metrics.reuse_mispredictions == 0
    for x in (c, w0, w1):
        x.close()


def test_mirror_mismatch_is_counted_and_the_slot_cleared_on_next_use(fake_router, vocab):
    rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab, slots=1)
    w.hello()
    c = RawClient(cep)
    prompt = list(range(10, 50))
    c.send(submit("m1", prompt))
    job = w.recv()
    w.done(job, [5, 6], slot_hash="deadbeefdeadbeef")
    _, res = c.recv_until_end("m1")
    assert isinstance(res, Result)
    assert rt.router.metrics.mirror_mismatches == 1
    c.send(submit("m2", [*prompt, 5, 99]))
    job2 = w.recv()
    assert job2.prefix_cache is False and job2.predicted_reuse == 0
    w.done(job2, [1])
    _, res2 = c.recv_until_end("m2")
    assert res2.usage.cached_tokens == 0 and rt.router.metrics.mirror_mismatches == 1
    c.close()
    w.close()


def test_dead_worker_requests_are_redispatched_or_lost(fake_router, vocab):
    rt, cep, wep = fake_router
    w0 = FakeWorker(wep, "w0", vocab, slots=2)
    w0.hello()
    c = RawClient(cep)
    c.send(submit("started", list(range(10, 30))))
    c.send(submit("unstarted", list(range(40, 60))))
    j1, j2 = w0.recv(), w0.recv()
    first = j1 if j1.id.startswith("started") else j2
    w0.delta(first, [3])  # this one has streamed to its client
    assert isinstance(c.recv(), Delta)
    w1 = FakeWorker(wep, "w1", vocab, slots=2)
    w1.hello()
    # w0 goes silent; w1 keeps beating
    t0 = time.monotonic()
    while "w0" in rt.router.workers and time.monotonic() - t0 < 5:
        w1.heartbeat()
        time.sleep(0.2)
    assert "w0" not in rt.router.workers
    _, lost = c.recv_until_end("started")
    assert isinstance(lost, Error) and lost.code == "worker_lost"
    job = w1.recv()
    assert isinstance(job, Job) and job.id.startswith("unstarted")
    w1.done(job, [1, 2])
    _, res = c.recv_until_end("unstarted")
    assert isinstance(res, Result) and res.worker == "w1"
    assert rt.router.metrics.dead_workers == 1 and rt.router.metrics.redispatched == 1
    # the silent worker's heartbeat is answered with not_found, and it may say hello again
    w0.heartbeat()
    msgs = [w0.recv(), w0.recv(), w0.recv()]
    assert any(isinstance(m, Refuse) and m.code == "not_found" for m in msgs)
    assert any(isinstance(m, JobCancel) for m in msgs)
    for x in (c, w0, w1):
        x.close()


def test_bad_client_frames_get_errors_while_others_are_served(fake_router, vocab):
    rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab)
    w.hello()
    good, bad = RawClient(cep), RawClient(cep)
    good.send(submit("good", list(range(10, 30))))
    job = w.recv()
    cases = [
        (b"\xc1\xff garbage", "bad_request", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "bad_request", "map"),
        (msgpack.packb({"v": 1, "type": "submit", "id": "t1", "prompt": 5}), "bad_request", "prompt"),
        (msgpack.packb({"v": 1, "type": "submit", "id": "t2", "tokens": "abc"}), "bad_request", "tokens"),
        (msgpack.packb({"v": 1, "type": "nope"}), "bad_request", "unknown message type"),
        (msgpack.packb({"v": 9, "type": "submit"}), "unsupported_version", "version"),
        (b"\x00" * (9 * 1024 * 1024), "too_large", "cap"),
        (msgpack.packb({"v": 1, "type": "submit", "id": "t3", "tokens": pack_tokens([1, 10**9])}), "bad_request", "vocabulary"),
    ]
    for frame, code, words in cases:
        bad.send_raw(frame)
        err = bad.recv()
        assert isinstance(err, Error) and err.code == code and words in err.message, (frame[:40], err)
    bad.send_raw(b"", b"two", b"frames")
    assert isinstance(bad.recv(), Error)
    w.done(job, [1, 2, 3])
    _, res = good.recv_until_end("good")
    assert isinstance(res, Result)
    assert rt.router.metrics.bad_frames >= 7
    for x in (good, bad, w):
        x.close()


def test_req_socket_gets_one_reply(fake_router, vocab):
    _rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab)
    w.hello()
    c = RawClient(cep, kind=zmq.REQ)
    c.send(submit("r", list(range(10, 30))))
    job = w.recv()
    w.delta(job, [4])
    w.done(job, [4, 5])
    res = c.recv()
    assert isinstance(res, Result) and res.id == "r"
    c.send(StatusRequest(id="s"))
    st = c.recv()
    assert isinstance(st, StatusReply) and st.workers[0].worker == "w0" and st.workers[0].slots[job.slot].n_tokens == 21
    c.close()
    w.close()


def test_cancel_queue_full_deadline(fake_router, vocab):
    _rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab, slots=1)
    w.hello()
    c = RawClient(cep)
    c.send(submit("run", list(range(10, 30))))
    job = w.recv()
    # the only slot is busy: these queue
    c.send(submit("q-cancel", list(range(40, 60))))
    c.send(submit("q-deadline", list(range(70, 90)), deadline_ms=200))
    time.sleep(0.1)
    c.send(Cancel(id="q-cancel"))
    _, res = c.recv_until_end("q-cancel")
    assert isinstance(res, Result) and res.finish_reason == "cancelled"
    _, err = c.recv_until_end("q-deadline")
    assert isinstance(err, Error) and err.code == "deadline_exceeded"
    # fill the queue (limit: 8) and one more
    for i in range(8):
        c.send(submit(f"fill{i}", [10 + i] * 20))
    c.send(submit("overflow", [5] * 20))
    _, err = c.recv_until_end("overflow")
    assert isinstance(err, Error) and err.code == "queue_full" and err.retry_after_ms
    # cancelling the running one reaches the worker
    c.send(Cancel(id="run"))
    assert isinstance(w.recv(), JobCancel)
    w.done(job, [1])
    _, res = c.recv_until_end("run")
    assert isinstance(res, Result)
    c.close()
    w.close()


def test_no_workers_after_grace(vocab):
    cep, wep = endpoints()
    rt = start_router(RouterConfig(client_endpoint=cep, worker_endpoint=wep, no_workers_grace_s=0.3), vocab)
    try:
        c = RawClient(cep)
        c.send(submit("early", list(range(10, 30))))  # inside the grace: queued, then refused
        _, err = c.recv_until_end("early", timeout_s=5)
        assert isinstance(err, Error) and err.code == "no_workers"
        c.send(submit("late", list(range(10, 30))))
        _, err = c.recv_until_end("late", timeout_s=5)
        assert isinstance(err, Error) and err.code == "no_workers"
        c.close()
    finally:
        rt.stop()


def test_client_disconnect_cancels_its_running_job(fake_router, vocab):
    rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab, slots=1)
    w.hello()
    c = RawClient(cep)
    c.send(submit("bye", list(range(10, 30))))
    job = w.recv()
    w.delta(job, [1])
    assert isinstance(c.recv(), Delta)
    c.close()
    time.sleep(0.3)  # the router notices the closed connection
    w.delta(job, [2])  # relaying this fails: the client is gone, so the job is cancelled
    assert isinstance(w.recv(), JobCancel)
    w.done(job, [1, 2])
    time.sleep(0.2)
    assert not rt.router.requests and rt.router.workers["w0"].load.busy == 0
    w.close()


def test_draining_worker_hands_its_unstarted_job_to_another(fake_router, vocab):
    from protocol import JobError

    rt, cep, wep = fake_router
    w0 = FakeWorker(wep, "w0", vocab, slots=1)
    w0.hello()
    c = RawClient(cep)
    c.send(submit("d", list(range(10, 30))))
    job = w0.recv()
    w1 = FakeWorker(wep, "w1", vocab, slots=1)
    w1.hello()
    w0.send(JobError(id=job.id, code="draining", message="draining", slot=-1))
    job2 = w1.recv()
    assert unpack_tokens(job2.tokens) == unpack_tokens(job.tokens)
    w1.done(job2, [4])
    _, res = c.recv_until_end("d")
    assert isinstance(res, Result) and res.worker == "w1"
    assert rt.router.workers["w0"].state.value == "draining"
    for x in (c, w0, w1):
        x.close()


def test_heartbeat_disagreeing_with_the_mirror_is_a_mismatch(fake_router, vocab):
    rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab, slots=1)
    w.hello()
    c = RawClient(cep)
    c.send(submit("h", list(range(10, 30))))
    job = w.recv()
    w.done(job, [4, 5])
    c.recv_until_end("h")
    w.held[0] = [1, 2, 3]  # the worker now claims a different length for the idle slot
    w.heartbeat()
    time.sleep(0.2)
    assert rt.router.metrics.mirror_mismatches == 1
    c.send(submit("h2", list(range(10, 30))))
    assert w.recv().prefix_cache is False  # the next job clears the slot
    c.close()
    w.close()


def test_a_long_text_is_tokenized_while_the_router_keeps_serving(patient_router, vocab):
    """A prompt of ~400 kB takes the tokenizer a quarter of a second or more: the router answers others meanwhile,
    and a cancel that arrives first ends it for good."""
    _rt, cep, wep = patient_router
    w = FakeWorker(wep, "w0", vocab, slots=1)
    w.hello()
    c = RawClient(cep)
    long_text = "The harbour lamp was lit at dusk and the boats came home. " * 7000
    c.send(Submit(id="long", prompt=long_text, sampling=Sampling(max_tokens=8)))
    c.send(StatusRequest(id="st"))
    first = c.recv()
    assert isinstance(first, StatusReply), first  # answered while the long text was still being tokenized
    _, err = c.recv_until_end("long")
    assert isinstance(err, Error) and err.code == "context_overflow"  # then tokenized, counted, refused
    # Another text: the router would reuse the tokens of "long" as the head of the same text and finish first.
    other_text = "The mill wheel turned all day and the flour came down. " * 7000
    c.send(Submit(id="gone", prompt=other_text, sampling=Sampling(max_tokens=8)))
    c.send(Cancel(id="gone"))
    _, res = c.recv_until_end("gone")
    assert isinstance(res, Result) and res.finish_reason == "cancelled"
    c.send(submit("after", list(range(10, 30))))
    job = w.recv()
    assert isinstance(job, Job) and unpack_tokens(job.tokens) == list(range(10, 30))  # nothing of "gone" reached it
    w.done(job, [1])
    assert isinstance(c.recv_until_end("after")[1], Result)
    c.close()
    w.close()


def test_a_client_that_stops_reading_gets_every_message_in_order_when_it_reads_again(fake_router, vocab):
    """Its pipe reaches the high-water mark: what is for it waits in the router's backlog (nothing dropped), and
    the router goes on serving others meanwhile."""
    rt, cep, wep = fake_router
    w = FakeWorker(wep, "w0", vocab)
    w.hello()
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.connect(cep)
    slow.send(encode(submit("slow", list(range(10, 30)))))
    job = w.recv()
    n, text = 3000, "y" * 2000  # 6 MB: more than the pipe and the socket buffers hold
    for i in range(n):
        w.delta(job, [i % 100 + 1], text=text)
    w.done(job, [1, 2])
    deadline = time.monotonic() + 10
    while not rt.router.outbox.backlog and time.monotonic() < deadline:
        w.heartbeat()
        time.sleep(0.1)
    assert rt.router.outbox.backlog, "the client's pipe never filled"
    other = RawClient(cep)
    other.send(StatusRequest(id="st"))
    assert isinstance(other.recv(5), StatusReply)  # not held up by the slow reader
    dec, deltas = router_reply_decoder(), 0
    while True:
        assert slow.poll(10_000), f"stopped after {deltas} deltas"
        msg = dec.decode(slow.recv())
        if isinstance(msg, Delta):
            assert msg.text == text
            deltas += 1
        else:
            assert isinstance(msg, Result), msg
            break
    assert deltas == n and not rt.router.outbox.backlog and rt.router.metrics.peers_cut == 0
    for x in (slow, other, w):
        x.close()


def test_the_alive_file_is_touched_by_the_event_loop(vocab, tmp_path):
    """--alive-file: a liveness probe's signal where there is no systemd watchdog (deploy/kubernetes)."""
    cep, wep = endpoints()
    alive = tmp_path / "alive"
    rt = start_router(RouterConfig(client_endpoint=cep, worker_endpoint=wep, alive_file=str(alive)), vocab)
    try:
        deadline = time.monotonic() + 5
        while not alive.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive.exists()
    finally:
        rt.stop()


def test_a_client_message_with_no_handler_gets_an_error_naming_its_type(fake_router):
    """The dispatch table ends in an explicit error: a type the decoder reads and no handler takes (here one taken
    out of the table) is answered with its id, counted and logged, never handed to another handler."""
    from protocol import StatusRequest

    rt, cep, _ = fake_router
    c = RawClient(cep)
    del rt.router.client_handlers[StatusRequest]
    c.send(StatusRequest(id="st"))
    err = c.recv()
    assert isinstance(err, Error) and err.id == "st" and err.code == "bad_request" and "'status'" in err.message, err
    assert rt.router.metrics.unknown_messages == 1
    c.close()
