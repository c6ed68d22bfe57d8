"""Supervision of local worker processes, Erlang-style: a worker that exits is restarted with backoff.

Each worker id runs one process at a time; every start is a new incarnation (so the router starts it
with empty slots). An exit is reported to the router at once (`Router.worker_exited`), which purges
the worker's slots and re-dispatches its unstarted requests in the same loop turn. A worker the router finds
hung (jobs and no engine progress), or silent long after it was declared dead (stopped), is killed here
(`kill`, the router's `on_kill`) and so restarted like one that crashed. More than
`max_restarts` restarts within `restart_window_s` stop the restarts for that worker, with a log line
saying so; exit status 3 (the router refused the worker) is not restarted either.

A crash at start is told from a crash under load by the worker's start record (common/start_record.py, one file per
worker in a directory of this supervisor's): a worker that died inside a start stage is logged with the stage and
signal; one that crashed there too often refuses to start (exit status 78) and is not restarted. Whenever a worker
is given up on, the router is told why (`Router.worker_failed`: /health, `kvroute status` and the requests that no
worker is left for say it).

Workers may be spawned before the router exists (`spawn`, then `attach`): a worker needs only the router's endpoint,
so its imports and model load overlap the router's own vocabulary load (`kvroute serve` of one model does this:
~1.5 s of a 4.5-5 s start on 2 cores). What a worker does before the router binds waits in ZMQ's queue; an exit
before `attach` is reported once the router is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from common import logs
from common.config import opt
from common.start_record import START_FAILED_EXIT, read_crash, read_refusal
from router.server import Router
from router.workers import Kill

log = logs.get(__name__)

REFUSED_EXIT = 3


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL if the supervising process dies, so no orphan keeps a device."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = opt(0.5, "first delay before restarting a worker that exited; doubles per quick restart")
    restart_backoff_max_s: float = opt(10.0, "longest delay before a restart")
    max_restarts: int = opt(5, "restarts allowed per worker within --restart-window-s before giving up on it")
    restart_window_s: float = opt(60.0, "window over which restarts are counted")


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one local worker: its id and its `kvroute worker` flags (except id/incarnation/connect)."""

    worker_id: str
    flags: tuple[str, ...] = ()
    model: str | None = None  # the router's model it serves (None: the default)


@dataclass
class _Child:
    spec: WorkerSpec
    incarnation: int = 0
    proc: asyncio.subprocess.Process | None = None
    restarts: deque[float] = field(default_factory=deque)
    given_up: bool = False
    task: asyncio.Task[None] | None = None
    unloading: bool = False  # stopped on purpose (its model unloaded): not restarted
    started: float = 0.0  # when this incarnation was spawned (time.monotonic)


