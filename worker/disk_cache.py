"""Slot states on local disk, one file each, so that a conversation evicted from host RAM (or from before a restart)
resumes without recomputing.

The storage layer only: the engine decides what to save and restores what `read` gives back. Each entry is one file
`<id>.kvs` in `directory`, holding the model fingerprint, the llama.cpp state format (`llama_state_version`), the
exact tokens whose KV the state holds, `n_exact`, `pos_min` and the bytes `llama_state_seq_get_data` wrote, with
CRC-32 checksums (format below). An entry id is an int, the file's stem, unique in the directory: ids survive a
restart, so the router can be told "entry 12 holds these tokens" and "entry 12 is gone" (`drain_events`, `changes`).

Contract:
- `load()` starts the tier (creates the directory, locks it against a second worker, scans it). The directory is this
  user's alone (mode 0700, its files 0600, none opened through a link: their headers hold token ids); one that is a
  link or another user's turns the tier off (common/files.py). Until then, and
  whenever the tier is off, `enabled` is False: `put` keeps nothing and `best` finds nothing. Entry files that are
  not ours to use (other model, other state format, truncated, corrupt) and stray temp files are logged and removed;
  files with other names are left alone. The entries kept are reported as `Added` events, like new ones.
- `put` never touches the disk on the caller's thread: a writer thread writes a temp file, fsyncs it and renames it,
  so a crash never leaves a partial file under a final name. The entry shows in `best` once its file is complete.
  Least recently used files go first to keep the total within `capacity` bytes (headers included); no entry is a
  prefix of another (the longer one is kept, as in HostCache). `data` must not change after `put`.
- `read` checks the whole file against its checksum and header; on any mismatch the file is removed and None comes
  back (the caller computes the prompt instead). Nothing is raised to the caller: a failed write (disk full, an
  unwritable directory, any OSError) is logged once and turns the tier off, pending writes dropped; the files
  already written stay for the next start.
- Thread safe: every method may be called from any thread. `read` reads a whole file (and `used` sets its mtime)
  on the caller's thread.

Its files, one at a time (writing, reading back, the scan at start): worker/disk_files.py; the bytes in them:
worker/disk_format.py. The prefix search: worker/tier.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common import logs
from common.files import open_private, private_dir
from worker.disk_files import LOCK_NAME, DiskEntry, EntryFiles, PendingWrite
from worker.disk_format import Bad, Cuts, file_size
from worker.tier import anywhere, gives, longest_prefix, shared_prefixes

if TYPE_CHECKING:
    from worker.llama import StateData
    from worker.tier import MinKeep, TierName

    Buffer = StateData | bytes | bytearray | memoryview

__all__ = ["Added", "DiskCache", "DiskEntry", "Dropped", "Event", "llama_state_version"]

log = logs.get(__name__)

_MAX_PENDING = 1 << 30  # bytes of states queued for writing (held in RAM meanwhile) at most, by default


def llama_state_version(*extra: object) -> str:
    """What identifies the bytes `llama_state_seq_get_data` writes: the pinned llama-cpp-python (which vendors one
    llama.cpp commit), llama.cpp's own version string and its sequence-state magic and version. `extra`: what else
    changes them (the K/V cache types, flash attention's V layout), appended."""
    import llama_cpp  # here, not at the top: the tier itself never calls llama.cpp

    parts = [
        f"llama-cpp-python={llama_cpp.__version__}",
        f"llama.cpp={llama_cpp.llama_version().decode()}",
        f"seq={getattr(llama_cpp, 'LLAMA_STATE_SEQ_MAGIC', 0):#x}/{getattr(llama_cpp, 'LLAMA_STATE_SEQ_VERSION', 0)}",
    ]
    return ";".join(parts + [str(x) for x in extra])


@dataclass(frozen=True)
class Added:
    """The disk tier now holds `tokens` (under `id`)."""

    id: int
    tokens: list[int]
    n_exact: int
    pos_min: int
    nbytes: int
    salt: str = ""
    checkpoints: Cuts = ()

    @property
    def cuts(self) -> list[int]:
        return [n for n, _ in self.checkpoints]

    @classmethod
    def of(cls, e: DiskEntry) -> Added:
        return cls(e.id, e.tokens, e.n_exact, e.pos_min, e.nbytes, e.salt, e.checkpoints)


@dataclass(frozen=True)
class Dropped:
    """The disk tier no longer holds entry `entry_id`."""

    entry_id: int


Event = Added | Dropped


class DiskCache:
    """Entries on disk by LRU within `capacity` bytes; 0 means off. A saved-state tier (worker/tier.py)."""

    name: TierName = "disk"

    def __init__(
        self,
        directory: Path | str,
        capacity_bytes: int,
        fingerprint: str,
        state_version: str,
        *,
        max_pending_bytes: int | None = None,
        min_keep: MinKeep | None = None,
    ) -> None:
        """`min_keep(pos_min, n)`: the shortest prefix a state of `n` tokens can be cut back to once restored (default
        0: any), below which it gives only its checkpoints (worker/checkpoints.py); an entry holding more tokens after
        another's covers it only where it can be cut back to it."""
        self.directory = Path(directory)
        self.min_keep = min_keep or anywhere
        self.capacity = max(0, capacity_bytes)
        self.fingerprint = fingerprint
        self.state_version = state_version
        self.max_pending_bytes = min(self.capacity, _MAX_PENDING) if max_pending_bytes is None else max_pending_bytes
        self.enabled = False
        self.written = 0  # files written
        self.evicted = 0  # files removed for room or superseded by a longer entry
        self.rejected = 0  # files removed because they did not check out (at load or read)
        self.skipped = 0  # puts dropped because the write queue was full
        self._fp = fingerprint.encode()
        self._sv = state_version.encode()
        self.files = EntryFiles(self.directory, self._fp, self._sv)
        self._entries: dict[int, DiskEntry] = {}
        self._nbytes = 0
        self._events: list[Event] = []
        self._queue: deque[PendingWrite] = deque()
        self._pending_bytes = 0
        self._busy: PendingWrite | None = None  # the write in progress
        self._cond = threading.Condition()  # guards all of the above; the writer waits on it
        self._closing = False
        self._loaded = False
        self._off_logged = False
        self._clock = 0
        self._next_id = 1
        self._lock_fd: int | None = None
        self._writer: threading.Thread | None = None

    # -- start --------------------------------------------------------------------------------------------------

    def load(self) -> list[DiskEntry]:
        """Start the tier: create and lock the directory, keep the valid entries, remove the rest. Returns the entries
        (each also reported as an `Added` event). Once only; later calls return the current entries."""
        with self._cond:
            if self._loaded:
                return list(self._entries.values())
            self._loaded = True
        if self.capacity <= 0:
            return []
        try:
            private_dir(self.directory)  # (its files hold token ids: this user's alone, never through a link)
            fd = open_private(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # two workers on one directory would remove each other's files
            except OSError:
                os.close(fd)
                raise
            self._lock_fd = fd
            found, next_id = self.files.scan(self._reject, self._remove)
            self._next_id = max(self._next_id, next_id)
        except OSError as exc:
            self._off("directory unusable", exc)
            return []
        found = self._unique(found)
        found.sort(key=lambda e: (e.last_used, e.id))
        total = sum(e.nbytes for e in found)
        while found and total > self.capacity:  # the capacity may have shrunk since they were written
            e = found.pop(0)
            total -= e.nbytes
            self.evicted += 1
            self._remove(e.path, "over capacity", level="info")
        if self._off_logged:  # a file could not be removed: the directory is not ours to write
            return []
        with self._cond:
            for e in found:
                self._entries[e.id] = e
                self._events.append(Added.of(e))
            self._nbytes = total
            self._clock = max([time.time_ns(), *(e.last_used for e in found)])
            self.enabled = True
        self._writer = threading.Thread(target=self._run, name="disk-cache-writer", daemon=True)
        self._writer.start()
        log.info("disk_cache_loaded", directory=str(self.directory), entries=len(found), nbytes=total, capacity=self.capacity)
        return found

    def _unique(self, found: list[DiskEntry]) -> list[DiskEntry]:
        """Drop entries that are a prefix of another (a crash between writing a longer entry and removing the one it
        supersedes). In sorted order, a prefix of anything is a prefix of the entry right after it."""
        found.sort(key=lambda e: (e.salt, e.tokens))
        keep = []
        for i, e in enumerate(found):
            nxt = found[i + 1] if i + 1 < len(found) else None
            if nxt is not None and nxt.salt == e.salt and self._gives(nxt, e.tokens):
                self.evicted += 1
                self._remove(e.path, f"superseded by entry {nxt.id}", level="info")
            else:
                keep.append(e)
        return keep

    # -- the caller's side ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def entries(self) -> list[DiskEntry]:
        with self._cond:
            return list(self._entries.values())

    def covers(self, tokens: list[int], salt: str = "") -> bool:
        """Whether an entry of this tenant, written or queued, already holds `tokens` (or more after them)."""
        with self._cond:
            return self._covered(tokens, salt)

    def put(
        self,
        tokens: list[int],
        n_exact: int,
        pos_min: int,
        data: Buffer | tuple[Buffer, ...],
        salt: str = "",
        checkpoints: Cuts = (),
    ) -> int | None:  # (a saved-state tier's `put`: worker/tier.py; an id is true)
        """Queue a state holding `tokens` for writing (`data`: the state, or the state then its `checkpoints`' states,
        written one after the other); returns its entry id, or None when nothing is queued (the tier is off, an entry
        covers them, it is over the capacity or the write queue is full). Never blocks on disk."""
        parts = data if isinstance(data, tuple) else (data,)
        state_bytes = sum(memoryview(p).nbytes for p in parts)
        tokens = list(tokens)
        nbytes = file_size(self._fp, self._sv, salt, len(tokens), state_bytes, len(checkpoints))
        with self._cond:
            if not self.enabled or self._closing or not tokens or nbytes > self.capacity or self._covered(tokens, salt):
                return None
            # queued writes this one extends would be superseded as soon as written: never write them
            new = PendingWrite(0, tokens, n_exact, pos_min, (), 0, 0, salt, checkpoints)
            for w in [w for w in self._queue if w.salt == salt and self._gives(new, w.tokens)]:
                self._queue.remove(w)
                self._pending_bytes -= w.state_bytes
            if self._pending_bytes + state_bytes > self.max_pending_bytes:
                self.skipped += 1
                return None
            entry_id = self._next_id
            self._next_id += 1
            self._queue.append(PendingWrite(entry_id, tokens, n_exact, pos_min, parts, state_bytes, nbytes, salt, checkpoints))
            self._pending_bytes += state_bytes
            self._cond.notify_all()
            return entry_id

    def best(self, prompt: list[int], salt: str = "") -> tuple[DiskEntry | None, int]:
        """This tenant's entry sharing the longest prefix with `prompt`, and that length (0 when none shares anything)."""
        with self._cond:
            return longest_prefix(self._entries.values(), prompt, salt)

    def sharing(self, prompt: list[int], salt: str = "") -> list[tuple[DiskEntry, int]]:
        """This tenant's entries sharing a prefix with `prompt`, each with that length."""
        with self._cond:
            return shared_prefixes(self._entries.values(), prompt, salt)

    def read(self, entry: DiskEntry) -> StateData | None:
        """The entry's state, checked, in a ctypes buffer (`Llama.state_set` takes it as is) that the next `read`
        overwrites; None when the entry is gone or its file does not check out (then the file is removed and the
        entry dropped). Compute thread only."""
        if self._entries.get(entry.id) is not entry:
            return None
        try:
            buf = self.files.read(entry)
        except Bad as exc:
            if self._forget(entry):
                self._reject(entry.path, str(exc))
            return None
        except OSError as exc:
            if self._forget(entry):  # (not indexed any more: the writer evicted it meanwhile, nothing is wrong)
                self._reject(entry.path, f"unreadable: {exc}")
            return None
        return buf

    def used(self, entry: DiskEntry) -> None:
        """Mark `entry` most recently used, in memory and in the file's mtime (so the order survives a restart)."""
        with self._cond:
            if self._entries.get(entry.id) is not entry:
                return
            entry.last_used = self._stamp()
        with contextlib.suppress(OSError):  # evicted meanwhile: nothing to keep
            os.utime(entry.path, ns=(entry.last_used, entry.last_used))

    def drop(self, entry: DiskEntry) -> None:
        """Remove an entry (its restore failed: it would fail again)."""
        if self._forget(entry):
            self._remove(entry.path, "dropped by the caller", level="info")

    def drain_events(self) -> list[Event]:
        """What was added and dropped since the last call, in order."""
        with self._cond:
            events, self._events = self._events, []
        return events

    def changes(self) -> tuple[list[Added], list[int]]:
        """The states added and the ids dropped since the last call (worker/tier.py)."""
        events = self.drain_events()
        return [e for e in events if isinstance(e, Added)], [e.entry_id for e in events if isinstance(e, Dropped)]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or dropped); False when `timeout` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._busy is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop: queued writes not begun are dropped (`flush` first to keep them), the one in progress finishes (up
        to `timeout` seconds), the directory lock is released. The files stay for the next start."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        with self._cond:
            self.enabled = False
            self._entries.clear()
            self._nbytes = 0
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the writer thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or not self.enabled)
                if self._closing or not self.enabled:
                    return
                w = self._busy = self._queue.popleft()
                self._pending_bytes -= w.state_bytes
            try:
                self._write(w)
            except OSError as exc:
                self._off("write failed", exc)
            except Exception as exc:  # a bug must not kill the thread silently with writes pending forever
                self._off("write failed (unexpected)", exc)
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _write(self, w: PendingWrite) -> None:
        with self._cond:
            if not self.enabled or self._covered(w.tokens, w.salt, writing=w):
                return
            victims = [e for e in self._entries.values() if e.salt == w.salt and self._gives(w, e.tokens)]
            room = self._nbytes - sum(e.nbytes for e in victims)
            for e in sorted(self._entries.values(), key=lambda e: (e.last_used, e.id)):
                if room + w.nbytes <= self.capacity:
                    break
                if e not in victims:
                    victims.append(e)
                    room -= e.nbytes
            for e in victims:  # out of the index first: `best` no longer offers what is about to go
                self._unindex(e)
        for e in victims:
            self.evicted += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
        path, stamp = self.files.write(w, self._locked_stamp)
        with self._cond:
            if not self.enabled:
                return
            entry = DiskEntry(w.id, w.tokens, w.n_exact, w.pos_min, w.nbytes, w.state_bytes, path, stamp, w.salt, w.checkpoints)
            self._entries[w.id] = entry
            self._nbytes += w.nbytes
            self._events.append(Added.of(entry))
            self.written += 1

    # -- helpers --------------------------------------------------------------------------------------------------

    def _covered(self, tokens: list[int], salt: str, writing: PendingWrite | None = None) -> bool:
        held: list[DiskEntry | PendingWrite] = [e for e in self._entries.values() if e.salt == salt]
        held += [w for w in self._queue if w is not writing and w.salt == salt]
        if self._busy is not None and self._busy is not writing and self._busy.salt == salt:
            held.append(self._busy)
        return any(self._gives(e, tokens) for e in held)

    def _gives(self, longer: DiskEntry | PendingWrite, tokens: list[int]) -> bool:
        """Whether a state (written or to write) gives all of `tokens`: they are a prefix of its tokens it can be cut
        back to."""
        cuts = [c for c, _ in longer.checkpoints]
        return gives(longer.tokens, longer.pos_min, cuts, self.min_keep, tokens)

    def _stamp(self) -> int:
        """A strictly increasing wall-clock time in ns (ties would blur the LRU order a restart reads back)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _locked_stamp(self) -> int:
        with self._cond:
            return self._stamp()

    def _unindex(self, e: DiskEntry) -> None:
        del self._entries[e.id]
        self._nbytes -= e.nbytes
        self._events.append(Dropped(e.id))

    def _forget(self, entry: DiskEntry) -> bool:
        with self._cond:
            if self._entries.get(entry.id) is not entry:
                return False
            self._unindex(entry)
            return True

    def _reject(self, path: Path, reason: str) -> None:
        self.rejected += 1
        self._remove(path, reason)

    def _remove(self, path: Path, reason: str, level: str = "warning") -> bool:
        getattr(log, level)("disk_cache_file_removed", path=str(path), reason=reason)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._off("cannot remove files", exc)
            return False
        return True

    def _off(self, reason: str, exc: BaseException) -> None:
        """Turn the tier off for good: log once, drop queued writes and every entry (the files stay)."""
        with self._cond:
            first, self._off_logged = not self._off_logged, True
            self.enabled = False
            self._queue.clear()
            self._pending_bytes = 0
            for e in list(self._entries.values()):
                self._unindex(e)
            self._cond.notify_all()
        if first:
            log.warning("disk_cache_off", directory=str(self.directory), reason=reason, error=str(exc))
