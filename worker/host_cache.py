"""Host-RAM copies of evicted slot contents, so a conversation that lost its slot resumes without recomputing.

When a job is about to overwrite what a slot holds, the engine saves the slot's sequence state
(`llama_state_seq_get_data`: its KV cells) here, keyed by the exact tokens it holds. A later prompt that
shares a long prefix with an entry gets it restored into its slot (`llama_state_seq_set_data`) and trimmed
to the shared part: milliseconds of memcpy instead of seconds of prefill. Bounded by bytes, least recently
used out first. llama-server does the same with its `--cache-ram` (8 GiB by default).

The router sees this cache: every entry has an id, and the cache lists what was added (with the slot whose contents
it copied: the router knows those tokens from its mirror) and dropped since the last `changes`; the engine
sends that as soon as the jobs whose placing changed it are placed (a `slot_update` of no slot), else with its next
JobDone or JobError. An entry dropped to make room goes to `spill` first (the disk tier,
worker/disk_cache.py, when there is one).

Owned by the compute thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.tier import anywhere, gives, longest_prefix, shared_prefixes

if TYPE_CHECKING:
    from worker.checkpoints import Checkpoint
    from worker.llama import StateData
    from worker.tier import MinKeep, TierName


@dataclass(eq=False)
class Entry:
    tokens: list[int]  # exactly the tokens whose KV `data` holds, in position order
    n_exact: int  # leading tokens whose KV a seeded or deterministic job reuses (worker/core.py)
    data: StateData
    pos_min: int = 0  # lowest position its sliding-window layers hold once restored (Llama.state_pos_min)
    id: int = 0
    slot: int = -1  # the slot whose contents it copied
    salt: str = ""  # the tenant whose prompt it holds ("": none); entries are shared only within a tenant
    last_used: int = 0
    checkpoints: tuple[Checkpoint, ...] = ()  # its slot's checkpoints (worker/checkpoints.py), restored with it

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(c.nbytes for c in self.checkpoints)

    @property
    def cuts(self) -> list[int]:
        return [c.n_tokens for c in self.checkpoints]


class HostCache:
    """Entries by LRU within `capacity` bytes. No entry is a prefix of another (the longer one is kept). A saved-state
    tier (worker/tier.py)."""

    name: TierName = "ram"

    def __init__(self, capacity: int, spill: Callable[[Entry], None] | None = None, min_keep: MinKeep | None = None) -> None:
        """`spill` gets each entry dropped to make room (least recently used), before it goes: the disk tier.
        `min_keep(pos_min, n)`: the shortest prefix a state of `n` tokens can be cut back to once restored (default 0:
        any), below which it gives only its checkpoints (worker/checkpoints.py); an entry holding more tokens after
        another's covers it only where it can be cut back to it."""
        self.capacity = capacity
        self.min_keep = min_keep or anywhere
        self.spill = spill
        self.entries: list[Entry] = []
        self.nbytes = 0
        self._clock = 0
        self._ids = 0
        self.added: list[Entry] = []  # since the last `changes`
        self.dropped: list[int] = []

    def __len__(self) -> int:
        return len(self.entries)

    def covers(self, tokens: list[int], salt: str = "") -> bool:
        """Whether an entry of this tenant already gives `tokens` (holds them, or more after them and can be cut back to
        them): saving them again adds nothing."""
        return any(e.salt == salt and self._gives(e, tokens) for e in self.entries)

    def make_room(self, nbytes: int) -> bool:
        """Drop least recently used entries until `nbytes` more fit; False (nothing dropped) when they never can.
        Asked before a state is copied out, so that the copy never takes memory beyond the budget."""
        if nbytes <= 0 or nbytes > self.capacity:
            return False
        while self.entries and self.nbytes + nbytes > self.capacity:
            self._evict()
        return True

    def put(
        self,
        tokens: list[int],
        n_exact: int,
        pos_min: int,
        data: StateData,
        salt: str = "",
        slot: int = -1,
        checkpoints: tuple[Checkpoint, ...] = (),
    ) -> bool:
        """Keep a copy of a sequence holding `tokens` (the contents of `slot`) and its checkpoints; entries it gives
        all of are dropped. False when it cannot fit."""
        entry = Entry(list(tokens), n_exact, data, pos_min, 0, slot, salt, checkpoints=checkpoints)
        if entry.nbytes > self.capacity:
            return False
        for e in [e for e in self.entries if e.salt == salt and self._gives(entry, e.tokens)]:
            self._drop(e)
        while self.entries and self.nbytes + entry.nbytes > self.capacity:
            self._evict()
        self._ids += 1
        entry.id = self._ids
        self._touch(entry)
        self.entries.append(entry)
        self.nbytes += entry.nbytes
        self.added.append(entry)
        return True

    def find(self, entry_id: int) -> Entry | None:
        """The entry of that id, if it is still here. Safe from another thread: it reads a copy of the list (taken
        whole under the GIL), and an entry, once made, never changes but for its `last_used`."""
        return next((e for e in list(self.entries) if e.id == entry_id), None)

    def best(self, prompt: list[int], salt: str = "") -> tuple[Entry | None, int]:
        """This tenant's entry sharing the longest prefix with `prompt`, and that length (0 when none shares any)."""
        return longest_prefix(self.entries, prompt, salt)

    def sharing(self, prompt: list[int], salt: str = "") -> list[tuple[Entry, int]]:
        """This tenant's entries sharing a prefix with `prompt`, each with that length."""
        return shared_prefixes(self.entries, prompt, salt)

    def used(self, entry: Entry) -> None:
        self._touch(entry)

    def drop(self, entry: Entry) -> None:
        """Forget an entry (its restore failed: it would fail again)."""
        if entry in self.entries:
            self._drop(entry)

    def clear(self) -> None:
        self.dropped.extend(e.id for e in self.entries)
        self.entries.clear()
        self.nbytes = 0

    def changes(self) -> tuple[list[Entry], list[int]]:
        """Entries added and ids dropped since the last call (an entry may be in both: added, then dropped)."""
        added, dropped = self.added, self.dropped
        self.added, self.dropped = [], []
        return added, dropped

    def _evict(self) -> None:
        """Drop the least recently used entry to make room, spilling it first."""
        entry = min(self.entries, key=lambda e: e.last_used)
        if self.spill is not None:
            self.spill(entry)
        self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        self.nbytes -= entry.nbytes
        self.dropped.append(entry.id)

    def _gives(self, entry: Entry, tokens: list[int]) -> bool:
        """Whether `entry` gives all of `tokens`: they are a prefix of its tokens it can be cut back to."""
        return gives(entry.tokens, entry.pos_min, entry.cuts, self.min_keep, tokens)

    def _touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
