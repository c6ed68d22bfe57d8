"""The memory saved states and checkpoints are copied into (worker/buffers.py): a freed buffer is handed out again
where it fits, so its pages are not asked of the kernel again; the pool keeps a bounded amount."""

from __future__ import annotations

import ctypes
import gc
import threading

from worker.buffers import FIT, GRANULE_MIN, BufferPool, capacity

MB = 2**20


def test_a_capacity_rounds_up_by_less_than_a_sixteenth_or_the_smallest_granule() -> None:
    for size in (1, 4096, GRANULE_MIN + 1, 7_900_000, 18_103_664, 3 * 2**30 + 7):
        cap = capacity(size)
        assert size <= cap < size + max(GRANULE_MIN, size // 16) and cap % GRANULE_MIN == 0


def test_a_freed_buffer_is_handed_out_again_for_a_size_it_fits() -> None:
    pool = BufferPool()
    first = pool.take(8 * MB)
    first[0], first[8 * MB - 1] = 1, 2
    where = ctypes.addressof(first)
    del first
    again = pool.take(8 * MB - 4096)  # (a state a few tokens shorter)
    assert ctypes.addressof(again) == where and len(again) == 8 * MB - 4096
    assert (pool.mapped, pool.reused, pool.kept) == (1, 1, 0)
    again[0] = 9  # (writable; llama.cpp writes every byte, so it is not zeroed)
    assert again[0] == 9


def test_a_buffer_much_larger_or_smaller_than_asked_is_not_taken() -> None:
    pool = BufferPool()
    big = pool.take(8 * MB)
    del big
    small = pool.take(int(8 * MB / FIT) - MB)  # would leave more than FIT idle
    larger = pool.take(9 * MB)  # does not fit
    assert pool.reused == 0 and pool.mapped == 3 and pool.kept == capacity(8 * MB)
    assert len(small) == int(8 * MB / FIT) - MB and len(larger) == 9 * MB


def test_the_pool_keeps_freed_buffers_up_to_its_bound() -> None:
    pool = BufferPool(keep=20 * MB)
    bufs = [pool.take(8 * MB) for _ in range(4)]  # (the largest is 8 MB: twice it is below the bound)
    del bufs
    gc.collect()
    assert pool.kept == 2 * capacity(8 * MB)  # a third would pass 20 MB: it was let go


def test_a_buffer_dropped_on_another_thread_comes_back() -> None:
    pool = BufferPool()
    holder = [pool.take(MB)]
    t = threading.Thread(target=holder.clear)
    t.start()
    t.join()
    assert pool.kept == capacity(MB)
    pool.take(MB)
    assert pool.reused == 1
