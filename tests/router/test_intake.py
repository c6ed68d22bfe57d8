"""router/intake.py with the preparing threads stood in for by a list of pending decodes: a client's messages keep
their order behind its large frame, other clients are not held up, and what waits is bounded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from protocol import Cancel, Error, Sampling, Submit, encode
from router import intake
from router.intake import ClientIntake
from router.metrics import Metrics


class Harness:
    def __init__(self) -> None:
        self.handled: list[tuple[bytes, Any]] = []
        self.replies: list[tuple[bytes, Any]] = []
        self.pending: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []
        self.metrics = Metrics()
        self.intake = ClientIntake(
            1 << 24,
            lambda who, env, msg, size: self.handled.append((who, msg)),
            lambda who, size, work, then: self.pending.append((work, then)),
            lambda who, env, msg: self.replies.append((who, msg)),
            self.metrics,
        )

    def decode_next(self) -> None:
        work, then = self.pending.pop(0)
        then(work())

    def ids(self) -> list[tuple[bytes, str]]:
        return [(who, getattr(msg, "id", "")) for who, msg in self.handled]


def submit(rid: str, chars: int = 10) -> bytes:
    return encode(Submit(id=rid, prompt="x" * chars, sampling=Sampling(max_tokens=1)))


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Harness:
    monkeypatch.setattr(intake, "DECODE_INLINE_BYTES", 1000)
    return Harness()


def test_frames_behind_a_large_one_wait_for_it_in_order_and_other_clients_go_on(h: Harness) -> None:
    h.intake.frames([b"a", submit("big", 5000)])
    h.intake.frames([b"a", encode(Cancel(id="big"))])  # a cancel right after its submit must still find it
    h.intake.frames([b"a", submit("big2", 5000)])
    h.intake.frames([b"a", submit("small")])
    h.intake.frames([b"b", b"", submit("other")])  # another client (with a REQ envelope) is not held up
    assert h.ids() == [(b"b", "other")] and len(h.pending) == 1
    h.decode_next()  # the first large frame; the cancel after it, then the next large one goes off the loop
    assert h.ids() == [(b"b", "other"), (b"a", "big"), (b"a", "big")] and len(h.pending) == 1
    h.decode_next()
    assert h.ids()[3:] == [(b"a", "big2"), (b"a", "small")] and not h.pending
    h.intake.frames([b"a", submit("after")])  # nothing waits any more: decoded at once
    assert h.ids()[-1] == (b"a", "after") and not h.replies


def test_too_many_frames_behind_a_large_one_are_refused_with_their_id(h: Harness) -> None:
    h.intake.frames([b"a", submit("big", 5000)])
    for n in range(intake.DECODING_MAX + 1):
        h.intake.frames([b"a", submit(f"s{n}")])
    [(who, refused)] = h.replies
    assert who == b"a" and isinstance(refused, Error) and refused.code == "queue_full" and refused.id == f"s{intake.DECODING_MAX}"
    assert h.metrics.requests["queue_full"] == 1
    h.decode_next()
    assert len(h.handled) == 1 + intake.DECODING_MAX  # every frame that was kept, in order
    assert [msg.id for _, msg in h.handled[1:]] == [f"s{n}" for n in range(intake.DECODING_MAX)]


def test_a_message_of_the_wrong_frame_count_is_refused(h: Harness) -> None:
    h.intake.frames([b"a", b"x", b"y", b"z"])
    [(_, refused)] = h.replies
    assert isinstance(refused, Error) and refused.code == "bad_request" and "got 3" in refused.message
    assert h.metrics.bad_frames == 1 and not h.handled
