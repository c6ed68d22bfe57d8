"""Memory for saved states and checkpoints (`Llama.state_get`, `partial_get`): taken from the buffers freed by
earlier ones where one fits, so that their pages are not asked of the kernel again.

Why: fresh pages can cost far more than the copy into them. A virtual machine that hands freed memory back to its
host (free page reporting, a balloon) faults every page in again: on the 2-core VM of 2026-12-04, 18 MB of fresh
memory took 200-290 ms to map at times (90 MB/s; 7 ms at others), a copy into mapped memory 2 ms; a worker saved a
slot or took a checkpoint on its compute thread at that price (a returning agent turn waited 0.67 s for a save and a
restore, each 7.9 MB window checkpoint of Gemma 3 took 0.1 s). Saved states and checkpoints come and go all the time
(a state superseded by a longer one of the same conversation, evicted for a new one, a slot's checkpoints dropped as
it is overwritten), in sizes that repeat (a model's window checkpoints are all one size): so a freed buffer is kept, up
to `keep` bytes in all, and handed out again.

A buffer goes back to the pool when the last reference to what it held goes (a weakref finalizer), on whichever
thread drops it; the pool is locked. A reused buffer is not zeroed: llama.cpp writes every byte of what it is given.
The tiers count the bytes a state holds, not its buffer's: what a buffer has beyond them (a sixteenth for rounding, an
eighth more where it served a smaller state) and what the pool keeps free are memory beside `--host-cache-mb`.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    StateData = ctypes.Array[ctypes.c_uint8]  # one sequence's saved state (its KV cells), as llama.cpp wrote it

KEEP_BYTES = 256 * 2**20  # freed buffers kept for reuse, at least (and twice the largest buffer taken)
FIT = 1.125  # a kept buffer serves a request this much smaller than it at most (the rest of it is idle meanwhile)
GRANULE_MIN = 64 * 2**10
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def capacity(size: int) -> int:
    """The bytes a new buffer for `size` gets: rounded up by at most 1/16 of it, so that sizes that differ a little
    (a state a few tokens longer) share buffers."""
    granule = max(GRANULE_MIN, 1 << max(0, size.bit_length() - 5))
    return -(-size // granule) * granule


class BufferPool:
    def __init__(self, keep: int = KEEP_BYTES) -> None:
        self.keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}  # capacity -> buffers free
        self._sizes: list[int] = []  # the capacities in `_free`, sorted
        self.kept = 0  # bytes free in the pool
        self.largest = 0
        self.reused = self.mapped = 0  # buffers handed out again, and new ones mapped
        self._lock = threading.Lock()

    def take(self, size: int) -> StateData:
        """`size` writable bytes (not zeroed when reused), pages mapped up front."""
        if size <= 0:
            return (ctypes.c_uint8 * max(size, 0))()
        mapped = self._reuse(size)
        if mapped is None:
            mapped = _new_mapping(capacity(size))
            self.mapped += 1
        buf = (ctypes.c_uint8 * size).from_buffer(mapped)
        weakref.finalize(buf, self._give_back, mapped).atexit = False
        return buf

    def _reuse(self, size: int) -> mmap.mmap | None:
        with self._lock:
            self.largest = max(self.largest, size)
            i = bisect.bisect_left(self._sizes, size)
            if i == len(self._sizes) or self._sizes[i] > size * FIT:
                return None
            cap = self._sizes[i]
            free = self._free[cap]
            mapped = free.pop()
            if not free:
                del self._free[cap]
                self._sizes.pop(i)
            self.kept -= cap
            self.reused += 1
            return mapped

    def _give_back(self, mapped: mmap.mmap) -> None:
        """What a buffer held is gone: keep its memory for the next one, unless the pool is full (then it is
        unmapped as `mapped` goes)."""
        cap = len(mapped)
        with self._lock:
            if self.kept + cap > max(self.keep, 2 * self.largest):
                return
            if cap not in self._free:
                self._free[cap] = []
                bisect.insort(self._sizes, cap)
            self._free[cap].append(mapped)
            self.kept += cap


def _new_mapping(size: int) -> mmap.mmap:
    """Anonymous memory whose pages are mapped in one call (MAP_POPULATE) instead of one fault per page as llama.cpp
    writes: measured in a process that maps the model, 7 ms per 10 MB against 14-65 ms for a fresh malloc'd buffer."""
    try:
        if not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: -1 is anonymous memory there)
            return mmap.mmap(-1, size)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except OSError as exc:
        raise MemoryError(f"cannot map {size} bytes for a saved state: {exc}") from exc
