"""Client faults on a real `kvroute serve` (2 CPU workers x 2 slots, the real model, HTTP in front): a 9 MB
prompt and a 40 MB body, over HTTP and raw ZMQ, and a reader that stops reading its stream. Each runs while
innocent streams are in flight, and checks that they complete and that nothing waits past a bound."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from fault_helpers import BOUND_S, HttpStream, Served, all_ready, restarts, status, wait_for

from protocol import ChatMessage, Error, Submit, encode, router_reply_decoder

pytestmark = pytest.mark.model

STALL_S = 1.0
MB = 1024 * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = Path(tmp_path_factory.mktemp("faults-http")) / "serve.log"
    s = Served(
        *("--workers", "2", "--slots", "2", "--ctx-per-slot", "1024", "--threads", "1"),
        *("--stream-stall-s", str(STALL_S)),
        log=log,
    )
    yield s
    s.stop()


@pytest.fixture
def ready(served: Served) -> Served:
    wait_for(lambda: all_ready(served.zmq), BOUND_S, "both workers ready and idle")
    return served


def innocents(url: str, n: int, max_tokens: int = 64) -> list[HttpStream]:
    streams = [HttpStream(url, max_tokens=max_tokens, content=f"Tell me a long story, number {i}.") for i in range(n)]
    wait_for(lambda: all(s.chunks >= 2 or not s.is_alive() for s in streams), BOUND_S, "every innocent stream producing")
    return streams


def test_a_9_mb_prompt_and_a_40_mb_body_are_refused_alone_while_4_streams_finish(ready):
    served = ready
    before = restarts(served.zmq)
    streams = innocents(served.url, 4)
    url = f"{served.url}/v1/chat/completions"

    prompt_9mb = json.dumps({"messages": [{"role": "user", "content": "x" * (9 * MB)}], "max_tokens": 4})
    t0 = time.monotonic()
    r = httpx.post(url, content=prompt_9mb, headers={"content-type": "application/json"}, timeout=BOUND_S)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text[:300]
    assert time.monotonic() - t0 < 5

    t0 = time.monotonic()  # 40 MB without a Content-Length (chunked): cut as soon as the limit is passed
    r = httpx.post(url, content=(b" " * MB for _ in range(40)), headers={"content-type": "application/json"}, timeout=BOUND_S)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text[:300]
    assert time.monotonic() - t0 < 5

    r = httpx.post(url, content=b"{" + b" " * (40 * MB), headers={"content-type": "application/json"}, timeout=BOUND_S)
    assert r.status_code == 413, r.text[:300]

    # just under the limit: parsed and tokenized off the event loop, then refused for its length
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "word " * (7 * MB // 5)}]}, timeout=BOUND_S)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]

    # the same prompt as one raw ZMQ frame over the router's 8 MiB cap: an error that names the request
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.zmq)
    try:
        sock.send(encode(Submit(id="huge-1", messages=[ChatMessage(role="user", content="x" * (9 * MB))])))
        assert sock.poll(int(BOUND_S * 1000)), "no reply to a 9 MB frame"
        reply = router_reply_decoder().decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(reply, Error) and reply.code == "too_large" and reply.id == "huge-1", reply

    for s in streams:
        assert s.ended().completed, (s.status, s.finish_reason, s.completion_tokens, s.error)
    assert restarts(served.zmq) == before  # no worker was declared dead meanwhile


def test_a_reader_that_stops_reading_is_cut_and_its_generation_cancelled(ready):
    """The stalled reply fills the connection's buffers, its writes wait --stream-stall-s, then its job is
    cancelled and the reply ended with the reason; the other streams do not slow down for it."""
    served = ready
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Write a very long story."}],
            "stream": True,
            "max_tokens": 900,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,  # about 2 KB an event: the buffers fill in a few hundred tokens
        }
    ).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", served.http_port))
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        busy = wait_for(lambda: _busy_slot(served.zmq), 10, "the stalled request running")
        streams = innocents(served.url, 2)
        for s in streams:
            assert s.ended().completed, (s.status, s.finish_reason, s.completion_tokens, s.error)
        # its slot is freed before the 900 tokens are out: the generation was cancelled
        held = wait_for(lambda: _idle_tokens(served.zmq, busy), BOUND_S, "the stalled request's slot freed")
        assert held < 900, held
        stalled.settimeout(10)
        received = b""
        # what was buffered, then why it was cut, then the reply's end (no hang); the connection itself stays open for
        # the next request, as after any reply, until the server's keep-alive timeout (5 s): not waited for
        while not received.endswith(b"\r\n0\r\n\r\n") and (chunk := stalled.recv(MB)):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        assert b'"code": "too_slow"' in received[-2000:] and b"the generation was cancelled" in received[-2000:]
    finally:
        stalled.close()


def _busy_slot(endpoint: str) -> tuple[str, int] | None:
    for w in status(endpoint).workers:
        for s in w.slots:
            if s.busy:
                return w.worker, s.slot
    return None


def _idle_tokens(endpoint: str, where: tuple[str, int]) -> int | None:
    """What the slot holds once it is idle again (None while busy)."""
    for w in status(endpoint).workers:
        if w.worker == where[0]:
            slot = w.slots[where[1]]
            return None if slot.busy else slot.n_tokens
    return None