class Supervisor:
    def __init__(
        self,
        router: Router | None,
        specs: list[WorkerSpec],
        cfg: SupervisorConfig,
        connect: str,
        *,
        program: list[str] | None = None,
    ) -> None:
        """`router` None: `attach` it later (the workers may be spawned before it exists)."""
        self._router: Router | None = None
        self._attached = asyncio.Event()
        self.specs = specs
        self.program = program or [sys.executable, "-m", "commands.cli", "worker"]  # tests put a stand-in here
        self.cfg = cfg
        self.connect = connect
        self.children = {s.worker_id: _Child(s) for s in specs}
        self.records = Path(tempfile.mkdtemp(prefix="kvroute-starts-"))  # each worker's start record (fresh per run)
        self._stopping = False
        if router is not None:
            self.attach(router)

    @property
    def router(self) -> Router:
        assert self._router is not None, "attach(router) first"
        return self._router

    def attach(self, router: Router) -> None:
        """The router the workers serve: told of their exits and failures, and told which to expect."""
        specs = self.specs
        self._router = router
        router.on_kill = self.kill
        for model in {s.model for s in specs}:
            router.expect_workers({s.worker_id for s in specs if s.model == model}, model)
        if router.models.dynamic():  # models loaded on demand and unloaded when idle (router/models.py decides)
            router.models.on_load, router.models.on_unload = self.load, self.unload
        self._attached.set()

    async def spawn(self) -> None:
        """Start every worker now, before the router is attached (one model, so every worker serves it); `start`
        then leaves them running."""
        for child in self.children.values():
            await self._spawn(child)
            child.task = asyncio.ensure_future(self._keep(child, spawned=True))

    def start(self) -> None:
        """Start the workers of every model loaded at start, in order while there is room (`--models-max`, the memory
        budget); the others load at their first request."""
        models = self.router.models
        for m in models:
            if not m.spec.load_at_start or models.short(m, models.loaded()) is not None:
                continue
            if self.load(m.name if len(models.cores) > 1 else None):
                models.started(m.name)

    def _of(self, model: str | None) -> list[_Child]:
        single = len(self.router.models.cores) == 1
        return [c for c in self.children.values() if single or c.spec.model == model]

    def load(self, model: str | None) -> bool:
        """Start the workers of `model` that are not running (False: it has none here)."""
        children = self._of(model)
        for child in children:
            child.unloading = False
            if child.task is None or child.task.done():
                child.given_up = False
                child.restarts.clear()
                child.task = asyncio.ensure_future(self._keep(child))
        return bool(children)

    def unload(self, model: str | None) -> None:
        """Stop the workers of `model` (SIGTERM: each drains and writes its slots to its disk tier, then exits)."""
        for child in self._of(model):
            child.unloading = True
            if child.proc is not None and child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.terminate()

    def pid(self, worker_id: str) -> int | None:
        proc = self.children[worker_id].proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def kill(self, kill: Kill) -> None:
        """SIGKILL a worker incarnation this supervisor runs (others: not ours, or already gone)."""
        child = self.children.get(kill.worker)
        if child is None or child.incarnation != kill.incarnation or child.proc is None or child.proc.returncode is not None:
            return
        log.warning("worker_killed", worker=kill.worker, incarnation=kill.incarnation, pid=child.proc.pid, reason=kill.reason)
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()

    def record(self, worker_id: str) -> Path:
        return self.records / f"worker-{worker_id}.start.json"

    def command(self, child: _Child) -> list[str]:
        wid = child.spec.worker_id
        return [
            *self.program, *child.spec.flags, "--connect", self.connect, "--worker-id", wid,
            "--incarnation", str(child.incarnation), "--start-record", str(self.record(wid)),
        ]  # fmt: skip

    async def _spawn(self, child: _Child) -> asyncio.subprocess.Process:
        child.incarnation += 1
        child.started = time.monotonic()
        extra = {"preexec_fn": _die_with_parent} if sys.platform.startswith("linux") else {}
        child.proc = await asyncio.create_subprocess_exec(*self.command(child), **extra)  # type: ignore[arg-type]
        log.info("worker_spawned", worker=child.spec.worker_id, incarnation=child.incarnation, pid=child.proc.pid)
        return child.proc

    async def _keep(self, child: _Child, spawned: bool = False) -> None:
        """Run the child's worker, and again when it exits, until stopped or given up on. `spawned`: its first
        incarnation is already running (`spawn`)."""
        wid = child.spec.worker_id
        delay = self.cfg.restart_backoff_s
        while not self._stopping and not child.unloading:
            proc = child.proc if spawned and child.proc is not None else await self._spawn(child)
            spawned, started = False, child.started
            rc = await proc.wait()
            await self._attached.wait()  # (an exit before the router exists is reported to it once it does)
            self.router.worker_exited(wid, child.incarnation, rc)
            if child.unloading:
                log.info("worker_stopped", worker=wid, incarnation=child.incarnation, returncode=rc, reason="model unloaded")
            if self._stopping or child.unloading:
                return
            log.warning("worker_exited", worker=wid, incarnation=child.incarnation, returncode=rc)
            if rc == START_FAILED_EXIT:
                child.given_up = True
                reason = read_refusal(self.record(wid)) or "it refused to start (exit status 78: it crashed at start)"
                log.error("worker_failed_at_start", worker=wid, reason=reason)
                self.router.worker_failed(wid, reason)
                return
            crash = read_crash(self.record(wid), proc.pid)
            if crash is not None:
                log.error("worker_crashed_at_start", worker=wid, incarnation=child.incarnation, returncode=rc, reason=crash)
            if rc == REFUSED_EXIT:
                child.given_up = True
                log.error("worker_not_restarted", worker=wid, reason="the router refused it (exit status 3)")
                self.router.worker_failed(wid, "the router refused it (another model or weights): it is not restarted")
                return
            now = time.monotonic()
            child.restarts.append(now)
            while child.restarts and now - child.restarts[0] > self.cfg.restart_window_s:
                child.restarts.popleft()
            if len(child.restarts) > self.cfg.max_restarts:
                child.given_up = True
                log.error(
                    "worker_restarts_exhausted",
                    worker=wid,
                    restarts=len(child.restarts),
                    window_s=self.cfg.restart_window_s,
                    reason="too many restarts; this worker stays down",
                )
                self.router.worker_failed(
                    wid, f"it exited {len(child.restarts)} times within {self.cfg.restart_window_s:g} s (the last: status {rc})"
                    "; it is not restarted again (--max-restarts)",
                )  # fmt: skip
                return
            # a worker that ran a while before dying restarts quickly; one that crash-loops backs off
            delay = self.cfg.restart_backoff_s if now - started > self.cfg.restart_window_s else delay
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.cfg.restart_backoff_max_s)
            self.router.restarts[wid] = self.router.restarts.get(wid, 0) + 1
            self.router.metrics.restarts += 1

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        procs = [c.proc for c in self.children.values() if c.proc is not None and c.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            for p in procs:
                await p.wait()
        tasks = [c.task for c in self.children.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        shutil.rmtree(self.records, ignore_errors=True)
