"""Context checkpoints: for a memory that cannot be cut back to any prefix, saved states of the part that cannot, at
chosen positions of a slot's tokens, so that a prompt sharing only part of what the slot holds resumes from the
checkpoint nearest below the shared part instead of from zero.

Which part: a recurrent or hybrid model's recurrent state (Mamba, gated delta-net, short convolutions: one state per
sequence, always at its last position), and the sliding-window layers of a model whose window cache keeps only its
window (`swa_full` off). llama.cpp writes and reads that part alone (`llama_state_seq_*_ext` with
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY); the full-attention KV is not in a checkpoint: it is cut (`seq_rm`) where the
checkpoint was taken. So a checkpoint costs the recurrent state (or one window of the window layers), whatever its
position: `Llama.partial_size`.

Where a slot takes them while it reads a prompt (`positions`), as llama-server places its `--ctx-checkpoints`:
- where the job's new tokens begin (what it reused: in a conversation, where the turn began);
- where the prompt parts from the longest prefix a slot or saved state holds, when it could not be given (a slot or
  state cannot be cut back there): two prompts branch there, a third that does is likely (a shared system prompt
  followed by another conversation; SGLang's radix tree splits its nodes where they do);
- every `every` tokens of a long prompt (positions that are multiples of it, the same for every prompt);
- END_OFFSETS before the prompt's end (llama-server's 4 + n_ubatch and 4: next turn a chat template often renders
  the generation prompt, or the last message, otherwise), in deterministic mode far enough apart for exact chunks;
- at its end (the reply re-sent otherwise next turn, as when a template drops past reasoning, resumes there).
A prompt chunk ends at each (worker/batching.py), and the checkpoint is taken once the slot holds exactly that many
tokens (worker/core.py). The router knows each slot's checkpoint positions (JobDone.slot_cuts) and predicts reuse
with the rule the worker follows (common/slots.py `restore_keep`).

A full window cache (`swa_full`) is cut back anywhere, but a state saved from it (`llama_state_seq_get_data`) holds
its window layers' last window alone: once restored it can be cut back only within its last window, or to a
checkpoint. So its slots take checkpoints too (`for_saves`: where the turn's new tokens begin, every `every`, at the
prompt's end), kept with a saved state that cannot be cut back anywhere itself (worker/prefix.py `save`), and such a
state gets more as the slot is cut back past them (`on_save`: no prompt chunk ends there): TAIL tokens before its end,
and one every window below that. Measured on Mooncake's conversation trace (bench/trace_replay.py): without them a
restored state longer than the window gave nothing of a next turn that shares all but its last few tokens, its prompt
but not its reply, or its first blocks only (a prompt sharing 1,161 tokens of a 1,286-token state computed all of them).

Budget: at most `max_count` checkpoints and `slot_bytes` bytes per slot, `total_bytes` for all slots of the worker;
the oldest go first (the slot's own, then the least recently used slot's). A saved state in host RAM or on disk keeps
its slot's checkpoints with it (counted in that tier's bytes).

Owned by the engine's compute thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.slots import EXACT_ROWS

if TYPE_CHECKING:
    from worker.llama import StateData

TAIL = 32  # tokens before a saved state's end where it keeps a checkpoint too (`for_saves`)
FOR_SAVES_MAX = 4  # a full window cache's slot keeps this many at most (where its last two turns began and ended)
END_OFFSETS = (4,)  # tokens before a prompt's end (llama-server: 4 and 4 + n_ubatch, `n_batch` added below)
_order = itertools.count()


@dataclass(eq=False)
class Checkpoint:
    """The part of a sequence's memory that cannot be cut, saved when the sequence held exactly its first
    `n_tokens` tokens (immutable once taken; a slot and the saved states copied from it share it)."""

    n_tokens: int
    data: StateData
    order: int = field(default_factory=lambda: next(_order))  # when it was taken: the oldest go first

    @property
    def nbytes(self) -> int:
        return len(self.data)


class Holder(Protocol):
    """What keeps checkpoints: a slot (worker/slots.py)."""

    checkpoints: list[Checkpoint]
    last_used: int


def cuts(checkpoints: list[Checkpoint]) -> list[int]:
    """Their positions, ascending (what the router is told: CacheEntry.cuts, JobDone.slot_cuts)."""
    return [c.n_tokens for c in checkpoints]


def positions(start: int, end: int, every: int, n_batch: int, exact: bool, near_end: bool = True, branch: int = 0) -> list[int]:
    """Where a slot reading prompt tokens `start`..`end` takes checkpoints (see the module docstring), ascending. In
    deterministic mode (`exact`) every chunk between two of them is at least EXACT_ROWS tokens (worker/core.py).
    `near_end` False: none of END_OFFSETS (`for_saves`); `branch`: where the prompt parts from what is held."""
    gap = EXACT_ROWS if exact else 1
    want: set[int] = {branch}
    if every > 0:
        want.update(range((start // every + 1) * every, end, every))
    for offset in END_OFFSETS if near_end else ():
        far = max(offset, gap)
        want.update((end - far, end - far - n_batch))
    out = [start]
    for p in sorted(want):
        if start < p < end and p - out[-1] >= gap and end - p >= gap:
            out.append(p)
    return [*out, end]


def for_saves(start: int, end: int, every: int, n_batch: int, exact: bool, branch: int = 0) -> list[int]:
    """Where a slot of a full window cache takes checkpoints: only for the states saved from it, whose window layers
    hold their last window alone (llama.cpp writes no more of them), so that such a state, restored, can still be cut
    back to where a turn began, branched off what was held, or ended (the next turn shares the prompt and not the
    reply, when a template drops it or a client rewrites it). None of END_OFFSETS: those need prompt chunks ended early
    in every prompt, and the slot itself needs none of them."""
    return positions(start, end, every, n_batch, exact, near_end=False, branch=branch)


def on_save(keep: int, n: int, window: int, floor: int, taken: Sequence[int]) -> list[int]:
    """Where a slot of a full window cache holding `n` tokens, about to keep only `keep` of them, takes checkpoints for
    the state saved from it (no prompt chunk needs to end there: the slot still holds every position, and is cut back
    past each on the way down), descending: TAIL tokens before its end, and every `window` tokens below that, so that
    the state, restored, can be cut back to within a window of any position it holds, at about the memory the slot held
    (each checkpoint is a window's worth). Only above `keep`, from `floor` (where the slot's own memory can be cut back
    to: a restored state's window begins late) and where it has none (`taken`)."""
    want = {n - TAIL, *range(window, n - TAIL, window)} if window > 0 else {n - TAIL}
    return sorted((p for p in want if p > keep and p >= max(floor, 1) and p not in taken), reverse=True)


def at(checkpoints: list[Checkpoint], n: int) -> Checkpoint | None:
    """The checkpoint at exactly `n` tokens, if any."""
    return next((c for c in checkpoints if c.n_tokens == n), None)


def within(checkpoints: list[Checkpoint], n: int) -> list[Checkpoint]:
    """Those a sequence cut to its first `n` tokens keeps (the later ones were of tokens it no longer holds)."""
    return [c for c in checkpoints if c.n_tokens <= n]


class Budget:
    """The checkpoints' memory: per slot and for the whole worker."""

    def __init__(self, max_count: int, slot_bytes: int, total_bytes: int) -> None:
        self.max_count, self.slot_bytes, self.total_bytes = max_count, slot_bytes, total_bytes

    def fits(self, nbytes: int) -> bool:
        return self.max_count > 0 and nbytes <= min(self.slot_bytes, self.total_bytes)

    def add(self, slot: Holder, ckpt: Checkpoint, slots: Sequence[Holder]) -> bool:
        """Give `slot` the checkpoint, making room by dropping the oldest ones; False when it can never fit."""
        if not self.fits(ckpt.nbytes):
            return False
        mine = slot.checkpoints
        mine[:] = [c for c in mine if c.n_tokens != ckpt.n_tokens]  # (one per position: the new one replaces it)
        while mine and (len(mine) >= self.max_count or _bytes(mine) + ckpt.nbytes > self.slot_bytes):
            mine.remove(min(mine, key=lambda c: c.order))
        while sum(_bytes(s.checkpoints) for s in slots) + ckpt.nbytes > self.total_bytes:
            others = [s for s in slots if s.checkpoints and s is not slot] or [slot]
            victim = min(others, key=lambda s: s.last_used)
            victim.checkpoints.remove(min(victim.checkpoints, key=lambda c: c.order))
        mine.append(ckpt)
        mine.sort(key=lambda c: c.n_tokens)
        return True

    def used(self, slots: Sequence[Holder]) -> int:
        return sum(_bytes(s.checkpoints) for s in slots)


def _bytes(checkpoints: list[Checkpoint]) -> int:
    return sum(c.nbytes for c in checkpoints)
