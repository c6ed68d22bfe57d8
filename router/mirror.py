"""The router's exact mirror of every slot: which tokens each slot's KV holds, and whether it is busy.

Contract (the worker's invariant, protocol/worker_messages.py): after a job the slot holds exactly the
first `slot_tokens` tokens of (prompt + generated tokens), and `slot_hash` is their token_hash.
- `assign` (dispatch): the slot becomes busy and is recorded as holding the prompt, so the index
  already routes on it; the previous contents are kept until the worker answers.
- `finish` / `fail` (the worker's report): the slot becomes idle holding what the report says. The
  mirror's own prediction is checked against the reported length and hash; on a mismatch it is
  counted, the slot is recorded as empty and marked `dirty`, and the next job on it is sent with
  prefix_cache=False so the worker clears it: the mirror is exact again after one job, never trusted
  while wrong.
- The mirror owns the `Index`; every change to a slot's tokens goes through here, so the two agree.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from kvroute.slots import EXACT_ROWS, SlotPhase
from protocol import token_hash
from router.index import Index, Tokens, as_tokens

EMPTY: Tokens = np.empty(0, dtype=np.int32)


@dataclass(eq=False)
class Slot:
    """One slot of one worker incarnation. Identity-hashed: it is the index's owner key."""

    worker: str
    index: int
    tokens: Tokens = field(default_factory=lambda: EMPTY)
    phase: SlotPhase = SlotPhase.IDLE
    job: str | None = None
    dirty: bool = False  # contents unknown: the next job clears the slot
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0  # jobs that reused at least min_match tokens here
    reused_total: int = 0
    before: Tokens | None = None  # contents before the running job, restored if the worker never touched it
    exact: bool = False  # the worker runs in deterministic mode (it reuses only KV computed in full-size ubatches)
    n_exact: int = 0  # leading tokens computed in full-size ubatches: what a deterministic worker reuses
    before_exact: int = 0
    rev: list[int] = field(default_factory=lambda: [0])  # shared by a worker's slots; bumped on any change

    @property
    def busy(self) -> bool:
        return self.phase is SlotPhase.BUSY

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Slot({self.worker}/{self.index}, {self.phase.value}, n={len(self.tokens)})"


@dataclass(frozen=True)
class Mismatch:
    """A report that disagreed with the mirror. `error_id` appears in the log line and the metrics."""

    worker: str
    slot: int
    job: str
    expected_tokens: int
    reported_tokens: int
    expected_hash: str
    reported_hash: str
    error_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class Mirror:
    """Every slot of every connected worker, and the one index over them."""

    def __init__(self) -> None:
        self.index = Index()
        self.workers: dict[str, list[Slot]] = {}
        self.mismatches = 0

    def add_worker(
        self,
        worker: str,
        n_slots: int,
        *,
        contents_known: bool = True,
        exact: bool = False,
        held: dict[int, tuple[Tokens, int]] | None = None,
    ) -> list[Slot]:
        """Slots of a newly accepted worker: holding what the worker reports (`held`: slot -> tokens, n_exact; a
        worker that outlived its router), else empty, or `dirty` when its KV may hold anything."""
        self.remove_worker(worker)
        rev = [0]
        slots = [Slot(worker, i, dirty=not contents_known, exact=exact, rev=rev) for i in range(n_slots)]
        for slot in slots:
            if held is None:
                continue
            if slot.index not in held:
                slot.dirty = True  # not reported: unknown
                continue
            tokens, n_exact = held[slot.index]
            if len(tokens):
                slot.tokens, slot.n_exact, slot.dirty = as_tokens(tokens), n_exact, False
                self.index.insert(slot, slot.tokens)
        self.workers[worker] = slots
        return slots

    def remove_worker(self, worker: str) -> list[Slot]:
        """Forget a worker: all its slots leave the index at once."""
        slots = self.workers.pop(worker, [])
        for s in slots:
            self.index.remove(s)
        return slots

    def slots(self) -> list[Slot]:
        return [s for slots in self.workers.values() for s in slots]

    def assign(self, slot: Slot, job: str, prompt: Tokens) -> None:
        if slot.busy:
            raise RuntimeError(f"{slot!r} is busy with {slot.job}, cannot take {job}")
        slot.phase, slot.job = SlotPhase.BUSY, job
        slot.before = None if slot.dirty else slot.tokens
        slot.before_exact = slot.n_exact
        slot.tokens = as_tokens(prompt)
        slot.dirty = False  # the job goes with prefix_cache=False when the slot was dirty
        self.index.insert(slot, slot.tokens)
        slot.last_used = time.monotonic()
        slot.rev[0] += 1

    def finish(
        self, slot: Slot, job: str, prompt: Tokens, generated: Tokens, slot_tokens: int, slot_hash: str
    ) -> Mismatch | None:
        """A JobDone: the slot holds the first `slot_tokens` of prompt + generated."""
        full = np.concatenate([prompt, generated]) if len(generated) else prompt
        return self._settle(slot, job, full, slot_tokens, slot_hash, len(prompt))

    def fail(
        self, slot: Slot, job: str, prompt: Tokens, streamed: Tokens, touched: bool, slot_tokens: int, slot_hash: str
    ) -> Mismatch | None:
        """A JobError. Untouched (slot -1): the slot holds what it held before the job."""
        if not touched:
            before, before_exact = slot.before, slot.before_exact
            self._idle(slot, EMPTY if before is None else before, dirty=before is None)
            slot.n_exact = before_exact if before is not None else 0
            return None
        full = np.concatenate([prompt, streamed]) if len(streamed) else prompt
        return self._settle(slot, job, full, slot_tokens, slot_hash, len(prompt))

    def lost(self, slot: Slot) -> None:
        """The job's outcome is unknown (cancelled without report): the slot's contents are unknown."""
        self._idle(slot, EMPTY, dirty=True)

    def check_idle(self, slot: Slot, n_tokens: int) -> bool:
        """A heartbeat's view of an idle slot; False (and the slot marked dirty) when the lengths differ."""
        if slot.busy or slot.dirty or n_tokens == len(slot.tokens):
            return True
        self.mismatches += 1
        self._idle(slot, EMPTY, dirty=True)
        return False

    def _settle(self, slot: Slot, job: str, full: Tokens, slot_tokens: int, slot_hash: str, n_prompt: int) -> Mismatch | None:
        held = full[:slot_tokens]
        if slot_tokens <= len(full) and token_hash(held) == slot_hash:
            self._idle(slot, held, dirty=False)
            # a deterministic worker computes every token of a prompt of EXACT_ROWS or more exactly, generated ones too
            slot.n_exact = slot_tokens if n_prompt >= EXACT_ROWS else 0
            return None
        self.mismatches += 1
        mm = Mismatch(slot.worker, slot.index, job, len(full), slot_tokens, token_hash(held), slot_hash)
        self._idle(slot, EMPTY, dirty=True)
        return mm

    def _idle(self, slot: Slot, tokens: Tokens, *, dirty: bool) -> None:
        slot.phase, slot.job, slot.before = SlotPhase.IDLE, None, None
        slot.tokens, slot.dirty, slot.n_exact = tokens, dirty, 0
        if len(tokens) and not dirty:
            self.index.insert(slot, tokens)
        else:
            self.index.remove(slot)
        slot.last_used = time.monotonic()
        slot.rev[0] += 1
