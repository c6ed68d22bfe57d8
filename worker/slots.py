"""The slot table: slot i is llama seq_id i and remembers exactly the tokens whose KV it holds.

Owned by the compute thread. Other threads may read `n_tokens`/`job_id` for heartbeats (plain attribute
reads; never mutate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.media import mrope_spans
from common.slots import SlotPhase, common_prefix

if TYPE_CHECKING:
    from worker.checkpoints import Checkpoint


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # exactly the tokens whose KV this seq holds, in position order
    phase: SlotPhase = SlotPhase.IDLE
    task: Any = None  # the running task (worker.engine.Task: a job's life in the worker) while BUSY
    last_used: int = 0
    # where it can be cut back to besides what its memory allows (worker/checkpoints.py), ascending
    checkpoints: list[Checkpoint] = field(default_factory=list)
    n_exact: int = 0  # leading tokens whose KV is what a cold prompt pass computes (see worker/core.py)
    salt: str = ""  # the tenant whose prompt it holds (Job.cache_salt); reused only by the same tenant
    # The model places image rows with M-RoPE (common/media.py): positions then lag behind indexes after an image.
    # `spans`: the images of `tokens` as `mrope_spans` gives them (start, end, lag after it); always empty without it.
    mrope: bool = False
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def pos(self, n: int | None = None) -> int:
        """The position of the token at index `n` (default: the next one), `n` not inside an image."""
        n = len(self.tokens) if n is None else n
        for _, end, lag in reversed(self.spans):
            if end <= n:
                return n - lag
        return n

    def held_end(self) -> int:
        """What llama.cpp reports this sequence holds (its highest position + 1): `pos()`, but for an M-RoPE image
        held last, whole or a part of it (its rows share the position of its first)."""
        if self.spans and self.spans[-1][0] < len(self.tokens) <= self.spans[-1][1]:
            return self.pos(self.spans[-1][0]) + 1
        return self.pos()

    def hold(self, tokens: list[int], n_exact: int, checkpoints: list[Checkpoint]) -> None:
        """The slot's memory now holds `tokens` (restored or copied whole)."""
        self.tokens, self.n_exact, self.checkpoints = tokens, n_exact, checkpoints
        self.spans = mrope_spans(tokens) if self.mrope else []

    def took_image(self, start: int, n_tokens: int, n_pos: int) -> None:
        """An image's rows were decoded at `start` (the tokens are extended by the caller)."""
        if self.mrope:
            lag = self.spans[-1][2] if self.spans else 0
            self.spans.append((start, start + n_tokens, lag + n_tokens - n_pos))

    @property
    def job_id(self) -> str | None:
        task = self.task
        return task.id if task is not None else None

    def keep(self, n: int) -> None:
        """The KV now holds only the first n tokens (after a trim); drop the checkpoints past them."""
        del self.tokens[n:]
        self.n_exact = min(self.n_exact, n)
        if self.spans and self.spans[-1][1] > n:
            self.spans = [span for span in self.spans if span[1] <= n]
        if self.checkpoints and self.checkpoints[-1].n_tokens > n:
            self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= n]


class SlotTable:
    """Slots plus the choice of a slot for a job that did not name one."""

    MIN_SIMILARITY = 0.1  # a cached prefix must cover >10% of the prompt to attract it (llama-server's default)

    def __init__(self, n: int, mrope: bool = False) -> None:
        self.slots = [Slot(i, mrope=mrope) for i in range(n)]
        self._clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def busy(self) -> list[Slot]:
        return [s for s in self.slots if s.phase is SlotPhase.BUSY]

    def pick(self, prompt: list[int], exclude: set[int], salt: str = "") -> Slot | None:
        """An idle slot for `prompt`: the longest useful cached prefix, else an empty slot, else the least recently used.

        None when every slot is busy or excluded. Mutates nothing.
        """
        idle = [s for s in self.slots if s.phase is SlotPhase.IDLE and s.id not in exclude]
        if not idle:
            return None
        best, best_lcp = None, 0
        for s in idle:
            lcp = common_prefix(s.tokens, prompt) if s.salt == salt else 0  # another tenant's prefix is not ours
            if lcp > best_lcp or (lcp == best_lcp and best is not None and s.last_used < best.last_used):
                best, best_lcp = s, lcp
        if best is not None and best_lcp > 1 and best_lcp > self.MIN_SIMILARITY * len(prompt):
            return best
        empty = [s for s in idle if not s.tokens]
        if empty:
            return empty[0]
        return min(idle, key=lambda s: s.last_used)

    def assign(self, slot: Slot, task: Any) -> None:
        assert slot.phase is SlotPhase.IDLE, f"slot {slot.id} is busy"
        slot.phase, slot.task = SlotPhase.BUSY, task
        self._touch(slot)

    def release(self, slot: Slot) -> None:
        slot.phase, slot.task = SlotPhase.IDLE, None
        self._touch(slot)

    def _touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.last_used = self._clock
