"""A step's failures on the compute thread (worker/core.py): a slot whose memory is not what it believes (the slot
invariant), a `llama_decode` that failed, a bug met in a step. Each is counted and logged with an id; the slot is put
back to what it held before or cleared, and its job ends with an `internal` error carrying that id
(worker/job_ends.py). The worker goes on.
"""

from __future__ import annotations

import uuid

from common import logs
from protocol import EngineCounters, ErrorCode
from worker.batching import Planned
from worker.job_ends import JobEnds
from worker.llama import Llama
from worker.prefix import Prefixes
from worker.slots import Slot, SlotTable

log = logs.get(__name__)


def new_error_id() -> str:
    """The id a failure is logged with and reported to the job under."""
    return uuid.uuid4().hex[:16]


class Failures:
    """What a failure does to the slots of one llama context (`uncut`: their memory cannot be cut back at all)."""

    def __init__(
        self, llama: Llama, table: SlotTable, prefixes: Prefixes, ends: JobEnds, counters: EngineCounters, uncut: bool
    ) -> None:
        self.llama, self.table, self.prefixes, self.ends, self.counters = llama, table, prefixes, ends, counters
        self.uncut = uncut

    def check(self, slots: list[Slot]) -> None:
        """The invariant (worker/llama.py `holds`): each slot's memory holds exactly len(slot.tokens) positions (fewer
        after an M-RoPE image: `Slot.held_end`), its sliding-window layers the whole window before the next one. A
        violation is a bug."""
        for slot in slots:
            if self.llama.holds(slot.id, slot.held_end()):
                continue
            held, floor = self.llama.seq_len(slot.id), self.llama.seq_pos_min(slot.id)
            error_id = new_error_id()
            self.counters.invariant_violations += 1
            log.error("slot_invariant_violated", error_id=error_id, slot=slot.id, believed=slot.n_tokens, kv=held, kv_from=floor)
            believed = slot.n_tokens
            self.prefixes.clear(slot)
            if slot.task is not None:
                self.ends.error(
                    slot.task,
                    ErrorCode.INTERNAL,
                    f"slot {slot.id} believed it held {believed} tokens but its KV holds positions {floor}..{held - 1}; "
                    f"slot cleared (error {error_id})",
                    error_id,
                )

    def decode_failed(self, plan: list[Planned], ret: int) -> None:
        """llama_decode failed: put each affected slot back to what it held before, end its job with an error."""
        self.counters.decode_errors += 1
        error_id = new_error_id()
        log.error("decode_failed", error_id=error_id, ret=ret, rows=self.llama.batch.n, slots=[s.id for s, _, _ in plan])
        for slot, _, _ in plan:
            if self.llama.seq_len(slot.id) != slot.held_end():  # ubatches processed before the failure are kept
                trimmed = not self.uncut and self.llama.seq_rm(slot.id, slot.pos(), -1)
                if not trimmed or self.llama.seq_len(slot.id) != slot.held_end():
                    self.prefixes.clear(slot)
            if slot.task is not None:
                self.ends.error(
                    slot.task, ErrorCode.INTERNAL, f"llama_decode failed with code {ret} (error {error_id})", error_id
                )

    def step_failed(self, exc: Exception) -> None:
        """A bug in a step: every running job fails and its slot is cleared."""
        error_id = new_error_id()
        log.exception("engine_step_failed", error_id=error_id)
        for slot in self.table.busy():
            self.prefixes.clear(slot)
            if slot.task is not None:
                message = f"engine error {type(exc).__name__}: {exc} (error {error_id})"
                self.ends.error(slot.task, ErrorCode.INTERNAL, message, error_id)
