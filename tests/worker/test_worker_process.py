"""The `kvroute worker` process over a real ZMQ ROUTER socket held by the test (playing the router)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from common.model import resolve_model
from common.vocab import Vocab
from protocol import (
    Accept,
    Drain,
    Heartbeat,
    Hello,
    Job,
    JobCancel,
    JobDelta,
    JobDone,
    JobError,
    Refuse,
    Sampling,
    encode,
    pack_tokens,
    token_hash,
    unpack_tokens,
    worker_to_router_decoder,
)

pytestmark = pytest.mark.model

DECODE = worker_to_router_decoder()
CTX = 256


class FakeRouter:
    """A bound ROUTER socket and a worker process connected to it."""

    def __init__(self, worker_id: str, *extra: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.worker_id = worker_id
        cmd = [sys.executable, "-m", "commands.cli", "worker", "--connect", f"tcp://127.0.0.1:{port}"]
        cmd += ["--worker-id", worker_id, "--slots", "2", "--ctx-per-slot", str(CTX), "--threads", "2", *extra]
        env = dict(os.environ, KVROUTE_LOG_FORMAT="json")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def send(self, msg) -> None:
        self.sock.send_multipart([self.worker_id.encode(), encode(msg)])

    def send_raw(self, frame: bytes) -> None:
        self.sock.send_multipart([self.worker_id.encode(), frame])

    def recv(self, timeout: float = 30.0, skip_beats: bool = True):
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError("no message from the worker")
            ident, frame = self.sock.recv_multipart()
            assert ident == self.worker_id.encode()
            msg = DECODE.decode(frame)
            if skip_beats and isinstance(msg, Heartbeat | Hello):
                continue
            return msg

    def run_job(self, job: Job) -> tuple[list[JobDelta], JobDone | JobError]:
        self.send(job)
        deltas = []
        while True:
            msg = self.recv()
            if isinstance(msg, JobDelta):
                assert msg.id == job.id
                deltas.append(msg)
            else:
                assert msg.id == job.id, msg
                return deltas, msg

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab.load(resolve_model(None))


@pytest.fixture(scope="module")
def router() -> Iterator[FakeRouter]:
    r = FakeRouter("wt")
    try:
        hello = r.recv(timeout=120, skip_beats=False)
        assert isinstance(hello, Hello), hello
        r.hello = hello
        r.send(Accept(worker_id="wt", router_id="r1"))
        yield r
    finally:
        r.close()


def test_hello_describes_the_worker(router, vocab):
    hello = router.hello
    assert (hello.worker_id, hello.slots, hello.ctx_per_slot, hello.device) == ("wt", 2, CTX, "cpu")
    assert hello.model_fingerprint == vocab.fingerprint  # router and worker tokenize alike
    assert hello.kv_bytes > 0 and hello.pid == router.proc.pid
    beat = router.recv(timeout=5, skip_beats=False)
    while not isinstance(beat, Heartbeat):
        beat = router.recv(timeout=5, skip_beats=False)
    assert [s.slot for s in beat.slots] == [0, 1] and beat.queue == 0


def test_job_streams_deltas_then_done(router, vocab):
    prompt = vocab.tokenize("The capital of France is")
    job = Job(id="j1", slot=0, tokens=pack_tokens(prompt), sampling=Sampling(temperature=0.0, max_tokens=6))
    deltas, done = router.run_job(job)
    assert isinstance(done, JobDone), done
    tokens = unpack_tokens(done.tokens)
    assert len(tokens) == done.generated_tokens == 6 and done.finish_reason == "length"
    assert [t for d in deltas for t in unpack_tokens(d.tokens)] == tokens
    assert "".join(d.text for d in deltas) == done.text == vocab.detokenize(tokens)
    assert done.slot_hash == token_hash((prompt + tokens)[: done.slot_tokens])
    assert done.slot_tokens == len(prompt) + 5


def test_bad_frames_get_errors_and_the_worker_keeps_serving(router, vocab):
    router.send_raw(b"\xc1 not msgpack")
    err = router.recv()
    assert isinstance(err, JobError) and err.code == "bad_request" and "msgpack" in err.message
    router.send_raw(msgpack.packb({"v": 1, "type": "job", "id": "j-bad", "tokens": 7}))
    err = router.recv()
    assert isinstance(err, JobError) and err.id == "j-bad" and err.code == "bad_request"
    bad_slot = Job(id="j-slot", slot=9, tokens=pack_tokens([2, 3]))
    _, err = router.run_job(bad_slot)
    assert isinstance(err, JobError) and err.code == "bad_request" and "slot 9" in err.message
    too_long = Job(id="j-long", tokens=pack_tokens([2] * 200), sampling=Sampling(max_tokens=100))
    _, err = router.run_job(too_long)
    assert err.code == "context_overflow" and "200" in err.message and "100" in err.message and str(CTX) in err.message
    _, done = router.run_job(Job(id="j-ok", tokens=pack_tokens(vocab.tokenize("Hello")), sampling=Sampling(max_tokens=2)))
    assert isinstance(done, JobDone)


def test_cancel_stops_a_running_job(router, vocab):
    prompt = vocab.tokenize("Write a very long story about a dragon.")
    job = Job(id="j-cancel", slot=1, tokens=pack_tokens(prompt), sampling=Sampling(temperature=0.0, max_tokens=200))
    router.send(job)
    first = router.recv()
    assert isinstance(first, JobDelta)
    router.send(JobCancel(id="j-cancel"))
    router.send(JobCancel(id="never-heard-of-it"))  # ignored
    while isinstance(msg := router.recv(), JobDelta):
        pass
    assert isinstance(msg, JobDone) and msg.finish_reason == "cancelled" and msg.generated_tokens < 200
    assert msg.slot_hash == token_hash((prompt + unpack_tokens(msg.tokens))[: msg.slot_tokens])


def test_drain_refuses_new_jobs_then_sigterm_exits(router, vocab):
    router.send(Drain())
    time.sleep(0.2)
    _, err = router.run_job(Job(id="j-drained", tokens=pack_tokens(vocab.tokenize("Hi"))))
    assert isinstance(err, JobError) and err.code == "draining"
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(timeout=20) == 0


def test_refuse_makes_the_worker_exit_with_status_3():
    r = FakeRouter("w-refused")
    try:
        assert isinstance(r.recv(timeout=120, skip_beats=False), Hello)
        r.send(Refuse(code="model_mismatch", reason="test refuses"))
        assert r.proc.wait(timeout=20) == 3
    finally:
        r.close()
