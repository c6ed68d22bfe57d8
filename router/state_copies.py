"""Saved states copied between workers: the jobs waiting for theirs.

When selection (router/select.py) places a request on an idle worker with a state another worker saved in host RAM
(`Dispatch.copy_from`), the request's slot is taken in the mirror at once, as for any dispatch, and its job waits here
while the saving worker sends a copy (`state_fetch`, answered with `state_copy` under the job's id); the job then goes
to its worker with the state (`job.state`: that worker keeps it in its host-RAM tier and restores it, worker/
state_copies.py). A state that is gone by then, or that has not come within TIMEOUT_S (its worker died or hangs),
leaves the job to go without it: what it reuses is then what its worker holds itself (`without_copy`, predicted when
it was placed). A message for a waiting job (a cancel) goes after the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol import Job

TIMEOUT_S = 3.0  # a copy not come by then: the job goes without it (prefill instead)


@dataclass
class PendingCopy:
    job: Job
    worker: str  # the job's worker (the copy's target)
    source: str  # the worker that saved the state
    without_copy: int  # prompt tokens the job reuses on its slot without the copy
    since: float
    later: list[Any] = field(default_factory=list)  # messages for the job sent while it waits (a cancel)


class StateCopies:
    def __init__(self) -> None:
        self.pending: dict[str, PendingCopy] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def wait(self, copy: PendingCopy) -> None:
        self.pending[copy.job.id] = copy

    def holds(self, job: str) -> bool:
        return job in self.pending

    def defer(self, job: str, msg: Any) -> None:
        self.pending[job].later.append(msg)

    def arrived(self, job: str, worker: str) -> PendingCopy | None:
        """The job waiting for the copy that `worker` just sent; None when none is (sent without it already)."""
        copy = self.pending.get(job)
        if copy is None or copy.source != worker:
            return None
        return self.pending.pop(job)

    def expired(self, now: float) -> list[PendingCopy]:
        """Jobs whose copy has not come within TIMEOUT_S: out of the wait, to go without it."""
        late = [c for c in self.pending.values() if now - c.since >= TIMEOUT_S]
        for c in late:
            del self.pending[c.job.id]
        return late
