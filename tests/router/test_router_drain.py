"""SIGTERM on a real `kvroute router` process (fake worker, no model weights): new requests get
`draining`, accepted ones finish, and those still open at the drain timeout get an error; exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from router_client import RawClient
from router_helpers import FakeWorker, endpoints

from common.vocab import Vocab
from protocol import Accept, Error, Job, JobCancel, Result, Sampling, Submit

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def drain_notifications(sock: socket.socket) -> None:
    """Keep reading the router's sd_notify datagrams so it never blocks on a full socket; ends with the test."""
    while True:
        try:
            sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return


@pytest.fixture
def router_proc(tmp_path: Path) -> Iterator[Callable[[float], tuple[subprocess.Popen[bytes], str, str]]]:
    """`start(drain_timeout_s)` -> (process, client endpoint, worker endpoint), once READY=1 came."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(drain_timeout_s: float) -> tuple[subprocess.Popen[bytes], str, str]:
        cep, wep = endpoints()
        path = str(tmp_path / f"notify{len(procs)}.sock")
        ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ready.bind(path)
        ready.settimeout(60)
        env = dict(os.environ, NOTIFY_SOCKET=path)
        cmd = [KVROUTE, "router", "--zmq", cep, "--worker-endpoint", wep, "--busy-wait-ms", "0"]
        proc = subprocess.Popen([*cmd, "--drain-timeout-s", str(drain_timeout_s)], env=env, stderr=subprocess.DEVNULL)
        procs.append(proc)
        assert ready.recv(4096).startswith(b"READY=1")
        threading.Thread(target=drain_notifications, args=(ready,), daemon=True).start()
        return proc, cep, wep

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def connect(vocab: Vocab, cep: str, wep: str) -> tuple[FakeWorker, RawClient, Job]:
    fw = FakeWorker(wep, "w0", vocab)
    assert isinstance(fw.hello(), Accept)
    c = RawClient(cep)
    c.send(Submit(id="r1", prompt="Hello there, how are you", stream=True, sampling=Sampling(max_tokens=4)))
    job = fw.recv()
    assert isinstance(job, Job)
    return fw, c, job


def test_sigterm_finishes_accepted_requests_and_refuses_new_ones(router_proc, vocab: Vocab) -> None:
    proc, cep, wep = router_proc(30.0)
    fw, c, job = connect(vocab, cep, wep)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = RawClient(cep)
    late.send(Submit(id="r2", prompt="Too late", sampling=Sampling(max_tokens=4)))
    err = late.recv(10)
    assert isinstance(err, Error) and err.code == "draining" and err.id == "r2"
    fw.heartbeat()
    fw.delta(job, [5])
    fw.done(job, [5, 6])
    deltas, res = c.recv_until_end("r1", 10)
    assert isinstance(res, Result) and res.finish_reason == "length" and len(deltas) == 1
    assert proc.wait(10) == 0
    for s in (fw, c, late):
        s.close()


def test_requests_still_open_at_the_drain_timeout_get_an_error(router_proc, vocab: Vocab) -> None:
    proc, cep, wep = router_proc(1.0)
    fw, c, job = connect(vocab, cep, wep)
    proc.send_signal(signal.SIGTERM)
    cancel = fw.recv(10)  # the worker is told to stop the job
    assert isinstance(cancel, JobCancel) and cancel.id == job.id
    _, err = c.recv_until_end("r1", 10)
    assert isinstance(err, Error) and err.code == "draining" and "drain timeout" in err.message
    assert proc.wait(10) == 0
    fw.close()
    c.close()
