"""Host-RAM copies of evicted slot contents, so a conversation that lost its slot resumes without recomputing.

When a job is about to overwrite what a slot holds, the engine saves the slot's sequence state
(`llama_state_seq_get_data`: its KV cells) here, keyed by the exact tokens it holds. A later prompt that
shares a long prefix with an entry gets it restored into its slot (`llama_state_seq_set_data`) and trimmed
to the shared part: milliseconds of memcpy instead of seconds of prefill. Bounded by bytes, least recently
used out first. llama-server does the same with its `--cache-ram` (8 GiB by default).

Owned by the compute thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute.slots import common_prefix

if TYPE_CHECKING:
    from worker.llama import StateData


@dataclass(eq=False)
class Entry:
    tokens: list[int]  # exactly the tokens whose KV `data` holds, in position order
    n_exact: int  # deterministic mode: leading tokens whose KV came from full-size prefill chunks
    data: StateData
    pos_min: int = 0  # lowest position its sliding-window layers hold once restored (Llama.state_pos_min)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.data)


class HostCache:
    """Entries by LRU within `capacity` bytes. No entry is a prefix of another (the longer one is kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[Entry] = []
        self.nbytes = 0
        self._clock = 0

    def __len__(self) -> int:
        return len(self.entries)

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already holds `tokens` (or more after them): saving them again adds nothing."""
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries)

    def make_room(self, nbytes: int) -> bool:
        """Drop least recently used entries until `nbytes` more fit; False (nothing dropped) when they never can.
        Asked before a state is copied out, so that the copy never takes memory beyond the budget."""
        if nbytes <= 0 or nbytes > self.capacity:
            return False
        while self.entries and self.nbytes + nbytes > self.capacity:
            self._drop(min(self.entries, key=lambda e: e.last_used))
        return True

    def put(self, tokens: list[int], n_exact: int, data: StateData, pos_min: int = 0) -> bool:
        """Keep a copy of a sequence holding `tokens`; entries it extends are dropped. False when it cannot fit."""
        if len(data) > self.capacity:
            return False
        n = len(tokens)
        for e in [e for e in self.entries if len(e.tokens) <= n and tokens[: len(e.tokens)] == e.tokens]:
            self._drop(e)
        while self.entries and self.nbytes + len(data) > self.capacity:
            self._drop(min(self.entries, key=lambda e: e.last_used))
        entry = Entry(list(tokens), n_exact, data, pos_min)
        self._touch(entry)
        self.entries.append(entry)
        self.nbytes += entry.nbytes
        return True

    def best(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that length (0 when none shares anything)."""
        best, best_lcp = None, 0
        for e in self.entries:
            lcp = common_prefix(e.tokens, prompt)
            if lcp > best_lcp:
                best, best_lcp = e, lcp
        return best, best_lcp

    def used(self, entry: Entry) -> None:
        self._touch(entry)

    def drop(self, entry: Entry) -> None:
        """Forget an entry (its restore failed: it would fail again)."""
        if entry in self.entries:
            self._drop(entry)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        self.nbytes -= entry.nbytes

    def _touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
