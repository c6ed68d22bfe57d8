"""HostCache bookkeeping (no model): LRU within a byte budget, one entry per conversation, longest match."""

from __future__ import annotations

import ctypes

from worker.host_cache import HostCache


def blob(n: int) -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * n)()


def test_longest_shared_prefix_wins_and_extensions_replace_their_prefix():
    cache = HostCache(1000)
    assert cache.put([1, 2, 3], 3, 0, blob(100))
    assert cache.put([1, 2, 3, 4, 5], 5, 0, blob(150))  # extends the first: replaces it
    assert len(cache) == 1 and cache.nbytes == 150
    assert cache.put([1, 9], 2, 0, blob(50))
    entry, lcp = cache.best([1, 2, 3, 4, 7])
    assert entry is not None and entry.tokens == [1, 2, 3, 4, 5] and lcp == 4
    assert cache.covers([1, 2, 3]) and cache.covers([1, 9]) and not cache.covers([1, 9, 9])
    assert cache.best([7, 7]) == (None, 0)


def test_least_recently_used_goes_first_and_the_budget_holds():
    cache = HostCache(300)
    for i in range(3):
        assert cache.put([i, i, i], 3, 0, blob(100))
    cache.used(cache.best([0, 0, 0])[0])  # touch the oldest
    assert cache.put([7, 7, 7], 3, 0, blob(100))  # evicts [1, 1, 1], the least recently used
    assert sorted(e.tokens[0] for e in cache.entries) == [0, 2, 7]
    assert cache.nbytes == 300
    assert not cache.put([8], 1, 0, blob(301))  # bigger than the whole budget: refused, nothing dropped
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_zero_capacity_keeps_nothing():
    cache = HostCache(0)
    assert not cache.put([1, 2], 2, 0, blob(1))
    assert len(cache) == 0


def test_room_is_made_before_a_state_is_copied_out():
    cache = HostCache(300)
    for i in range(3):
        assert cache.put([i], 1, 0, blob(100))
    assert cache.make_room(150)  # the two least recently used go: the copy then fits
    assert sorted(e.tokens[0] for e in cache.entries) == [2] and cache.nbytes == 100
    assert not cache.make_room(301) and not cache.make_room(0)  # never fits: nothing dropped
    assert len(cache) == 1


def test_a_dropped_entry_is_forgotten_and_its_bytes_freed():
    cache = HostCache(300)
    assert cache.put([1, 2], 2, 0, blob(100)) and cache.put([3], 1, 0, blob(50))
    entry, _ = cache.best([1, 2])
    assert entry is not None
    cache.drop(entry)
    cache.drop(entry)  # twice: nothing more happens
    assert cache.best([1, 2]) == (None, 0) and cache.nbytes == 50 and len(cache) == 1


def test_a_state_buffer_is_writable_and_of_the_asked_size_and_holds_an_entry() -> None:
    from worker.buffers import BufferPool  # what state_get copies a slot into (worker/buffers.py)

    buf = BufferPool().take(3 * 4096 + 5)
    assert len(buf) == 3 * 4096 + 5
    buf[len(buf) - 1] = 7
    ctypes.memmove(buf, b"kv", 2)
    assert bytes(buf[:2]) == b"kv" and buf[len(buf) - 1] == 7
    cache = HostCache(1 << 20)
    assert cache.put([1, 2], 2, 0, buf) and cache.nbytes == len(buf)
