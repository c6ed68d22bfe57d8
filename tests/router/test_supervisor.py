"""Supervisor restart rules with stand-in processes (no model)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from types import SimpleNamespace

from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec


class StubRouter:
    def __init__(self) -> None:
        self.exits: list[tuple[str, int, int | None]] = []
        self.restarts: dict[str, int] = {}
        self.metrics = SimpleNamespace(restarts=0)

    def worker_exited(self, worker: str, incarnation: int, rc: int | None) -> None:
        self.exits.append((worker, incarnation, rc))

    def expect_workers(self, workers: set[str]) -> None:
        self.expected = workers

    def worker_failed(self, worker: str, reason: str) -> None:
        self.failed = (worker, reason)


def run_supervisor(code: int, cfg: SupervisorConfig) -> tuple[StubRouter, Supervisor]:
    router = StubRouter()
    program = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    sup = Supervisor(router, [WorkerSpec("w0")], cfg, "tcp://127.0.0.1:1", program=program)  # type: ignore[arg-type]

    async def main() -> None:
        sup.start()
        await asyncio.wait_for(asyncio.gather(*sup._tasks), timeout=30)

    asyncio.run(main())
    return router, sup


def test_crash_looping_worker_is_restarted_with_backoff_then_given_up():
    cfg = SupervisorConfig(restart_backoff_s=0.01, restart_backoff_max_s=0.05, max_restarts=3, restart_window_s=60)
    router, sup = run_supervisor(1, cfg)
    assert sup.children["w0"].given_up
    # started once + 3 restarts; each exit reported with its own, growing incarnation
    assert [(w, inc, rc) for w, inc, rc in router.exits] == [("w0", i, 1) for i in range(1, 5)]
    assert router.restarts == {"w0": 3} and router.metrics.restarts == 3
    assert router.failed == (
        "w0",
        "it exited 4 times within 60 s (the last: status 1); it is not restarted again (--max-restarts)",
    )


def test_refused_worker_is_not_restarted():
    router, sup = run_supervisor(3, SupervisorConfig(restart_backoff_s=0.01))
    assert sup.children["w0"].given_up and Counter(rc for *_, rc in router.exits) == {3: 1}
    assert router.failed[0] == "w0" and "refused" in router.failed[1]
