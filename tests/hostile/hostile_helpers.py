"""Helpers of the hostile-input suite (issue 46): requests and peers that try to freeze, fill or leak the server, each against
the part it attacks, on loopback only. Each test holds one item of the issue; the fast tier uses the real router with
scripted fake workers, the model tier (test_served.py) a real `kvroute serve` in this process beside a real stream.

`LoopWatch` measures what the suite is about: the longest time an event loop did not come back to a 10 ms sleep
while a hostile request was being handled. The time its thread waited for a CPU meanwhile (the kernel's schedstat: on
a machine shared with other work, tens of milliseconds now and then) is the machine's, not the loop's, and is taken
out; waiting for the GIL, or for a collection of garbage, stays in."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))

from router_helpers import FakeWorker, RouterThread, endpoints, start_router

from common.vocab import Vocab
from router.config import RouterConfig

STALL_S = 0.1  # the longest a loop may stall while a hostile request is handled (the bound)


def run_delay_s() -> float | None:
    """How long this thread has waited on the kernel's run queue (ready, with no CPU free for it); None where the
    kernel does not say."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopWatch:
    """On `loop`: how late each 10 ms sleep wakes, less the time the loop's thread waited for a CPU; `longest` is the
    worst since the last `reset()` (`longest_wall` the same with that wait left in)."""

    TICK_S = 0.01

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.longest = self.longest_wall = 0.0
        self._running = threading.Event()
        self._future = asyncio.run_coroutine_threadsafe(self._watch(), loop)
        assert self._running.wait(10), "the loop watch did not start"

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        self._running.set()
        while True:
            t0, waited0 = loop.time(), run_delay_s()
            await asyncio.sleep(self.TICK_S)
            late, waited = loop.time() - t0 - self.TICK_S, run_delay_s()
            self.longest_wall = max(self.longest_wall, late)
            machine = waited - waited0 if waited is not None and waited0 is not None else 0.0
            self.longest = max(self.longest, late - max(0.0, min(machine, late)))

    def reset(self) -> None:
        self.longest = self.longest_wall = 0.0

    def __str__(self) -> str:
        return f"the loop stalled {self.longest:.3f} s ({self.longest_wall:.3f} s of wall-clock time)"

    def stop(self) -> None:
        self._future.cancel()


def wait_until(check: Any, timeout_s: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class Routed:
    """A real router in a thread with one scripted worker (2 slots) that said hello, and a watch on its loop."""

    def __init__(self, vocab: Vocab, **cfg: Any) -> None:
        self.client_ep, worker_ep = endpoints()
        config = RouterConfig(
            client_endpoint=self.client_ep,
            worker_endpoint=worker_ep,
            heartbeat_timeout_s=30.0,
            no_workers_grace_s=30.0,
            busy_wait_ms=0,
            **cfg,
        )
        self.rt: RouterThread = start_router(config, vocab)
        self.worker = FakeWorker(worker_ep, "w0", vocab, slots=2)
        self.worker.hello()
        assert self.rt.loop is not None
        self.watch = LoopWatch(self.rt.loop)

    @property
    def router(self) -> Any:
        return self.rt.router

    def in_flight(self) -> int:
        """Requests the router holds (any state), from its own loop."""
        return int(self.rt.call(lambda: sum(len(c.requests) for c in self.router.cores)))

    def close(self) -> None:
        self.watch.stop()
        self.worker.close()
        self.rt.stop()
