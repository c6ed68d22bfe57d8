"""DiskCache on real files (no model: the states are made-up bytes): round trip, LRU by bytes, one entry per
conversation, restarts, files that do not check out, a full disk, writes off the caller's thread."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from worker import disk_cache as dc
from worker.disk_cache import Added, DiskCache, DiskEntry, Dropped

FP, SV = "a1b2c3d4e5f6a7b8", "llama-cpp-python=0.3.36;seq=0x67677371/3"
REPO = Path(__file__).resolve().parents[2]


def state(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def opened(directory: Path, capacity: int = 1 << 20, fp: str = FP, sv: str = SV) -> DiskCache:
    cache = DiskCache(directory, capacity, fp, sv)
    cache.load()
    return cache


def file_size(n_tokens: int, n_state: int, fp: str = FP, sv: str = SV) -> int:
    """What one entry's file takes: fixed header, the two strings, the tokens, two CRCs, the state."""
    return 40 + len(fp) + len(sv) + 4 * n_tokens + 4 + n_state + 4


def put(
    cache: DiskCache, tokens: list[int], data: bytes | ctypes.Array[ctypes.c_uint8], n_exact: int | None = None, pos_min: int = 0
) -> int:
    entry_id = cache.put(tokens, len(tokens) if n_exact is None else n_exact, pos_min, data)
    assert entry_id is not None
    assert cache.flush(5)
    return entry_id


def found(cache: DiskCache, tokens: list[int]) -> DiskEntry:
    entry, _ = cache.best(tokens)
    assert entry is not None
    return entry


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[DiskCache]:
    c = opened(tmp_path / "disk")
    yield c
    c.close()


def test_round_trip_gives_back_the_state_and_announces_it(cache: DiskCache):
    data = state(5000)
    entry_id = put(cache, [1, 2, 3, 4], data, n_exact=3, pos_min=2)
    entry, lcp = cache.best([1, 2, 3, 9])
    assert entry is not None and entry.id == entry_id and lcp == 3
    assert (entry.tokens, entry.n_exact, entry.pos_min, entry.state_bytes) == ([1, 2, 3, 4], 3, 2, 5000)
    assert entry.path == cache.directory / f"{entry_id}.kvs" and entry.nbytes == entry.path.stat().st_size
    assert entry.nbytes == file_size(4, 5000) and cache.nbytes == entry.nbytes
    out = cache.read(entry)
    assert isinstance(out, ctypes.Array) and bytes(out) == data  # a ctypes buffer: Llama.state_set takes it as is
    assert cache.drain_events() == [Added(entry_id, [1, 2, 3, 4], 3, 2, entry.nbytes)]
    assert cache.drain_events() == []
    assert cache.best([7, 7]) == (None, 0)
    # a ctypes buffer (what Llama.state_get returns) goes in as well
    blob = (ctypes.c_uint8 * 300).from_buffer_copy(state(300, 5))
    second = put(cache, [5, 6], blob)
    got = cache.read(found(cache, [5, 6]))
    assert got is not None and bytes(got) == state(300, 5) and second != entry_id
    # reads reuse one buffer (fresh memory per read is slow): a read's result lasts until the next read
    assert ctypes.addressof(got) == ctypes.addressof(out) and len(got) == 300
    again = cache.read(entry)
    assert again is not None and bytes(again) == data and ctypes.addressof(again) == ctypes.addressof(out)


def test_least_recently_used_files_go_first_within_the_byte_budget(tmp_path: Path):
    size = file_size(3, 1000)
    cache = opened(tmp_path, capacity=3 * size)
    ids = [put(cache, [i, i, i], state(1000, i)) for i in range(3)]
    cache.used(found(cache, [0, 0, 0]))  # the oldest becomes the newest
    cache.drain_events()
    new = put(cache, [7, 7, 7], state(1000))
    assert sorted(e.tokens[0] for e in cache.entries) == [0, 2, 7]  # [1, 1, 1] went
    assert not (tmp_path / f"{ids[1]}.kvs").exists()
    assert cache.drain_events() == [Dropped(ids[1]), Added(new, [7, 7, 7], 3, 0, size)]
    assert cache.nbytes == 3 * size
    big = put(cache, [8] * 3, state(2000))  # twice the size: the two least recently used go
    assert sorted(e.id for e in cache.entries) == [new, big]
    assert cache.put([9], 1, 0, state(3 * size)) is None  # more than the whole budget: refused, nothing dropped
    assert cache.flush(5) and len(cache) == 2
    cache.close()


