"""A job's life inside the worker: the Job message it came as, its prompt, its sampler and what it produced so far.

`Slot.task` holds one while the slot runs it (worker/slots.py); the engine (worker/engine.py) owns both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import Job, JobImage, Message, Timings
from worker.sampling import Sampler
from worker.slots import Slot
from worker.speculate import Drafter
from worker.stopping import TextStream

Sink = Callable[[Message], None]

MS = 1000.0
# a job paused this long for jobs of higher priority (in all) runs beside them until it ends: priority never starves
PRIORITY_MAX_PAUSE_S = 20.0


@dataclass(eq=False)
class Task:
    """One job in the worker (`job`: the Job message it came as). Progress is derived: prefilling while nothing is
    sampled, then decoding."""

    id: str
    job: Job
    prompt: list[int]
    sink: Sink
    max_gen: int
    t_arrival: float
    deadline: float | None
    slot: int = -1
    reused: int = 0
    restored: int = 0  # of `reused`: copied in from another slot or host RAM
    sampler: Sampler | None = None
    stream: TextStream = field(default_factory=TextStream)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    silent: bool = False  # reset by a router restart: the new router does not know this job
    t_assigned: float = 0.0
    passed_over: int = 0  # steps in a row in which its prompt got no prefill budget
    drafter: Drafter | None = None  # speculation: guesses from this job's history
    draft: list[int] = field(default_factory=list)  # the guessed tokens in the batch being decoded
    withheld: bool = False  # no guess in that batch: its guesses were taken too rarely to pay there
    exact_chunk: bool = False  # its prompt chunk in that batch is padded as a seeded job's is (worker/batching.py)
    checkpoint_at: list[int] = field(default_factory=list)  # prompt positions where its slot takes a checkpoint
    images: dict[int, JobImage] = field(default_factory=dict)  # the prompt's images by where they start
    t_first: float = 0.0
    paused: int = 0  # steps in a row that left it out for a job of higher priority (`runnable`, below)
    paused_s: float = 0.0  # seconds it was left out so, in all
    paused_at: float = 0.0  # when its current pause began (0: running)
    preempt: bool = False  # the router asks for it back, if it has sampled no token yet (JobCancel.preempt)
    aged: bool = False  # paused PRIORITY_MAX_PAUSE_S in all: computed beside the jobs of higher priority from now on
    # Suspended after its output began, for a job of higher priority (JobCancel.preempt), then resumed (Job.resume):
    # its prompt now ends with the tokens it generated before (`earlier`), and its report counts from its first placing
    # (`n_prompt`, `first_reuse`: the prompt as it came, and what that reused and restored)
    earlier: list[int] = field(default_factory=list)
    n_prompt: int = 0
    first_reuse: tuple[int, int] = (0, 0)

    @property
    def seeded(self) -> bool:
        """A seed asks for the same tokens every time the same job comes (worker/core.py's docstring)."""
        return self.job.sampling.seed is not None

    @property
    def output(self) -> list[int]:
        """Every token it generated, before a suspension too."""
        return self.earlier + self.generated if self.earlier else self.generated

    @property
    def priority(self) -> int:
        """1 interactive, 0 normal, -1 background: while a job of higher priority runs, this one's steps wait."""
        return self.job.priority

    def timings(self, now: float) -> Timings:
        """Its times from arrival to `now` (its end), in ms: waiting for a slot, reading its prompt, generating."""
        t_first = self.t_first or now
        return Timings(
            queue_ms=(self.t_assigned - self.t_arrival) * MS,
            prefill_ms=(t_first - self.t_assigned) * MS,
            decode_ms=(now - t_first) * MS,
            ttft_ms=(t_first - self.t_arrival) * MS,
            total_ms=(now - self.t_arrival) * MS,
        )


def runnable(busy: list[Slot]) -> list[Slot]:
    """The busy slots a step computes: those whose job has the highest priority among them (all of them when every
    job has one priority), and those paused too long already (`Task.aged`: PRIORITY_MAX_PAUSE_S); the rest are paused
    until no job of higher priority runs."""
    busy = [s for s in busy if s.task is not None]
    top = top_priority(busy)
    return [s for s in busy if s.task.aged or s.task.priority == top]


def top_priority(busy: list[Slot]) -> int:
    """The highest priority among the busy slots' jobs (0 when none)."""
    return max((s.task.priority for s in busy if s.task is not None), default=0)
