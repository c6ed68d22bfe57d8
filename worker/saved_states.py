"""The saved-state tiers of one worker: host RAM, and the disk tier when `--cache-dir` asks for one (host RAM spills
to it what it drops to make room). What the router is told of them: the changes since the last report (with each
JobDone and JobError) and, in a hello, a listing of what they hold.

Owned by the engine's compute thread, except `flush` and `close`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import logs
from common.vocab import Vocab
from common.weights import GGUFError, weights_fingerprint
from protocol import MAX_FRAME_BYTES, CacheEntry, pack_tokens, token_hash
from worker.checkpoints import Checkpoint
from worker.config import WorkerConfig
from worker.disk_cache import DiskCache, DiskEntry, llama_state_version
from worker.disk_format import Cuts
from worker.host_cache import Entry, HostCache
from worker.tier import SavedState, Tier, TierName

if TYPE_CHECKING:
    from collections.abc import Callable

    from worker.llama import Llama, StateData
    from worker.slots import Slot

log = logs.get(__name__)

# A hello lists saved states with their tokens; the router refuses a frame over MAX_FRAME_BYTES, and a worker it
# refuses would repeat that hello forever. A large disk tier lists its most recently used states up to this much.
HELLO_LISTING_BYTES = MAX_FRAME_BYTES // 2
ENTRY_OVERHEAD_BYTES = 160  # a listed entry's fields besides its tokens, about
# a slot losing fewer tokens than this is not worth a copy in host RAM, nor a file on a graceful stop (each copy is an
# entry the tier and the router's index keep, and a restore gains what the slot lost at most)
SAVE_MIN = 16


def open_disk_tier(
    cfg: WorkerConfig, vocab: Vocab, memory: str = "kv", min_keep: Callable[[int, int], int] | None = None
) -> DiskCache | None:
    """The disk tier (--cache-dir), loaded: what a previous run left there is restorable at once. `memory`: what a
    state holds besides the model's KV layout (its sliding-window cache's size; checkpoints), in what files must match;
    `min_keep`: as in DiskCache."""
    if not cfg.cache_dir or cfg.disk_cache_gb <= 0:
        return None
    # the files are only good for this model and the same KV layout, so both are in what each file must match
    try:
        fingerprint = f"{vocab.fingerprint}:{weights_fingerprint(vocab.path)}"
    except (GGUFError, OSError) as exc:
        log.warning("disk_tier_off", reason=f"the model's weights cannot be fingerprinted: {exc}")
        return None
    layout = llama_state_version(
        f"k={cfg.cache_type_k}", f"v={cfg.cache_type_v}", f"fa={cfg.flash_attn}", f"det={cfg.deterministic}", memory
    )
    disk = DiskCache(Path(cfg.cache_dir), int(cfg.disk_cache_gb * 2**30), fingerprint, layout, min_keep=min_keep)
    loaded = disk.load()
    disk.drain_events()  # what it found goes to the router in the hello (`held`), not again with a JobDone
    log.info("disk_tier", directory=cfg.cache_dir, entries=len(loaded), nbytes=disk.nbytes, enabled=disk.enabled)
    return disk


class SavedStates:
    def __init__(self, host_bytes: int, disk: DiskCache | None, min_keep: Callable[[int, int], int]) -> None:
        """`min_keep(pos_min, n)`: the shortest prefix a state of `n` tokens restored with that `pos_min` can be cut
        to (below it, only to its checkpoints)."""
        self.disk = disk
        self.host = HostCache(host_bytes, spill=self._spill, min_keep=min_keep)
        self.tiers: list[Tier[Any]] = [self.host] if disk is None else [self.host, disk]
        self.min_keep = min_keep

    def _spill(self, entry: Entry) -> None:
        """A host-RAM entry dropped to make room goes to disk (written off this thread)."""
        if self.disk is not None:
            parts, cuts = on_disk(entry.data, entry.checkpoints)
            self.disk.put(entry.tokens, entry.n_exact, entry.pos_min, parts, entry.salt, cuts)

    def persist(self, slots: list[Slot], llama: Llama, skip: set[int]) -> int:
        """Queue every slot's contents (but those in `skip`: no KV to read yet) and every host-RAM entry for the disk
        tier. Returns how many were queued."""
        assert self.disk is not None
        queued = 0
        for slot in slots:
            if slot.n_tokens < SAVE_MIN or slot.id in skip or self.disk.covers(slot.tokens, slot.salt):
                continue
            try:
                pos_min = llama.state_pos_min(slot.id, slot.n_tokens)
                data = llama.state_get(slot.id)
            except (RuntimeError, MemoryError) as exc:
                log.warning("persist_failed", slot=slot.id, error=str(exc))
                continue
            parts, cuts = on_disk(data, tuple(slot.checkpoints))
            queued += self.disk.put(list(slot.tokens), slot.n_exact, pos_min, parts, slot.salt, cuts) is not None
        for entry in sorted(self.host.entries, key=lambda e: -e.last_used):  # most recently used first
            parts, cuts = on_disk(entry.data, entry.checkpoints)
            queued += self.disk.put(entry.tokens, entry.n_exact, entry.pos_min, parts, entry.salt, cuts) is not None
        log.info("persisting", queued=queued)
        return queued

    def changes(self) -> tuple[list[CacheEntry], list[int], list[int]]:
        """The saved states added and dropped since the last report, for the router's index: added, dropped from host
        RAM, dropped from disk (an entry both added and dropped since then is left out)."""
        out: list[CacheEntry] = []
        gone: dict[str, list[int]] = {"ram": [], "disk": []}
        for tier in self.tiers:
            added, dropped = tier.changes()
            new, lost = {e.id for e in added}, set(dropped)
            out += [self.described(e, tier.name) for e in added if e.id not in lost]
            gone[tier.name] = sorted(lost - new)
        return out, gone["ram"], gone["disk"]

    def listing(self) -> list[CacheEntry]:
        """What the tiers hold, tokens included, for a hello: as much as `most_recent_within` lets it carry."""
        disk = self.disk.entries if self.disk is not None else []
        listed, left_out = most_recent_within(self.host.entries, disk, HELLO_LISTING_BYTES)
        if left_out:
            log.warning(
                "saved_states_not_listed",
                listed=len(listed),
                left_out=left_out,
                reason="more than the hello can carry: the router routes to the listed ones; this worker still "
                "restores any of them for a request sent here",
            )
        return [self.described(x, "ram" if isinstance(x, Entry) else "disk", with_tokens=True) for x in listed]

    def described(self, entry: SavedState, tier: TierName, with_tokens: bool = False) -> CacheEntry:
        """A saved state as the router is told of it: a host-RAM entry's tokens by reference to the slot they came
        from, or in full (a disk entry's always: its tokens may be from before this process)."""
        slot = entry.slot if isinstance(entry, Entry) and not with_tokens else -1
        return CacheEntry(
            id=entry.id,
            tier=tier,
            n_tokens=len(entry.tokens),
            hash=token_hash(entry.tokens),
            nbytes=entry.nbytes,
            n_exact=entry.n_exact,
            min_keep=self.min_keep(entry.pos_min, len(entry.tokens)),
            cuts=entry.cuts,
            slot=slot,
            tokens=pack_tokens(entry.tokens) if slot < 0 else b"",
            salt=entry.salt,
        )


def on_disk(data: StateData, checkpoints: tuple[Checkpoint, ...]) -> tuple[tuple[StateData, ...], Cuts]:
    """What the disk tier writes of a state and its checkpoints: the buffers in order, the checkpoints' places."""
    return (data, *(c.data for c in checkpoints)), tuple((c.n_tokens, c.nbytes) for c in checkpoints)


def from_disk(data: StateData, cuts: Cuts) -> tuple[StateData, list[Checkpoint]]:
    """A state and its checkpoints from what the disk tier read back (`on_disk`'s buffers, one after the other). The
    checkpoints are copied out: the tier reuses its read buffer."""
    end = len(data) - sum(nbytes for _, nbytes in cuts)
    state = (ctypes.c_uint8 * end).from_buffer(data)
    out: list[Checkpoint] = []
    for n, nbytes in cuts:
        buf = (ctypes.c_uint8 * nbytes)()
        ctypes.memmove(buf, ctypes.addressof(data) + end, nbytes)
        out.append(Checkpoint(n, buf))
        end += nbytes
    return state, out


def most_recent_within(host: list[Entry], disk: list[DiskEntry], budget: int) -> tuple[list[Entry | DiskEntry], int]:
    """The saved states a hello lists: host RAM's then the disk tier's, each most recently used first, while their
    tokens fit in `budget` bytes; and how many were left out."""
    ordered: list[Entry | DiskEntry] = [
        *sorted(host, key=lambda x: x.last_used, reverse=True),
        *sorted(disk, key=lambda x: x.last_used, reverse=True),
    ]
    listed: list[Entry | DiskEntry] = []
    for x in ordered:
        budget -= 4 * len(x.tokens) + ENTRY_OVERHEAD_BYTES
        if budget < 0:
            break
        listed.append(x)
    return listed, len(ordered) - len(listed)