def test_an_extension_supersedes_its_prefix_and_what_is_covered_is_not_written(cache: DiskCache):
    first = put(cache, [1, 2, 3], state(100))
    second = put(cache, [1, 2, 3, 4, 5], state(150))
    assert [e.id for e in cache.entries] == [second]
    assert not (cache.directory / f"{first}.kvs").exists()
    assert cache.drain_events() == [
        Added(first, [1, 2, 3], 3, 0, file_size(3, 100)),
        Dropped(first),
        Added(second, [1, 2, 3, 4, 5], 5, 0, file_size(5, 150)),
    ]
    assert cache.covers([1, 2, 3]) and not cache.covers([1, 2, 3, 4, 5, 6])
    assert cache.put([1, 2, 3], 3, 0, state(100)) is None  # held already: nothing to write
    assert cache.put([1, 2, 3, 4, 5], 5, 0, state(100)) is None
    # queued writes: the shorter one, superseded before it is written, never reaches the disk
    third = cache.put([4, 4], 2, 0, state(10))
    fourth = cache.put([4, 4, 4], 3, 0, state(10))
    assert cache.put([4], 1, 0, state(10)) is None  # covered by a queued write
    assert cache.flush(5)
    assert sorted(e.id for e in cache.entries) == [second, fourth]
    assert not (cache.directory / f"{third}.kvs").exists()
    assert sorted(p.name for p in cache.directory.glob("*.kvs")) == sorted([f"{second}.kvs", f"{fourth}.kvs"])


def test_a_restart_finds_the_entries_in_their_lru_order(tmp_path: Path):
    size = file_size(2, 500)
    cache = opened(tmp_path, capacity=3 * size)
    ids = [put(cache, [i, i], state(500, i)) for i in range(3)]
    cache.used(found(cache, [0, 0]))
    cache.close()

    again = DiskCache(tmp_path, 3 * size, FP, SV)
    assert not again.enabled and again.best([0, 0]) == (None, 0)  # nothing before load()
    loaded = again.load()
    assert sorted(e.id for e in loaded) == ids and again.enabled
    assert {e.id for e in again.drain_events() if isinstance(e, Added)} == set(ids)
    assert again.read(found(again, [2, 2])) is not None
    new = put(again, [5, 5], state(500))  # [1, 1] is now the least recently used
    assert sorted(e.id for e in again.entries) == [ids[0], ids[2], new]
    assert new > max(ids)  # ids stay unique across restarts
    again.close()

    smaller = opened(tmp_path, capacity=2 * size)  # the budget shrank: the least recently used ([2, 2]) goes at load
    assert sorted(e.id for e in smaller.entries) == [ids[0], new]
    assert len(list(tmp_path.glob("*.kvs"))) == 2
    smaller.close()


def test_entries_belong_to_their_tenant_across_a_restart(tmp_path: Path):
    """A salted entry is found, covered and superseded only within its tenant, and keeps its salt on disk."""
    c = opened(tmp_path / "disk")
    tokens = [1, 2, 3, 4]
    assert c.put(tokens, 4, 0, state(64), salt="tenant-a") is not None
    assert c.flush(5)
    assert c.best([*tokens, 5], salt="tenant-b") == (None, 0) and c.best([*tokens, 5]) == (None, 0)
    assert c.best([*tokens, 5], salt="tenant-a")[1] == 4
    assert not c.covers(tokens, salt="tenant-b")
    assert c.put([*tokens, 5], 5, 0, state(64), salt="tenant-b") is not None  # does not supersede a's
    assert c.flush(5)
    c.close()
    again = opened(tmp_path / "disk")
    assert sorted(e.salt for e in again.entries) == ["tenant-a", "tenant-b"]
    entry, lcp = again.best([*tokens, 5], salt="tenant-a")
    assert entry is not None and lcp == 4 and again.read(entry) is not None
    again.close()


