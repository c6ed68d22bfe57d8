"""How jobs end on the compute thread (worker/core.py), and what their routers are told: a job done (JobDone), failed
(JobError), handed back while the worker drains (JobError `draining`, which the router places again), or forgotten (its
router restarted or forgot this worker: no word, but a client reading its output itself is told).

A job's end says what its slot holds now (its tokens' hash, how far it can be cut back, its checkpoints, its exact
tokens) and which saved states changed since the last report, so that the router's mirror stays exact. Every message
goes to the job's sink (worker/outbox.py); a job ended without a word (`Task.silent`) sends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from common import logs
from protocol import (
    EngineCounters,
    Error,
    ErrorCode,
    FinishReason,
    JobDone,
    JobError,
    Message,
    SlotUpdate,
    pack_tokens,
    token_hash,
)
from worker.admission import Admission
from worker.checkpoints import cuts
from worker.embed_jobs import EmbedJobs
from worker.prefix import Prefixes
from worker.saved_states import SavedStates
from worker.slots import Slot, SlotTable
from worker.task import Sink, Task

log = logs.get(__name__)


def send(sink: Sink, msg: Message, silent: bool = False) -> None:
    """A job's message to its sink; a sink that fails is logged (the engine goes on)."""
    if silent:
        return
    try:
        sink(msg)
    except Exception:
        log.exception("sink_failed", message=type(msg).__name__)


