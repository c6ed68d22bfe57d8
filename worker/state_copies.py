"""Saved states copied between workers of one model: the router asks the worker that saved a state in host RAM for a
copy (`state_fetch`, answered with `state_copy` at once, from the I/O thread: the entry's buffers never change once
made), and hands it to another worker with a job (`job.state`), whose compute thread keeps it in its own host-RAM tier
before placing the job: that worker then restores it as if it had saved it itself (worker/prefix.py), and reports it
with the job's saved-state changes, so the router's mirror stays exact. A conversation whose worker is busy thus
resumes on an idle one in milliseconds of copying instead of seconds of prefill (router/select.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol import StateBlob, StateCheckpoint, StateFetch, pack_tokens, unpack_tokens
from worker.checkpoints import Checkpoint
from worker.tier import shared_prefixes

if TYPE_CHECKING:
    from worker.host_cache import Entry, HostCache
    from worker.llama import StateData


def blob_of(entry: Entry) -> StateBlob:
    """A host-RAM entry as the wire carries it (its buffers copied out)."""
    return StateBlob(
        tokens=pack_tokens(entry.tokens),
        n_exact=entry.n_exact,
        pos_min=entry.pos_min,
        salt=entry.salt,
        data=bytes(entry.data),
        checkpoints=[StateCheckpoint(n_tokens=c.n_tokens, data=bytes(c.data)) for c in entry.checkpoints],
    )


def chosen(host: HostCache, fetch: StateFetch, gives: Callable[[Entry, list[int], bool], int]) -> tuple[Entry | None, int]:
    """The entry a `state_fetch` names, or, gone (superseded by a longer state, or dropped: the router learns of it
    with the job that did it, at its end), this tenant's entry giving the most of the job's prompt; and what it gives
    that prompt (`gives`: the worker's rule, worker/prefix.py `restorable`). (I/O thread.)"""
    prompt = unpack_tokens(fetch.tokens)
    entry = host.find(fetch.entry)
    if entry is not None and entry.salt != fetch.salt:
        entry = None  # (never another tenant's)
    if entry is None and prompt:
        sharing = [e for e, _ in shared_prefixes(list(host.entries), prompt, fetch.salt)]  # (a copy: another thread's)
        entry = max(sharing, key=lambda e: gives(e, prompt, fetch.seeded), default=None)
        if entry is not None and gives(entry, prompt, fetch.seeded) == 0:
            entry = None  # (nothing worth its bytes)
    return entry, gives(entry, prompt, fetch.seeded) if entry is not None and prompt else 0


def _buffer(data: bytes) -> StateData:
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)


def keep(host: HostCache, blob: StateBlob) -> bool:
    """Keep a state another worker saved in this worker's host-RAM tier (compute thread); False when it does not fit
    (the job is then placed with what this worker holds)."""
    if not host.capacity:
        return False
    ckpts = tuple(Checkpoint(c.n_tokens, _buffer(c.data)) for c in blob.checkpoints)
    tokens = unpack_tokens(blob.tokens)
    return host.put(tokens, blob.n_exact, blob.pos_min, _buffer(blob.data), blob.salt, checkpoints=ckpts)
