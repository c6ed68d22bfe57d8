"""`reply_to` (issue item 6): a ZMQ client could make workers connect anywhere, and what a worker queued for an endpoint
that does not read had no bound."""

from __future__ import annotations

import socket

import zmq
from hostile_helpers import Routed
from router_client import RawClient

from protocol import Error, Sampling, Submit, pack_tokens
from worker.direct_replies import QUEUE_MAX, ReplySockets


def test_an_endpoint_that_does_not_read_holds_a_bounded_queue_then_is_dropped() -> None:
    with socket.socket() as s:  # a port nothing listens on: what is sent there waits
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    replies = ReplySockets(zmq.Context.instance())
    endpoint = f"tcp://127.0.0.1:{port}"
    sent = 0
    while replies.send(endpoint, "", b"x" * 100):
        sent += 1
        assert sent <= 2 * QUEUE_MAX, "the queue for an endpoint that does not read has no bound"
    assert replies.stalled == 1 and (endpoint, "") not in replies.open
    replies.close()


def test_reply_to_must_be_an_endpoint_and_a_client_names_few(routed: Routed) -> None:
    c = RawClient(routed.client_ep)
    tokens = pack_tokens(list(range(10, 40)))
    for i, bad in enumerate(["tcp://*:5000", "tcp://0.0.0.0:5000", "inproc://x", "pgm://eth0;239.1.1.1:5555", "tcp://h"]):
        c.send(Submit(id=f"bad{i}", tokens=tokens, reply_to=bad, sampling=Sampling(max_tokens=4)))
        _, end = c.recv_until_end(f"bad{i}")
        assert isinstance(end, Error) and end.code == "bad_request" and end.param == "reply_to", (bad, end)
    for i in range(4):  # (queued behind nothing: the fake worker takes two, the rest wait)
        c.send(Submit(id=f"ok{i}", tokens=tokens, reply_to=f"tcp://127.0.0.1:{40000 + i}", sampling=Sampling(max_tokens=4)))
    c.send(Submit(id="fifth", tokens=tokens, reply_to="tcp://127.0.0.1:40009", sampling=Sampling(max_tokens=4)))
    _, end = c.recv_until_end("fifth")
    assert isinstance(end, Error) and end.param == "reply_to" and "at most 4" in end.message, end
    c.close()
