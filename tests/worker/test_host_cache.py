"""HostCache bookkeeping (no model): LRU within a byte budget, one entry per conversation, longest match."""

from __future__ import annotations

import ctypes

from worker.host_cache import HostCache


def blob(n: int) -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * n)()


def test_longest_shared_prefix_wins_and_extensions_replace_their_prefix():
    cache = HostCache(1000)
    assert cache.put([1, 2, 3], 3, blob(100))
    assert cache.put([1, 2, 3, 4, 5], 5, blob(150))  # extends the first: replaces it
    assert len(cache) == 1 and cache.nbytes == 150
    assert cache.put([1, 9], 2, blob(50))
    entry, lcp = cache.best([1, 2, 3, 4, 7])
    assert entry is not None and entry.tokens == [1, 2, 3, 4, 5] and lcp == 4
    assert cache.covers([1, 2, 3]) and cache.covers([1, 9]) and not cache.covers([1, 9, 9])
    assert cache.best([7, 7]) == (None, 0)


def test_least_recently_used_goes_first_and_the_budget_holds():
    cache = HostCache(300)
    for i in range(3):
        assert cache.put([i, i, i], 3, blob(100))
    cache.used(cache.best([0, 0, 0])[0])  # touch the oldest
    assert cache.put([7, 7, 7], 3, blob(100))  # evicts [1, 1, 1], the least recently used
    assert sorted(e.tokens[0] for e in cache.entries) == [0, 2, 7]
    assert cache.nbytes == 300
    assert not cache.put([8], 1, blob(301))  # bigger than the whole budget: refused, nothing dropped
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_zero_capacity_keeps_nothing():
    cache = HostCache(0)
    assert not cache.put([1, 2], 2, blob(1))
    assert len(cache) == 0
