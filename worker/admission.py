"""Admission: a job from its arrival to a slot. A job is checked (its slot, its tokens, its length, its sampling and
grammar) and refused before any work, or waits in arrival order until a slot is free for it: the slot it names, else
the idle slot holding most of its prompt (worker/slots.py `pick`), placed with its prefix (worker/prefix.py `place`).

Owned by the engine's compute thread (worker/core.py), which also asks it for every job it holds by id.
"""

from __future__ import annotations

import collections
import time

import msgspec
import numpy as np

from common.media import digest, image_n_pos, image_tokens
from common.slots import SlotPhase
from common.vocab import Vocab
from protocol import EngineCounters, ErrorCode, Job, JobError, Overflow, Refusal, outside_vocab, unpack_tokens, vocab_message
from worker.guide import Guide, GuideError, GuideTokenizer
from worker.prefix import Prefixes
from worker.sampling import Sampler, SamplingError
from worker.slots import Slot, SlotTable
from worker.stopping import TextStream
from worker.task import Sink, Task

MS = 1000.0


def suspendable(task: Task) -> bool:
    """Whether a job whose output has begun can be suspended and resumed with nothing changed: a seeded job's tokens
    depend on how its rows are computed (worker/core.py), and a job with images would compute them again from their
    bytes when its KV is gone. (A client reading the output itself reads on: the job keeps its id and its worker.)"""
    return not task.seeded and not task.images


