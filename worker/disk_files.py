"""The disk tier's files, one at a time (worker/disk_cache.py keeps the index, the LRU order and the writer thread):
writing an entry's file so that a crash never leaves a partial one under a final name, reading its state back
checked, and reading a directory's entries at start.

Each entry is one file `<id>.kvs` (its temp file while written: `<id>.kvs.tmp`); the bytes in it: worker/disk_format.py.
Nothing here decides what to keep: a file that does not check out raises `Bad` (a read) or goes to `reject` (a scan).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import logs
from common.files import open_private
from worker.disk_format import (
    CRC_BYTES,
    Bad,
    Cuts,
    check_crc,
    crc_bytes,
    header_bytes,
    read_exact,
    read_header,
    readinto_exact,
    write_all,
)

if TYPE_CHECKING:
    from worker.llama import StateData

log = logs.get(__name__)

SUFFIX = ".kvs"
TMP_SUFFIX = ".kvs.tmp"
LOCK_NAME = ".lock"
_NAME = re.compile(r"(\d+)\.kvs(\.tmp)?")
_SCRATCH_STEP = 1 << 20  # the read buffer grows by whole MiB


@dataclass(eq=False)
class DiskEntry:
    id: int
    tokens: list[int]  # exactly the tokens whose KV the state holds, in position order
    n_exact: int
    pos_min: int
    nbytes: int  # the whole file: what counts against the capacity
    state_bytes: int  # the state alone: what `read` allocates
    path: Path
    last_used: int  # ns since the epoch; also the file's mtime, so the LRU order survives a restart
    salt: str = ""  # the tenant whose prompt it holds ("": none); entries are shared only within a tenant
    checkpoints: Cuts = ()  # (position, bytes) of the checkpoints stored after the state (worker/checkpoints.py)

    @property
    def cuts(self) -> list[int]:
        return [n for n, _ in self.checkpoints]


@dataclass(eq=False)
class PendingWrite:
    """A state queued for writing (its file does not exist yet)."""

    id: int
    tokens: list[int]
    n_exact: int
    pos_min: int
    data: tuple[Any, ...]  # C-contiguous buffers (StateData, bytes...), written in order
    state_bytes: int
    nbytes: int
    salt: str = ""
    checkpoints: Cuts = ()


class EntryFiles:
    """The entry files of one directory, for a model (`fingerprint`) and a llama.cpp state format (`state_version`)."""

    def __init__(self, directory: Path, fingerprint: bytes, state_version: bytes) -> None:
        self.directory = directory
        self._fp, self._sv = fingerprint, state_version
        self._scratch: ctypes.Array[ctypes.c_uint8] | None = None  # what `read` reads into, reused

    def scan(self, reject: Callable[[Path, str], object], remove: Callable[[Path, str], object]) -> tuple[list[DiskEntry], int]:
        """The entries whose headers check out, and the lowest id no file name uses. A file with an entry's name that does
        not check out goes to `reject`, a stray temp file (a write cut short) to `remove`; files with other names are
        left alone."""
        found: list[DiskEntry] = []
        next_id = 1
        for path in sorted(self.directory.iterdir()):
            m = _NAME.fullmatch(path.name)
            if m:
                next_id = max(next_id, int(m.group(1)) + 1)
            if path.name == LOCK_NAME or not path.is_file():
                continue
            if m is None:
                if path.name.endswith(TMP_SUFFIX) or path.name.endswith(SUFFIX):
                    reject(path, "not an entry name")
                else:
                    log.info("disk_cache_foreign_file_left", path=str(path))  # not ours: never removed
                continue
            if m.group(2):
                remove(path, "stray temp file (a write cut short)")
                continue
            try:
                with open(path, "rb", buffering=0) as f:
                    st = os.fstat(f.fileno())
                    tokens, n_exact, pos_min, state_bytes, salt, cuts = read_header(f, st.st_size, self._fp, self._sv)
            except Bad as exc:
                reject(path, str(exc))
                continue
            entry_id = int(m.group(1))
            stamp = st.st_mtime_ns
            found.append(DiskEntry(entry_id, tokens, n_exact, pos_min, st.st_size, state_bytes, path, stamp, salt, cuts))
        return found, next_id

    def read(self, entry: DiskEntry) -> StateData:
        """The entry's state, checked, in a ctypes buffer that the next `read` overwrites. Raises Bad (the file does not
        check out) or OSError."""
        with open(entry.path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            header = read_header(f, st.st_size, self._fp, self._sv)
            state_bytes = header[3]
            if header != (entry.tokens, entry.n_exact, entry.pos_min, entry.state_bytes, entry.salt, entry.checkpoints):
                raise Bad("header differs from the one loaded")
            f.seek(0)
            crc = zlib.crc32(read_exact(f, st.st_size - state_bytes - CRC_BYTES))
            buf = self._buffer(state_bytes)
            readinto_exact(f, memoryview(buf).cast("B"))
            check_crc(f, zlib.crc32(buf, crc))
        return buf

    def _buffer(self, n: int) -> ctypes.Array[ctypes.c_uint8]:
        """An n-byte view of the buffer every read reuses: fresh memory for each state costs more than reading it
        where page faults are slow (here, beside a 2.3 GiB KV cache: 33 ms for 10 MB; reading it 1 ms, checking 2)."""
        if self._scratch is None or len(self._scratch) < n:
            self._scratch = None  # (freed before the larger one is allocated)
            self._scratch = (ctypes.c_uint8 * (-(-n // _SCRATCH_STEP) * _SCRATCH_STEP))()
        return (ctypes.c_uint8 * n).from_buffer(self._scratch)

    def write(self, w: PendingWrite, stamp: Callable[[], int]) -> tuple[Path, int]:
        """Write `w`'s file: a temp file, fsynced, then renamed and the directory fsynced, so that a crash never leaves a
        partial file under a final name and an entry announced is there after a power cut. Its mtime is `stamp()`, taken
        once the data is written. Returns the path and that stamp. Raises OSError (the temp file is removed)."""
        path = self.directory / f"{w.id}{SUFFIX}"
        tmp = self.directory / f"{w.id}{TMP_SUFFIX}"
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb", buffering=0) as f:
                head = header_bytes(self._fp, self._sv, w.salt, w.tokens, w.n_exact, w.pos_min, w.state_bytes, w.checkpoints)
                write_all(f, head)
                crc = zlib.crc32(head)
                for part in w.data:
                    data = memoryview(part).cast("B")
                    write_all(f, data)
                    crc = zlib.crc32(data, crc)
                write_all(f, crc_bytes(crc))
                when = stamp()
                os.utime(f.fileno(), ns=(when, when))
                os.fsync(f.fileno())  # the data is on disk before the name says the file is complete
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fsync_dir()
        return path, when

    def _fsync_dir(self) -> None:
        """Make the rename durable (an entry announced to the router is there after a power cut)."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