def test_files_that_do_not_check_out_are_removed_and_logged(tmp_path: Path):
    disk = tmp_path / "disk"
    disk.mkdir()

    def write(fp: str = FP, sv: str = SV, tokens: list[int] | None = None) -> Path:
        """A file as a worker with this model and state format would leave it (made elsewhere: a load here would
        remove the others), moved in under a fresh id."""
        n = len(list(tmp_path.iterdir()))
        other = opened(tmp_path / f"w{n}", fp=fp, sv=sv)
        entry_id = put(other, tokens or [n + 100], state(400))
        other.close()
        return (tmp_path / f"w{n}" / f"{entry_id}.kvs").rename(disk / f"{n}.kvs")

    good = write(tokens=[1, 2, 3])
    swap = write(tokens=[1, 2, 4])
    swapped = swap.read_bytes()  # a valid file of the same size, other tokens
    swap.unlink()
    foreign = write(fp="ffffffffffffffff")
    other_version = write(sv="llama-cpp-python=0.3.99")
    truncated = write()
    truncated.write_bytes(truncated.read_bytes()[:-10])
    bad_header = write()
    raw = bytearray(bad_header.read_bytes())
    raw[36 + len(FP) + len(SV)] ^= 0x01  # a token
    bad_header.write_bytes(bytes(raw))
    bad_data = write(tokens=[5, 6, 7])
    raw = bytearray(bad_data.read_bytes())
    raw[-100] ^= 0x40  # in the state: only a full read can tell
    bad_data.write_bytes(bytes(raw))
    garbage = disk / "9000.kvs"
    garbage.write_bytes(b"not a state at all" * 10)
    empty = disk / "9001.kvs"
    empty.write_bytes(b"")
    stray = disk / "9002.kvs.tmp"
    stray.write_bytes(b"half a write")
    misnamed = disk / "notanumber.kvs"
    misnamed.write_bytes(good.read_bytes())
    notes = disk / "notes.txt"  # not ours: left alone
    notes.write_text("keep me")

    with structlog.testing.capture_logs() as logs:
        cache = opened(disk)
    removed = {Path(e["path"]).name: e["reason"] for e in logs if e["event"] == "disk_cache_file_removed"}
    assert set(removed) == {p.name for p in (foreign, other_version, truncated, bad_header, garbage, empty, stray, misnamed)}
    assert "other model" in removed[foreign.name] and "other state version" in removed[other_version.name]
    assert "truncated" in removed[truncated.name] and "truncated" in removed[empty.name]
    assert "header checksum" in removed[bad_header.name] and "bad magic" in removed[garbage.name]
    assert "temp" in removed[stray.name]
    assert sorted(p.name for p in disk.iterdir()) == sorted([".lock", good.name, bad_data.name, notes.name])
    assert cache.rejected == 7

    entry, lcp = cache.best([5, 6, 7])
    assert entry is not None and lcp == 3
    cache.drain_events()
    with structlog.testing.capture_logs() as logs:
        assert cache.read(entry) is None  # the caller computes the prompt instead
    assert [e["event"] for e in logs] == ["disk_cache_file_removed"] and "checksum" in logs[0]["reason"]
    assert not bad_data.exists() and cache.best([5, 6, 7]) == (None, 0)
    assert cache.drain_events() == [Dropped(entry.id)]
    assert cache.read(entry) is None  # gone: quietly nothing
    good_entry = found(cache, [1, 2, 3])
    got = cache.read(good_entry)
    assert got is not None and bytes(got) == state(400)
    good.write_bytes(swapped)  # changed under a loaded entry: the header no longer says what the index does
    with structlog.testing.capture_logs() as logs:
        assert cache.read(good_entry) is None
    assert "header differs" in logs[0]["reason"] and not good.exists()
    cache.close()


def test_zero_capacity_is_off_and_touches_nothing(tmp_path: Path):
    cache = DiskCache(tmp_path / "never", 0, FP, SV)
    assert cache.load() == [] and not cache.enabled
    assert cache.put([1], 1, 0, b"x") is None and cache.flush(1)
    assert not (tmp_path / "never").exists()
    cache.close()