class Admission:
    """The jobs waiting for a slot, in arrival order, and every job the worker holds (waiting or running) by id."""

    def __init__(
        self,
        vocab: Vocab,
        guide_tokenizer: GuideTokenizer,
        table: SlotTable,
        prefixes: Prefixes,
        counters: EngineCounters,
        n_ctx: int,
    ) -> None:
        self.vocab, self.guide_tokenizer = vocab, guide_tokenizer
        self.table, self.prefixes, self.counters = table, prefixes, counters
        self.n_ctx = n_ctx
        self.waiting: collections.deque[Task] = collections.deque()
        self.by_id: dict[str, Task] = {}
        self.parked: dict[str, Task] = {}  # suspended jobs (in `by_id` too), until the router resumes them (`resume`)
        self.draining = False
        self.vision = False  # the worker has a projector (--mmproj): it takes jobs with images

    def accept(self, job: Job, sink: Sink, t_arrival: float) -> JobError | None:
        """Queue a job; or the error that answers it before any work."""
        if job.resume:
            return self.resume(job)
        prompt = unpack_tokens(job.tokens)
        refusal = self.refusal(job, prompt)
        if refusal is not None:
            return refusal.job_error(job.id)
        max_tokens = job.sampling.max_tokens
        max_gen = self.n_ctx - len(prompt) if max_tokens is None else max_tokens
        deadline = t_arrival + job.deadline_ms / MS if job.deadline_ms else None
        task = Task(id=job.id, job=job, prompt=prompt, sink=sink, max_gen=max_gen, t_arrival=t_arrival, deadline=deadline)
        task.stream = TextStream(job.sampling.stop)
        task.images = {image.start: image for image in job.images}
        try:
            guide = None if job.constraint is None else Guide(job.constraint, self.guide_tokenizer)
            task.sampler = Sampler(job.sampling, self.vocab.n_vocab, guide=guide, max_gen=max_gen, piece=self.vocab.piece)
        except (SamplingError, GuideError) as exc:
            return Refusal(ErrorCode.BAD_REQUEST, str(exc)).job_error(job.id)
        self.by_id[job.id] = task
        self.waiting.append(task)
        return None

    def resume(self, job: Job) -> JobError | None:
        """A suspended job goes on (Job.resume): it waits for its slot first in line, its prompt now its prompt and what
        it generated (the last of which its slot computes as a prompt token, giving the logits it samples on from)."""
        task = self.parked.pop(job.id, None)
        if task is None:
            return Refusal(ErrorCode.BAD_REQUEST, f"job {job.id!r} is not suspended on this worker").job_error(job.id)
        if (missing := self.no_slot(job)) is not None:
            self.parked[job.id] = task
            return missing.job_error(job.id)
        prompt = unpack_tokens(job.tokens)
        if prompt != task.prompt + task.generated:  # (the router's record of it is not the job's: a bug, failed with an id)
            self.counters.invariant_violations += 1
            raise RuntimeError(f"resumed with {len(prompt)} tokens that are not its prompt and output")
        if not task.earlier:  # (its first suspension: what it reports counts from its first placing)
            task.n_prompt, task.first_reuse = len(task.prompt), (task.reused, task.restored)
        task.job = msgspec.structs.replace(
            task.job, slot=job.slot, predicted_reuse=job.predicted_reuse, prefix_cache=job.prefix_cache
        )
        task.earlier = task.earlier + task.generated
        task.max_gen -= len(task.generated)
        task.prompt, task.generated = prompt, []
        task.drafter, task.draft, task.withheld, task.checkpoint_at = None, [], False, []
        task.paused, task.paused_at, task.passed_over = 0, 0.0, 0
        self.waiting.appendleft(task)
        return None

    def refusal(self, job: Job, prompt: list[int]) -> Refusal | None:
        if self.draining:
            return Refusal(ErrorCode.DRAINING, "this worker is draining and takes no new jobs")
        if job.id in self.by_id:
            return Refusal(ErrorCode.BAD_REQUEST, f"job id {job.id!r} is already running on this worker")
        if (missing := self.no_slot(job)) is not None:
            return missing
        if job.images and (problem := self.image_problem(job, prompt)) is not None:
            return Refusal(ErrorCode.BAD_REQUEST, problem)
        texts = [t for t in prompt if t >= 0] if job.images else prompt  # (an image's ids are checked above)
        if (bad := outside_vocab(texts, self.vocab.n_vocab)) is not None:
            return Refusal(ErrorCode.BAD_REQUEST, f"prompt: {vocab_message(bad, self.vocab.n_vocab)}")
        if (numbers := Overflow.of(len(prompt), job.sampling.max_tokens, self.n_ctx)) is not None:  # (protocol `fits`)
            return Refusal(ErrorCode.CONTEXT_OVERFLOW, numbers.slot_message(), overflow=numbers)
        return None

    def no_slot(self, job: Job) -> Refusal | None:
        """The refusal of a job naming a slot this worker does not have."""
        if job.slot < len(self.table):
            return None
        return Refusal(ErrorCode.BAD_REQUEST, f"slot {job.slot} does not exist (this worker has slots 0..{len(self.table) - 1})")

    def image_problem(self, job: Job, prompt: list[int]) -> str | None:
        """Why the job's images cannot be computed here: no projector, or ids that are not its images' (common/media.py:
        what the slot would believe it holds must be what its KV gets)."""
        if not self.vision:
            return "this worker has no vision projector (start it with --mmproj FILE): it cannot read images"
        covered = 0
        for image in job.images:
            end = image.start + image.n_tokens
            if end > len(prompt) - 1:
                return f"an image at {image.start} reaches the prompt's end: a text token must follow it"
            n_pos = image_n_pos(prompt, image.start, image.n_tokens)  # (checked against the projector's as it decodes)
            ids = image_tokens(digest(image.data), image.n_tokens, n_pos) if 0 < n_pos <= image.n_tokens else None
            if ids is None or not np.array_equal(prompt[image.start : end], ids):
                return f"the prompt's ids at {image.start}..{end - 1} are not those of its image"
            covered += image.n_tokens
        if sum(1 for t in prompt if t < 0) != covered:
            return "the prompt has image ids that no image of the job covers"
        return None

    def cancel(self, job_id: str) -> None:
        task = self.by_id.get(job_id)
        if task is not None:
            task.cancelled = True

    def preempt(self, job_id: str, suspend: bool) -> None:
        """Hand the job back (ErrorCode.PREEMPTED) unless it has sampled a token by the next step; with `suspend`, one
        that has is suspended instead where it can be resumed exactly (`suspendable`; worker/core.py `_expire`)."""
        task = self.by_id.get(job_id)
        if task is not None and task.id not in self.parked and (not task.generated or (suspend and suspendable(task))):
            task.preempt = True

    def park(self, task: Task) -> None:
        """A job suspended (its slot released): it waits here, held as it is, for the router to resume it."""
        task.slot, task.preempt = -1, False
        self.parked[task.id] = task

    def expired(self) -> list[tuple[Task, ErrorCode]]:
        """Take the waiting jobs that were cancelled or ran past their deadline (the engine ends them)."""
        now = time.monotonic()
        gone = [t for t in self.waiting if t.cancelled or t.preempt or (t.deadline is not None and now >= t.deadline)]
        for task in gone:
            self.waiting.remove(task)
        gone += [t for t in self.parked.values() if t.cancelled or (t.deadline is not None and now >= t.deadline)]

        def code(t: Task) -> ErrorCode:
            return ErrorCode.CANCELLED if t.cancelled else ErrorCode.PREEMPTED if t.preempt else ErrorCode.DEADLINE_EXCEEDED

        return [(t, code(t)) for t in gone]

    def admit(self) -> list[Task]:
        """Give idle slots to waiting jobs, in arrival order; a job naming a busy slot waits for it (FIFO). Each job is
        placed before the next is looked at: a later one may wait for the prefix an earlier one is about to compute.
        Returns the jobs placed."""
        if not self.waiting:
            return []
        placed: list[Task] = []
        claimed: set[int] = set()
        still: collections.deque[Task] = collections.deque()
        for task in self.waiting:
            slot = self._slot_for(task, claimed)
            if slot is None:
                still.append(task)
                continue
            claimed.add(slot.id)
            self.table.assign(slot, task)
            self.prefixes.place(task, slot)
            placed.append(task)
        self.waiting = still
        return placed

    def _slot_for(self, task: Task, claimed: set[int]) -> Slot | None:
        if task.job.slot >= 0:
            slot = self.table[task.job.slot]
            if slot.phase is SlotPhase.BUSY or slot.id in claimed or self.prefixes.awaits(task):
                claimed.add(slot.id)  # (a later job naming it waits behind this one)
                return None
            return slot
        if self.prefixes.awaits(task):
            return None
        return self.table.pick(task.prompt, claimed, task.job.cache_salt)

    def take_waiting(self) -> list[Task]:
        """Every waiting job, out of the queue (still held by id until forgotten)."""
        tasks = list(self.waiting)
        self.waiting.clear()
        return tasks

    def put_back(self, tasks: list[Task]) -> None:
        """Jobs taken out by `take_waiting` wait again, first, in their order."""
        self.waiting.extendleft(reversed(tasks))

    def take_parked(self) -> list[Task]:
        """Every suspended job, no longer waiting to be resumed (still held by id until forgotten)."""
        tasks = list(self.parked.values())
        self.parked.clear()
        return tasks

    def forget(self, task: Task) -> None:
        """The job has ended: let go of it and its sampler."""
        self.by_id.pop(task.id, None)
        self.parked.pop(task.id, None)
        if task.sampler is not None:
            task.sampler.free()
            task.sampler = None

    def forget_id(self, job_id: str) -> None:
        task = self.by_id.get(job_id)
        if task is not None and task in self.waiting:
            self.waiting.remove(task)
        if task is not None:
            self.forget(task)
