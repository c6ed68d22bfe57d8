"""Saved sequence states: the one interface of the tiers that keep a slot's KV after the slot moves on, host RAM
(worker/host_cache.py) and disk (worker/disk_cache.py). The engine saves into them, asks them for the state sharing
the longest prefix with a prompt, restores from them, and passes their change reports on to the router.

A state is keyed by the exact tokens whose KV it holds and by its tenant (`salt`); no tier gives one tenant's state
to another. A tier's entries carry an id the router knows them by (CacheEntry.id, within the tier).

The search every tier does lives here, once: the state sharing the longest prefix with a prompt (`longest_prefix`), the
states sharing any (`shared_prefixes`), and whether a state gives all of some tokens (`gives`: what makes saving them again
add nothing, and a shorter state superseded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from common.slots import common_prefix, restore_keep

if TYPE_CHECKING:
    from worker.llama import StateData


TierName = Literal["ram", "disk"]  # (CacheEntry.tier)


class SavedState(Protocol):
    """One state a tier holds (or, in a change report, now holds)."""

    @property
    def id(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...  # exactly the tokens whose KV it holds, in position order
    @property
    def n_exact(self) -> int: ...  # leading tokens a seeded or deterministic job reuses (worker/core.py)
    @property
    def pos_min(self) -> int: ...  # lowest position its sliding-window layers hold once restored
    @property
    def nbytes(self) -> int: ...
    @property
    def salt(self) -> str: ...  # the tenant whose prompt it holds ("": none)
    @property
    def cuts(self) -> list[int]: ...  # positions of its checkpoints, ascending (worker/checkpoints.py)


E = TypeVar("E", bound=SavedState)


class Tier(Protocol[E]):
    """Where saved states live, of entry type E. Every method is called on the engine's compute thread."""

    name: TierName

    def covers(self, tokens: list[int], salt: str = "") -> bool:
        """Whether a state of this tenant already holds `tokens` (or more after them): saving them adds nothing."""
        ...

    def put(self, tokens: list[int], n_exact: int, pos_min: int, data: StateData, salt: str = "") -> object:
        """Keep a state holding `tokens`; states it extends go. True (or an id) when it is kept."""
        ...

    def best(self, prompt: list[int], salt: str = "") -> tuple[E | None, int]:
        """This tenant's state sharing the longest prefix with `prompt`, and that length (0 when none shares any)."""
        ...

    def sharing(self, prompt: list[int], salt: str = "") -> list[tuple[E, int]]:
        """This tenant's states sharing a prefix with `prompt`, each with that length."""
        ...

    def used(self, entry: E) -> None: ...

    def drop(self, entry: E) -> None:
        """Forget a state (its restore failed: it would fail again)."""
        ...

    def changes(self) -> tuple[Sequence[SavedState], list[int]]:
        """States added and ids dropped since the last call (an id may be in both: added, then dropped)."""
        ...


MinKeep = Callable[[int, int], int]  # (pos_min, n) -> the shortest prefix a state of n tokens can be cut back to


def anywhere(pos_min: int, n: int) -> int:
    """The default `MinKeep`: a state can be cut back to any prefix."""
    return 0


def longest_prefix(entries: Iterable[E], prompt: list[int], salt: str) -> tuple[E | None, int]:
    """The state of tenant `salt` sharing the longest prefix with `prompt` (the first one on a tie), and that length (0
    when none shares any)."""
    best, best_lcp = None, 0
    for e in entries:
        if e.salt != salt:
            continue
        lcp = common_prefix(e.tokens, prompt)
        if lcp > best_lcp:
            best, best_lcp = e, lcp
    return best, best_lcp


def shared_prefixes(entries: Iterable[E], prompt: list[int], salt: str) -> list[tuple[E, int]]:
    """The states of tenant `salt` sharing a prefix with `prompt`, each with that length."""
    found = [(e, common_prefix(e.tokens, prompt)) for e in entries if e.salt == salt]
    return [(e, n) for e, n in found if n > 0]


def gives(held: list[int], pos_min: int, cuts: Sequence[int], min_keep: MinKeep, tokens: list[int]) -> bool:
    """Whether a state holding `held` (its lowest position `pos_min`, its checkpoints at `cuts`) gives all of `tokens`:
    they are a prefix of `held` it can be cut back to."""
    n, n_held = len(tokens), len(held)
    if n_held < n or held[:n] != tokens:
        return False
    return restore_keep(n, n_held, min_keep(pos_min, n_held), cuts) == n