def test_a_directory_that_cannot_be_made_turns_the_tier_off(tmp_path: Path):
    (tmp_path / "file").write_text("")
    cache = DiskCache(tmp_path / "file" / "sub", 1 << 20, FP, SV)
    with structlog.testing.capture_logs() as logs:
        assert cache.load() == []
    assert not cache.enabled and [e["event"] for e in logs] == ["disk_cache_off"]
    assert cache.put([1, 2], 2, 0, state(10)) is None
    cache.close()


def test_a_second_cache_on_a_directory_in_use_stays_off(cache: DiskCache):
    put(cache, [1, 2], state(10))
    other = DiskCache(cache.directory, 1 << 20, FP, SV)
    with structlog.testing.capture_logs() as logs:
        assert other.load() == []
    assert not other.enabled and logs[0]["event"] == "disk_cache_off"
    other.close()
    assert len(list(cache.directory.glob("*.kvs"))) == 1  # it removed nothing


def test_writes_happen_on_the_writer_thread_and_flush_waits_for_them(cache: DiskCache, monkeypatch: pytest.MonkeyPatch):
    gate, threads = threading.Event(), []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        threads.append(threading.get_ident())
        assert gate.wait(5)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    entry_id = cache.put([1, 2, 3], 3, 0, state(1000))
    assert entry_id is not None  # put came back while the write is held up
    assert cache.best([1, 2, 3]) == (None, 0)  # not there before its file is complete
    assert not cache.flush(0.05)
    assert not (cache.directory / f"{entry_id}.kvs").exists()
    gate.set()
    assert cache.flush(5)
    assert cache.best([1, 2, 3])[0] is not None
    assert threads and threading.get_ident() not in threads


def test_a_full_disk_turns_the_tier_off_without_raising(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a 64 KiB tmpfs needs root (the file size limit test covers a failed write)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        cache = opened(mnt, capacity=1 << 20)  # the budget is not what stops it: the disk is
        small = put(cache, [1, 2], state(8000))
        cache.drain_events()
        with structlog.testing.capture_logs() as logs:
            assert cache.put([3, 4], 2, 0, state(200_000)) is not None  # fails on the writer thread
            cache.put([5, 6], 2, 0, state(100))  # queued behind it (or refused if the failure came first)
            assert cache.flush(5)
        assert not cache.enabled
        assert [e["event"] for e in logs] == ["disk_cache_off"] and "No space" in logs[0]["error"]
        assert cache.drain_events() == [Dropped(small)]  # the tier holds nothing now
        assert cache.best([1, 2]) == (None, 0) and cache.put([7], 1, 0, b"x") is None
        assert sorted(p.name for p in mnt.iterdir()) == [".lock", f"{small}.kvs"]  # no temp file left; the file stays
        cache.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


FSIZE_SCRIPT = """
import json, resource, signal, sys
from pathlib import Path
from worker.disk_cache import DiskCache

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
cache = DiskCache(Path(sys.argv[1]), 1 << 20, "fp", "sv")
cache.load()
ok = cache.put([1], 1, 0, bytes(1000))
cache.flush(5)
held = [e.id for e in cache.entries]
failed = cache.put([2], 1, 0, bytes(50_000))
cache.flush(5)
print(json.dumps({"ok": ok, "held": held, "failed": failed, "enabled": cache.enabled,
                  "files": sorted(p.name for p in Path(sys.argv[1]).iterdir())}))
"""


def test_a_failed_write_in_a_file_size_limited_process_turns_the_tier_off(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["held"] == [result["ok"]] and result["failed"] is not None and result["enabled"] is False
    assert result["files"] == [".lock", f"{result['ok']}.kvs"]  # the temp file was removed
    assert any("disk_cache_off" in line and "File too large" in line for line in lines[:-1])


def test_the_state_version_names_the_pinned_llama_cpp():
    import llama_cpp

    version = dc.llama_state_version("k=f16", "v=f16")
    assert f"llama-cpp-python={llama_cpp.__version__}" in version and version.endswith(";k=f16;v=f16")
