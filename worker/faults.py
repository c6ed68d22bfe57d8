"""Failpoints for the fault tests: faults that cannot be caused from outside the process, injected at the
point where they happen in production. Off unless `KVROUTE_FAULTS` is set (the worker logs it when it is).

`KVROUTE_FAULTS="crash:poison-,hang:stuck-"`: when a batch about to be decoded holds a job whose id starts with
`poison-`, the worker process dies at once (SIGKILL, as a crash inside llama.cpp would end it); with a job whose
id starts with `stuck-`, the compute thread blocks forever, as a `llama_decode` that never returns would, while
the I/O thread goes on answering and sending heartbeats. The router's job ids start with the client's request id.

`KVROUTE_FAULTS="segv:first-decode@w1"`: worker w1 (any worker without `@ID`) dies of a real SIGSEGV in its start
check's first decode, as a llama.cpp built for another CPU does (worker/startcheck.py).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

from common import logs

log = logs.get(__name__)

ACTIONS = ("crash", "hang", "segv")
START_POINTS = ("first-decode",)  # where a `segv` fault strikes


@dataclass(frozen=True)
class Faults:
    rules: tuple[tuple[str, str], ...] = ()  # (action, job id prefix)

    @classmethod
    def from_env(cls) -> Faults:
        spec = os.environ.get("KVROUTE_FAULTS", "").strip()
        if not spec:
            return cls()
        rules = []
        for item in spec.split(","):
            action, _, prefix = item.strip().partition(":")
            if action not in ACTIONS or not prefix:
                raise ValueError(f"KVROUTE_FAULTS: {item!r} is not ACTION:JOB_ID_PREFIX with ACTION one of {ACTIONS}")
            if action == "segv" and prefix.partition("@")[0] not in START_POINTS:
                raise ValueError(f"KVROUTE_FAULTS: {item!r}: segv takes a start point, one of {START_POINTS}[@WORKER_ID]")
            rules.append((action, prefix))
        return cls(tuple(rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def at_start(self, point: str, worker_id: str) -> None:
        for action, target in self.rules:
            where, _, who = target.partition("@")
            if action == "segv" and where == point and who in ("", worker_id):
                log.warning("fault_injected", action=action, point=point)
                os.kill(os.getpid(), signal.SIGSEGV)

    def before_decode(self, job_ids: list[str]) -> None:
        for action, prefix in self.rules:
            if action == "segv":
                continue
            if any(j.startswith(prefix) for j in job_ids):
                log.warning("fault_injected", action=action, prefix=prefix)
                if action == "crash":
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait()  # hang: this thread never comes back
