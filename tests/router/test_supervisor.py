"""Supervisor restart rules with stand-in processes (no model)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from types import SimpleNamespace

from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec


class StubModels:
    """One model loaded at start, or two loaded on demand (`dynamic`)."""

    def __init__(self, names: list[str]) -> None:
        self.cores = [SimpleNamespace(name=n, spec=SimpleNamespace(load_at_start=len(names) == 1)) for n in names]
        self.on_load = self.on_unload = None
        self.models_max = 0
        self.started_names: list[str] = []

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.cores)

    def dynamic(self) -> bool:
        return len(self.cores) > 1

    def loaded(self) -> list[SimpleNamespace]:
        return []

    def short(self, m: SimpleNamespace, loaded: list[SimpleNamespace]) -> set[str] | None:
        return None  # (room for every model)

    def started(self, name: str) -> None:
        self.started_names.append(name)


class StubRouter:
    def __init__(self, models: list[str] | None = None) -> None:
        self.exits: list[tuple[str, int, int | None]] = []
        self.restarts: dict[str, int] = {}
        self.metrics = SimpleNamespace(restarts=0)
        self.models = StubModels(models or ["m"])

    def worker_exited(self, worker: str, incarnation: int, rc: int | None) -> None:
        self.exits.append((worker, incarnation, rc))

    def expect_workers(self, workers: set[str], model: str | None = None) -> None:
        self.expected = workers

    def worker_failed(self, worker: str, reason: str) -> None:
        self.failed = (worker, reason)


def run_supervisor(code: int, cfg: SupervisorConfig) -> tuple[StubRouter, Supervisor]:
    router = StubRouter()
    program = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    sup = Supervisor(router, [WorkerSpec("w0")], cfg, "tcp://127.0.0.1:1", program=program)  # type: ignore[arg-type]

    async def main() -> None:
        sup.start()
        await asyncio.wait_for(asyncio.gather(*(c.task for c in sup.children.values() if c.task)), timeout=30)

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


def test_a_model_unloaded_is_stopped_and_not_restarted_and_loads_again_as_a_new_incarnation():
    router = StubRouter(["a", "b"])
    program = [sys.executable, "-c", "import time; time.sleep(60)"]
    specs = [WorkerSpec("a-cpu0", model="a"), WorkerSpec("b-cpu0", model="b")]
    sup = Supervisor(router, specs, SupervisorConfig(restart_backoff_s=0.01), "tcp://127.0.0.1:1", program=program)  # type: ignore[arg-type]
    assert router.models.on_load == sup.load and router.models.on_unload == sup.unload

    async def main() -> None:
        sup.start()  # both are loaded on demand: nothing starts
        assert all(c.task is None for c in sup.children.values())
        assert sup.load("a") and not sup.load("nothing-here")
        while sup.pid("a-cpu0") is None:
            await asyncio.sleep(0.01)
        assert sup.pid("b-cpu0") is None
        sup.unload("a")
        task = sup.children["a-cpu0"].task
        assert task is not None
        await asyncio.wait_for(task, timeout=10)  # it ends instead of restarting the worker
        assert router.exits == [("a-cpu0", 1, -15)] and router.restarts == {}
        sup.load("a")
        while sup.pid("a-cpu0") is None:
            await asyncio.sleep(0.01)
        assert sup.children["a-cpu0"].incarnation == 2
        await sup.stop()

    asyncio.run(main())


def test_workers_spawned_before_the_router_exists_are_kept_and_their_exits_reported_once_it_is_attached():
    """`kvroute serve` spawns its workers before the router loads its vocabulary (commands/serve.py)."""
    quick = [sys.executable, "-c", "import sys; sys.exit(1)"]
    sup = Supervisor(None, [WorkerSpec("w0")], SupervisorConfig(restart_backoff_s=0.01, max_restarts=1), "tcp://127.0.0.1:1",
                     program=quick)  # fmt: skip
    router = StubRouter()

    async def main() -> None:
        await sup.spawn()
        child = sup.children["w0"]
        assert child.proc is not None and child.incarnation == 1
        await child.proc.wait()
        await asyncio.sleep(0.05)
        assert child.incarnation == 1  # exited, not yet restarted: its exit waits for the router
        sup.attach(router)  # type: ignore[arg-type]
        assert router.expected == {"w0"}
        sup.start()  # the running task is kept, not doubled
        assert child.task is not None
        await asyncio.wait_for(child.task, timeout=30)

    asyncio.run(main())
    assert router.exits == [("w0", 1, 1), ("w0", 2, 1)]  # the first exit reported after attach, then the restart's
    assert router.failed[0] == "w0"


def test_stopping_before_the_router_is_attached_ends_the_spawned_workers():
    """The router failed to load (a bad file, a port in use): the workers spawned for it are stopped."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup = Supervisor(None, [WorkerSpec("w0"), WorkerSpec("w1")], SupervisorConfig(), "tcp://127.0.0.1:1", program=sleeper)

    async def main() -> list[int | None]:
        await sup.spawn()
        procs = [c.proc for c in sup.children.values()]
        await asyncio.wait_for(sup.stop(), timeout=30)
        return [p.returncode for p in procs if p is not None]

    assert asyncio.run(main()) == [-15, -15]
