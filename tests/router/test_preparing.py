"""router/preparing.py: the preparing threads shared between owners. Work that blocks until the test lets it go shows
which piece each thread takes: round-robin across owners, small work on its own thread, the owners' bounds, and a
deadline that runs from arrival."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from router import preparing
from router.admission import Busy
from router.metrics import Metrics
from router.preparing import SMALL_BYTES, Preparing

LARGE = SMALL_BYTES + 1


@pytest.fixture(autouse=True)
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads for any work, one for small work, whatever this machine's CPUs make the default."""
    monkeypatch.setattr(preparing, "THREADS", 2)


class Gate:
    """Pieces of work that start (recorded in order) and wait until released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, threading.Event] = {}
        self.outcomes: dict[str, Any] = {}

    def work(self, name: str) -> Any:
        self.release[name] = threading.Event()

        def run(deadline: Any) -> str:
            self.started.append(name)
            assert self.release[name].wait(10), f"{name} never released"
            return name

        return run

    def then(self, name: str) -> Any:
        return lambda outcome: self.outcomes.__setitem__(name, outcome)


async def until(check: Any, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def submit(p: Preparing, g: Gate, owner: str, name: str, size: int = LARGE) -> None:
    p.submit(owner, "submit", size, g.work(name), g.then(name), small=size <= SMALL_BYTES)


def test_threads_take_work_round_robin_across_owners() -> None:
    async def main() -> None:
        g, p = Gate(), Preparing(30.0, Metrics())
        for i in range(4):
            submit(p, g, "flood", f"f{i}")
        submit(p, g, "other", "o0")
        await until(lambda: len(g.started) == 2, "both threads busy")
        assert g.started == ["f0", "f1"]
        g.release["f0"].set()
        await until(lambda: len(g.started) == 3, "a third piece")
        assert g.started[2] == "o0", "the other owner's piece is next, not the flood's third"
        for e in g.release.values():
            e.set()
        await until(lambda: len(g.outcomes) == 5, "every piece answered")
        assert g.outcomes["o0"] == "o0" and p.metrics.prepare_waiting == 0
        p.shutdown()

    asyncio.run(main())


def test_small_work_does_not_wait_behind_large_work_of_its_own_owner() -> None:
    async def main() -> None:
        g, p = Gate(), Preparing(30.0, Metrics())
        for i in range(3):
            submit(p, g, "anon", f"big{i}")
        submit(p, g, "anon", "chat", size=300)
        await until(lambda: "chat" in g.started, "the small piece started")
        assert sorted(g.started) == ["big0", "big1", "chat"], "big2 waits; the chat went to the small thread"
        g.release["chat"].set()
        await until(lambda: "chat" in g.outcomes, "the chat answered")
        assert "big0" not in g.outcomes
        for e in g.release.values():
            e.set()
        await until(lambda: len(g.outcomes) == 4, "every piece answered")
        p.shutdown()

    asyncio.run(main())


def test_an_owner_past_its_bound_is_refused_and_others_get_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preparing, "PER_OWNER", 3)

    async def main() -> None:
        g, p = Gate(), Preparing(30.0, Metrics())
        for i in range(4):
            submit(p, g, "flood", f"f{i}")
        refused = g.outcomes["f3"]
        assert isinstance(refused, Busy) and refused.refusal.code == "queue_full" and "3 requests" in str(refused)
        assert p.admit("flood", "tokenize") is not None and p.admit("other", "tokenize") is None
        assert p.metrics.prepare_refused["submit"] == 1 and p.metrics.prepare_refused["tokenize"] == 1
        for e in g.release.values():
            e.set()
        await until(lambda: len(g.outcomes) == 4, "every piece answered")
        assert p.admit("flood", "tokenize") is None, "its pieces done, the owner gets in again"
        p.shutdown()

    asyncio.run(main())


def test_the_deadline_runs_from_arrival_and_a_piece_past_it_is_answered_unstarted() -> None:
    async def main() -> None:
        g, p = Gate(), Preparing(0.2, Metrics())
        for i in range(3):
            submit(p, g, "a", f"p{i}")
        await until(lambda: len(g.started) == 2, "both threads busy")
        await asyncio.sleep(0.3)
        p.expire(time.monotonic())  # (the router's tick)
        late = g.outcomes["p2"]
        assert isinstance(late, Busy) and late.refusal.code == "queue_full" and "waited" in str(late), late
        assert "p2" not in g.started and p.metrics.prepare_waiting == 0
        for e in g.release.values():
            e.set()
        await until(lambda: len(g.outcomes) == 3, "the running pieces answered")
        assert g.outcomes["p0"] == "p0", "a piece that started finishes (its own checks see the deadline)"
        p.shutdown()

    asyncio.run(main())


def test_running_out_of_time_after_a_wait_is_the_loads_fault_and_without_one_the_requests() -> None:
    """A piece whose own checks find its deadline too near (DeadlinePassed) is a 400 naming its field when it had its
    whole time, and `queue_full` (come back later) when waiting for a thread ate into it."""
    from chat.limits import DeadlinePassed

    async def main() -> None:
        g, p = Gate(), Preparing(1.0, Metrics())

        def too_long(deadline: Any) -> None:
            raise DeadlinePassed("tokenizing `prompt` would take about 5 s", "prompt")

        outcomes: dict[str, Any] = {}
        p.submit("a", "tokenize", LARGE, too_long, lambda o: outcomes.__setitem__("alone", o))
        await until(lambda: "alone" in outcomes, "the first answered")
        for i in range(2):
            submit(p, g, "b", f"b{i}")
        p.submit("a", "tokenize", LARGE, too_long, lambda o: outcomes.__setitem__("after", o))
        await until(lambda: len(g.started) == 2, "both threads busy")
        await asyncio.sleep(0.2)
        g.release["b0"].set()
        await until(lambda: "after" in outcomes, "the second answered")
        assert isinstance(outcomes["alone"], DeadlinePassed), "its whole time: its own cost"
        assert isinstance(outcomes["after"], Busy) and outcomes["after"].refusal.code == "queue_full", outcomes["after"]
        g.release["b1"].set()
        await until(lambda: len(g.outcomes) == 2, "the rest answered")
        p.shutdown()

    asyncio.run(main())
