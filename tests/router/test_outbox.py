"""router/outbox.py with sockets that refuse on cue: a full pipe keeps a peer's messages in order, a peer that stays
behind is cut, a vanished one reported."""

from __future__ import annotations

import errno
import time
from typing import Any

import pytest
import zmq

from protocol import Error, ErrorCode, router_reply_decoder
from router import outbox
from router.outbox import Outbox
from router.scheduler import Out


class Pipe:
    """A socket whose pipe is full while `full` is set; `gone` makes every send fail as to a vanished peer."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self.full = False
        self.gone = False

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        assert flags == zmq.NOBLOCK  # (never blocks the loop)
        if self.gone:
            raise zmq.ZMQError(errno.EHOSTUNREACH)
        if self.full:
            raise zmq.Again()
        self.sent.append(frames)


def message(n: int) -> Error:
    return Error(id=str(n), code=ErrorCode.INTERNAL, message="m")


def ids(pipe: Pipe) -> list[str]:
    decoder = router_reply_decoder()
    return [decoder.decode(frames[-1]).id for frames in pipe.sent]


@pytest.fixture
def box() -> tuple[Outbox, Pipe, Pipe, list[Any]]:
    clients, workers, lost = Pipe(), Pipe(), []
    return Outbox(clients, workers, lambda *args: lost.append(args)), clients, workers, lost  # type: ignore[arg-type]


def test_a_full_pipe_keeps_the_peers_messages_in_order_and_others_go_on(box) -> None:
    out, clients, _, lost = box
    out.put(Out(b"a", message(1)))
    clients.full = True
    out.put(Out(b"a", message(2)))
    clients.full = False
    out.put(Out(b"a", message(3)))  # behind the one waiting, though the pipe takes it now
    out.put(Out(b"b", message(4)))  # another client is not held up
    assert ids(clients) == ["1", "4"] and len(out.backlog[(False, b"a")]) == 2
    out.catch_up(time.monotonic())
    assert ids(clients) == ["1", "4", "2", "3"] and not out.backlog and not lost


def test_a_peer_behind_too_long_or_too_far_is_cut_and_reported(box, monkeypatch) -> None:
    out, clients, workers, lost = box
    clients.full = workers.full = True
    out.put(Out(b"slow", message(1)))
    out.catch_up(time.monotonic())  # still full, not yet too long: kept
    assert (False, b"slow") in out.backlog and not lost
    out.catch_up(time.monotonic() + outbox.BACKLOG_TIMEOUT_S + 1)
    assert not out.backlog and lost == [
        (False, b"slow", f"did not read its messages for {outbox.BACKLOG_TIMEOUT_S + 1:.0f} s", True)
    ]
    monkeypatch.setattr(outbox, "BACKLOG_MAX", 3)
    for n in range(5):
        out.put(Out(b"w0", message(n), worker=True))
    out.catch_up(time.monotonic())
    assert not out.backlog and lost[-1][:2] == (True, b"w0") and lost[-1][3] is True
    workers.full = False
    out.put(Out(b"w0", message(9), worker=True))  # a peer cut starts afresh
    assert ids(workers) == ["9"]


def test_a_vanished_peer_is_reported_once_per_send_and_nothing_waits_for_it(box) -> None:
    out, clients, _, lost = box
    clients.gone = True
    out.put(Out(b"gone", message(1)))
    assert lost == [(False, b"gone", "unreachable", False)] and not out.backlog
