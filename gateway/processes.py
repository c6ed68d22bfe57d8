"""More HTTP processes beside `kvroute http`'s own (`--processes N`): children serving the same port with
SO_REUSEPORT (gateway/server.py `listen_socket`), so that the kernel spreads new connections over them and the HTTP
work runs on as many cores. Each child has its own connection to the router. One that dies is started again, after a
pause that doubles while children keep dying (a child that cannot start is not restarted at full speed); the
children end with their parent, also when it is killed (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from common import logs

if TYPE_CHECKING:
    from gateway.server import HttpConfig

log = logs.get(__name__)

PR_SET_PDEATHSIG = 1
CHECK_S = 1.0  # how often the parent looks at its children
RESTART_PAUSE_S = (1.0, 30.0)  # the first pause before a restart, and the longest
STEADY_S = 60.0  # a child up this long resets the pause


def _child(cfg: HttpConfig, index: int, parent: int) -> None:
    """A child's life: end with the parent, then serve until told to stop."""
    with contextlib.suppress(OSError, AttributeError):  # (not Linux: the parent's stop() still ends its children)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return  # the parent died before the signal was set
    import uvloop

    from gateway.server import serve_http

    logs.setup(process=f"http-{index}")
    uvloop.run(serve_http(cfg))


class HttpProcesses:
    """`n` children serving `cfg` beside this process."""

    def __init__(self, cfg: HttpConfig, n: int) -> None:
        self.cfg, self.n = cfg, n
        self.children: dict[int, BaseProcess] = {}
        self.started: dict[int, float] = {}
        self.pause = RESTART_PAUSE_S[0]
        self._mp = multiprocessing.get_context("spawn")  # (no copy of this process's event loop and sockets)

    async def beside(self, serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        """Run `serve` (this process's own HTTP server); once it listens, start the children and look after them.
        Cancelled, it stops the children and `serve` too."""
        ready = asyncio.Event()
        main = asyncio.ensure_future(serve(ready))
        listening = asyncio.ensure_future(ready.wait())
        try:
            await asyncio.wait([main, listening], return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                for index in range(1, self.n + 1):
                    self._start(index)
            while not main.done():
                await asyncio.wait([main], timeout=CHECK_S)
                self._look_after()
            await main  # (a bind error at start-up: reported by the caller)
        finally:
            listening.cancel()
            self.stop()
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await main

    def _start(self, index: int) -> None:
        child = self._mp.Process(target=_child, args=(self.cfg, index, os.getpid()), name=f"http-{index}", daemon=False)
        child.start()
        self.children[index], self.started[index] = child, time.monotonic()
        log.info("http_process_started", index=index, pid=child.pid)

    def _look_after(self) -> None:
        now = time.monotonic()
        for index, child in list(self.children.items()):
            if child.is_alive():
                if now - self.started[index] > STEADY_S:
                    self.pause = RESTART_PAUSE_S[0]
                continue
            if child.exitcode is not None and now - self.started[index] >= self.pause:
                log.warning("http_process_died", index=index, pid=child.pid, exitcode=child.exitcode)
                self.pause = min(self.pause * 2, RESTART_PAUSE_S[1])
                self._start(index)

    def stop(self) -> None:
        """End the children (SIGTERM: they finish their streams' bookkeeping), then kill what is left."""
        for child in self.children.values():
            if child.is_alive():
                child.terminate()
        deadline = time.monotonic() + 5.0
        for child in self.children.values():
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join(1.0)
        self.children.clear()
