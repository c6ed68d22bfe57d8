"""What a slot is, the one place both sides take it from: the worker that owns slots and the router that mirrors
them (and predicts what the worker will reuse) must agree to the token.

- `SlotPhase`: a slot is idle or busy (running one job).
- `reused(lcp, length, n_exact, exact, seeded)`: the prompt tokens a slot holding a prefix of `lcp` of them gives a
  job: one less on a full match (logits are not cached: the last prompt token is computed again); on a deterministic
  worker at most the KV computed as prompt (`n_exact`), leaving a chunk of EXACT_ROWS to compute; to a seeded job on
  any other worker at most the KV computed as a seeded job's prompt (`n_exact` there: worker/core.py).
- `worth_copy(gain, n_copied)`: whether copying a prefix in (from another slot or a cached state) is worth it.
- `restore_keep(lcp, n_tokens, min_keep, cuts)`: what a slot or a saved state of `n_tokens` tokens gives a prompt
  sharing `lcp` (after `reused`): all of it when its memory can be cut back there (`min_keep`: 0 for a plain
  transformer's KV, `n_tokens` for a recurrent state), else its longest checkpoint (`cuts`) within it, else nothing.
- `common_prefix(a, b)` of two token sequences (lists or int32 arrays).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

EXACT_ROWS = 8
"""Smallest ubatch llama.cpp computes with the same kernels as a long prompt (measured: tests/worker); a
deterministic worker computes at least this many prompt tokens of every job."""


# Copying a prefix moves memory: another slot's whole stream (ctx_per_slot cells, about 18 KB each for Gemma 3
# 270M), or a cached state. Worth it when it saves at least COPY_MIN prompt tokens and 1/COPY_RATIO of the cells
# copied. Measured on 2 CPU cores (Gemma 3 270M): restoring a saved state of 1,200 tokens (11.6 MB) takes 0.9 ms,
# computing them 2.1 s, so a restore costs well under a token of prefill; a GPU's prefill is ~50x a host copy's
# cost per token. So any gain is worth a restore that moves no more than COPY_RATIO cells per token gained.
COPY_MIN = 1
COPY_RATIO = 64


class SlotPhase(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"


def reused(lcp: int, length: int, n_exact: int = 0, exact: bool = False, seeded: bool = False) -> int:
    """Prompt tokens of a `length`-token prompt that a slot sharing its first `lcp` tokens gives (see above)."""
    reuse = min(lcp, length - 1)
    if exact:
        reuse = max(0, min(reuse, n_exact, length - EXACT_ROWS))
    elif seeded:
        reuse = min(reuse, n_exact)
    return max(reuse, 0)


def worth_copy(gain: int, n_copied: int) -> bool:
    """Whether a copy that gives `gain` more prompt tokens than the slot has, moving `n_copied` cells, pays."""
    return gain >= max(COPY_MIN, n_copied // COPY_RATIO)


def restore_keep(lcp: int, n_tokens: int, min_keep: int, cuts: Sequence[int] = ()) -> int:
    """Of `lcp` reusable tokens of a slot or saved state holding `n_tokens`, those it can give. Its memory cannot be
    cut before `min_keep` (sliding-window layers that hold only their last window; a recurrent state, which cannot be
    cut at all: `n_tokens`); below that, only to one of its checkpoints (`cuts`, ascending: positions where the part
    that cannot be cut was saved, worker/checkpoints.py): the longest within `lcp`, or none."""
    if lcp >= n_tokens or lcp >= min_keep:
        return lcp
    return cuts[bisect.bisect_right(cuts, lcp) - 1] if cuts and cuts[0] <= lcp else 0


def common_prefix(a: Any, b: Any) -> int:
    """Length of the common prefix of two token sequences: lists (C-speed slice compares and a binary search) or
    numpy int32 arrays (one vectorised compare)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if len(diff) else n
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