class JobEnds:
    """Ending the jobs of one engine's slots (every method on the compute thread)."""

    def __init__(
        self,
        table: SlotTable,
        admission: Admission,
        prefixes: Prefixes,
        saved: SavedStates,
        embeds: EmbedJobs,
        counters: EngineCounters,
    ) -> None:
        self.table, self.admission, self.prefixes, self.saved = table, admission, prefixes, saved
        self.embeds, self.counters = embeds, counters

    def done(self, task: Task, slot: Slot, reason: FinishReason) -> None:
        """The job ended well (a stop, its length, cancelled, its deadline): JobDone with what its slot holds now."""
        now = time.monotonic()
        held = len(task.prompt) + len(task.generated)
        if slot.n_tokens > held:  # guessed tokens past where the job ended (it stopped mid-guess)
            self.prefixes.unguess(slot, held)
        n_prompt, (reused, restored) = (
            (task.n_prompt, task.first_reuse) if task.earlier else (len(task.prompt), (task.reused, task.restored))
        )
        output = task.output
        done = JobDone(
            id=task.id,
            slot=slot.id,
            finish_reason=reason.value,
            text=task.stream.full_text(),
            tokens=pack_tokens(output),
            prompt_tokens=n_prompt,
            reused_tokens=reused,
            restored_tokens=restored,
            prefilled_tokens=n_prompt - reused,
            generated_tokens=len(output),
            slot_tokens=slot.n_tokens,
            slot_hash=token_hash(slot.tokens),
            slot_min_keep=self.prefixes.min_keep(slot),
            slot_cuts=cuts(slot.checkpoints),
            slot_n_exact=slot.n_exact,
            timings=task.timings(now),
            stop=task.stream.stop,
        )
        if task.earlier:
            done.resumed_reused, done.resumed_restored = task.reused, task.restored
        if not task.silent:
            done.cache_added, done.cache_dropped, done.disk_dropped = self.saved.changes()
        self.release(task, slot)
        self.counters.jobs_done += 1
        log.debug("job_done", request_id=task.id, slot=slot.id, finish=reason.value, generated=len(task.generated))
        send(task.sink, done, task.silent)

    def saved_changed(self, task: Task) -> None:
        """Jobs were placed: the saved states their placing added (what their slots held, saved before they were
        overwritten) and dropped go to the router now, through one of those jobs (a `slot_update` of no slot), rather
        than with a job's end: a request coming meanwhile may want them, on this worker or copied to another."""
        if task.silent:
            return  # (its router forgot it: the next job's report says them)
        added, dropped, disk_dropped = self.saved.changes()
        if not (added or dropped or disk_dropped):
            return
        update = SlotUpdate(slot=-1, epoch=0, tokens=b"", cache_added=added, cache_dropped=dropped, disk_dropped=disk_dropped)
        send(task.sink, update)

    def error(self, task: Task, code: ErrorCode, message: str, error_id: str | None = None) -> None:
        """End a job with an error, reporting what its slot (if any) holds now."""
        slot = self.table[task.slot] if task.slot >= 0 else None
        msg = JobError(id=task.id, code=code, message=message, error_id=error_id)
        if task.job.reply_to:  # (its router saw none of the output: the mirror needs it)
            msg.tokens = pack_tokens(task.output)
        if not task.silent:
            msg.cache_added, msg.cache_dropped, msg.disk_dropped = self.saved.changes()
        if slot is not None:
            msg.slot, msg.slot_tokens, msg.slot_hash = slot.id, slot.n_tokens, token_hash(slot.tokens)
            msg.slot_min_keep, msg.slot_n_exact = self.prefixes.min_keep(slot), slot.n_exact
            msg.slot_cuts = cuts(slot.checkpoints)
            self.release(task, slot)
        else:
            self.admission.forget(task)
        self.counters.jobs_failed += 1
        send(task.sink, msg, task.silent)

    def suspend(self, task: Task, slot: Slot) -> None:
        """A job whose output has begun gives its slot to one of higher priority (JobCancel.preempt): the slot keeps what
        it computed (its prompt and output but the last token, whose KV the next step would have computed), the router
        is told so (JobError `preempted`, `suspended`, with its output's tokens) and the job waits, its sampler, grammar
        and text held as they are, until the router places it again (Job.resume: worker/admission.py `resume`)."""
        output = task.output
        msg = JobError(
            id=task.id,
            code=ErrorCode.PREEMPTED,
            message=f"suspended after {len(output)} tokens for a job of higher priority",
            tokens=pack_tokens(output),
            suspended=True,
            slot=slot.id,
            slot_tokens=slot.n_tokens,
            slot_hash=token_hash(slot.tokens),
            slot_min_keep=self.prefixes.min_keep(slot),
            slot_cuts=cuts(slot.checkpoints),
            slot_n_exact=slot.n_exact,
        )
        if not task.silent:
            msg.cache_added, msg.cache_dropped, msg.disk_dropped = self.saved.changes()
        self.table.release(slot)
        self.admission.park(task)
        self.counters.jobs_suspended += 1
        log.info("job_suspended", request_id=task.id, slot=slot.id, generated=len(output), slot_tokens=slot.n_tokens)
        send(task.sink, msg, task.silent)

    def release(self, task: Task, slot: Slot) -> None:
        self.table.release(slot)
        self.admission.forget(task)

    def hand_back(self, running: bool) -> int:
        """End waiting jobs (and running ones when `running`) with `draining`; how many, embed jobs too."""
        reqs = self.admission.take_waiting() + self.admission.take_parked()  # (a draining worker resumes none)
        if running:
            reqs += [slot.task for slot in self.table.busy() if slot.task is not None]
        for task in reqs:
            self.error(task, ErrorCode.DRAINING, "the worker is shutting down; this job was handed back")
        return len(reqs) + (self.embeds.hand_back() if running else 0)  # (waiting embed jobs finish while draining)

    def forget(self, only: Collection[str] | None = None) -> int:
        """End jobs (every one, or those `only` names) without a word; their slots keep the KV they computed."""
        waiting, parked = self.admission.take_waiting(), self.admission.take_parked()
        if only is not None:  # the others wait on, in their order
            waiting, kept = [t for t in waiting if t.id in only], [t for t in waiting if t.id not in only]
            self.admission.put_back(kept)
            parked, still = [t for t in parked if t.id in only], [t for t in parked if t.id not in only]
            for task in still:
                self.admission.park(task)
        running = [s for s in self.table.busy() if s.task is not None and (only is None or s.task.id in only)]
        reqs = [*waiting, *parked, *(slot.task for slot in running)]
        for task in waiting + parked:
            self.admission.forget(task)
        for slot in running:
            self.release(slot.task, slot)  # the slot keeps the KV its job computed
        for task in reqs:
            self.orphaned(task)
        forgotten = len(reqs) + len(self.embeds.take(only))  # (embed jobs: a router that forgot them reads no reply)
        if forgotten:
            log.info("jobs_forgotten", jobs=forgotten, reason="the router does not know this worker any more")
        return forgotten

    def reset(self) -> None:
        """Forget every job without a word and clear every slot and the host-RAM tier (a router with an empty mirror)."""
        for task in self.admission.take_waiting() + self.admission.take_parked():
            self.orphaned(task)
            self.admission.forget(task)
        for slot in self.table.slots:
            if slot.task is not None:
                self.orphaned(slot.task)
                self.release(slot.task, slot)
            self.prefixes.clear(slot)
        self.embeds.take()
        self.saved.host.clear()
        log.info("slots_reset", slots=len(self.table))

    def orphaned(self, task: Task) -> None:
        """A job its router forgot (the router restarted) ends here without a report; a client reading its output
        itself is told (no router will tell it)."""
        task.silent = True
        if task.job.reply_to:
            message = "the router that placed this request restarted and forgot it; its output stopped here"
            send(task.sink, Error(id=task.id, code=ErrorCode.ROUTER_LOST, message=message))
