"""Context checkpoints with plain data, no model (issue 48): where a slot takes them, their budget, the rule both the
worker and the router follow (common/slots.py `restore_keep`), and prefix sourcing on a memory that cannot be cut
back (a fake recurrent memory: worker_prefix_fakes.FakeLlama)."""

from __future__ import annotations

import ctypes
import itertools

import pytest
from worker_prefix_fakes import FakeLlama, prefixes_for

from common.slots import EXACT_ROWS, restore_keep
from protocol import Job, Sampling, pack_tokens
from worker.checkpoints import TAIL, Budget, Checkpoint, cuts, for_saves, on_save, positions
from worker.prefix import Prefixes
from worker.saved_states import from_disk, on_disk
from worker.slots import Slot, SlotTable
from worker.task import Task

PROMPT = list(range(1, 301))


def data(n: int, size: int = 10) -> ctypes.Array[ctypes.c_uint8]:
    buf = (ctypes.c_uint8 * size)()
    ctypes.c_uint32.from_buffer(buf).value = n
    return buf


def task(prompt: list[int], salt: str = "") -> Task:
    job = Job(id="j", slot=-1, tokens=pack_tokens(prompt), sampling=Sampling(), cache_salt=salt)
    return Task("j", job, prompt, sink=lambda m: None, max_gen=10, t_arrival=0.0, deadline=None)


def recurrent(slots: int = 2, budget: Budget | None = None) -> tuple[Prefixes, SlotTable, FakeLlama]:
    llama, table = FakeLlama(slots, recurrent=True), SlotTable(slots)
    prefixes = prefixes_for(llama, table, 1024, budget=budget or Budget(32, 1 << 20, 1 << 20))
    return prefixes, table, llama


def computed(prefixes: Prefixes, slot: Slot, t: Task) -> None:
    """What the engine does while the slot reads the prompt: chunks up to each checkpoint position, one taken there."""
    llama = prefixes.llama
    for p in t.checkpoint_at:
        if p > slot.n_tokens:
            slot.tokens = list(t.prompt[:p])
            llama.held[slot.id] = p  # type: ignore[attr-defined]
            prefixes.checkpoint(slot)


@pytest.mark.parametrize(
    ("lcp", "n", "min_keep", "cut_at", "gives"),
    [
        (50, 100, 0, [], 50),  # plain KV: any cut
        (100, 100, 100, [], 100),  # the whole of it: a recurrent state extended
        (99, 100, 100, [], 0),  # a recurrent state cut back, no checkpoint: nothing
        (99, 100, 100, [40, 96], 96),  # the longest checkpoint within
        (39, 100, 100, [40, 96], 0),
        (70, 100, 60, [30], 70),  # within what a window cache still holds
        (50, 100, 60, [30], 30),
    ],
)
def test_what_a_slot_or_saved_state_gives_is_its_cut_or_its_best_checkpoint(lcp, n, min_keep, cut_at, gives):
    assert restore_keep(lcp, n, min_keep, cut_at) == gives


def test_positions_are_where_the_job_began_every_n_tokens_near_the_end_and_the_end():
    assert positions(0, 100, 0, 512, False) == [0, 96, 100]
    assert positions(50, 1300, 512, 512, False) == [50, 512, 784, 1024, 1296, 1300]  # (1300 - 4 - 512 = 784)
    assert positions(98, 100, 0, 512, False) == [98, 100]  # (96 is before the job began)
    exact = positions(0, 30, 0, 512, True)  # deterministic mode: every chunk between two at least EXACT_ROWS
    assert exact == [0, 30 - EXACT_ROWS, 30] and all(b - a >= EXACT_ROWS for a, b in itertools.pairwise(exact))
    assert positions(0, 10, 0, 512, True) == [0, 10]
    # where the prompt parts from what a slot or saved state holds (when that could not be given: a branch point)
    assert positions(8, 632, 512, 512, False, branch=248) == [8, 116, 248, 512, 628, 632]
    assert positions(300, 632, 0, 512, False, branch=248) == [300, 628, 632]  # (before the job began: held already)
    assert for_saves(8, 632, 512, 512, False, branch=248) == [8, 248, 512, 632]


def test_a_save_takes_checkpoints_near_the_end_and_every_window_above_what_the_slot_keeps():
    assert on_save(9, 1286, 512, 0, []) == [1286 - TAIL, 1024, 512]
    assert on_save(600, 1286, 512, 0, [1024]) == [1286 - TAIL]  # (above `keep`; none twice)
    assert on_save(0, 1286, 512, 800, []) == [1286 - TAIL, 1024]  # (not below where the slot itself can be cut back to)
    assert on_save(0, 40, 512, 0, []) == [40 - TAIL] and on_save(0, 20, 512, 0, []) == []
    assert on_save(0, 1286, 0, 0, []) == [1286 - TAIL]


def test_the_budget_drops_the_oldest_checkpoints_of_the_slot_then_of_the_least_recently_used_slot():
    a, b = Slot(0), Slot(1)
    a.last_used, b.last_used = 2, 1
    budget = Budget(max_count=3, slot_bytes=30, total_bytes=35)
    for n in (10, 20, 30):
        assert budget.add(a, Checkpoint(n, data(n)), [a, b])
    assert cuts(a.checkpoints) == [10, 20, 30]
    assert budget.add(a, Checkpoint(5, data(5)), [a, b])  # over its count: the oldest (10) goes; kept in position order
    assert cuts(a.checkpoints) == [5, 20, 30]
    assert budget.add(b, Checkpoint(7, data(7)), [a, b])  # the worker is full (35): another slot's oldest goes
    assert cuts(a.checkpoints) == [5, 30] and cuts(b.checkpoints) == [7] and budget.used([a, b]) == 30
    assert budget.add(a, Checkpoint(40, data(40)), [a, b])  # full again: b (the least recently used) loses its oldest
    assert cuts(b.checkpoints) == [] and cuts(a.checkpoints) == [5, 30, 40]
    assert budget.add(a, Checkpoint(50, data(50)), [a, b]) and cuts(a.checkpoints) == [5, 40, 50]
    assert not budget.add(a, Checkpoint(1, data(1, size=31)), [a, b])  # more than a slot may hold: never kept


def test_a_recurrent_slot_is_cut_back_to_its_checkpoint_within_the_shared_prefix():
    prefixes, table, llama = recurrent()
    slot = table[0]
    first = task(PROMPT[:100])
    prefixes.place(first, slot)
    assert first.reused == 0 and first.checkpoint_at == [0, 96, 100]
    computed(prefixes, slot, first)
    assert cuts(slot.checkpoints) == [96, 100]
    slot.tokens = [*PROMPT[:100], 7, 7, 7]  # its reply
    llama.held[0] = 103

    assert prefixes.held(slot, [999, *PROMPT]) == 0  # (a prompt starting otherwise: nothing)
    assert prefixes.held(slot, [*PROMPT[:100], 7, 7, 7, 9]) == 103  # extends it: all of it
    assert prefixes.held(slot, [*PROMPT[:100], 7, 5]) == 100  # diverges in the reply: from the prompt's end
    assert prefixes.held(slot, [*PROMPT[:98], 5, 5]) == 96  # diverges near the prompt's end: 4 before it
    again = task([*PROMPT[:98], 5, 5])
    prefixes.place(again, slot)
    assert again.reused == 96 and llama.restored == [(0, 96)] and slot.tokens == PROMPT[:96]
    assert cuts(slot.checkpoints) == [96] and prefixes.counters.snapshot_restores == 1
    # (96 is already held: not taken twice; 98 is where this prompt parts from what the slot held: the next one that
    # does too gets all 98 back)
    assert again.checkpoint_at == [96, 98, 100]


def test_a_recurrent_slot_is_copied_with_its_checkpoints_and_saved_to_host_ram_with_them():
    prefixes, table, llama = recurrent(slots=3)
    a, b, c = table.slots
    first = task(PROMPT[:100])
    prefixes.place(first, a)
    computed(prefixes, a, first)
    assert cuts(a.checkpoints) == [96, 100]

    # another slot gives 99 of a prompt: cut back to its checkpoint at 96, through host memory (no stream copy)
    other = task([*PROMPT[:99], 5, *PROMPT[100:150]])
    src = prefixes.source(b, other.prompt, 0, seeded=False)
    assert src is not None and src.slot is a and src.lcp == 96
    prefixes.place(other, b)
    assert other.reused == 96 and other.restored == 96 and llama.copies == [] and b.tokens == PROMPT[:96]
    assert cuts(b.checkpoints) == [96] and cuts(a.checkpoints) == [96, 100]  # (a keeps its own)

    # a slot about to be overwritten goes to host RAM with its checkpoints; a prompt sharing 98 comes back to 96
    prefixes.place(task([1000 + i for i in range(50)]), a)
    (entry,) = prefixes.host.entries
    assert entry.tokens == PROMPT[:100] and entry.cuts == [96, 100] and entry.nbytes == 100 + 2 * llama.partial
    third = task([*PROMPT[:98], 6, 6, 6])
    prefixes.place(third, b)
    assert third.reused == 96 and prefixes.counters.host_restores == 0  # b already had 96 itself: no restore pays
    fourth = task([*PROMPT[:100], 6] + [8] * 60)
    prefixes.place(fourth, c)
    assert fourth.reused == 100 and fourth.restored == 100 and prefixes.counters.host_restores == 1


def test_host_ram_keeps_a_shorter_state_unless_the_longer_one_has_a_checkpoint_there():
    prefixes, _table, _llama = recurrent()
    host = prefixes.host
    assert host.put(PROMPT[:50], 0, 49, data(50, 100))
    assert host.put(PROMPT[:80], 0, 79, data(80, 100), checkpoints=(Checkpoint(60, data(60)),))
    assert sorted(len(e.tokens) for e in host.entries) == [50, 80]  # 80 cannot be cut back to 50: both kept
    assert host.put(PROMPT[:90], 0, 89, data(90, 100), checkpoints=(Checkpoint(50, data(50)), Checkpoint(80, data(80))))
    assert sorted(len(e.tokens) for e in host.entries) == [90]  # it gives both: they go


def test_a_state_and_its_checkpoints_go_to_disk_as_one_run_of_buffers_and_come_back_apart():
    state = (ctypes.c_uint8 * 100)(*range(100))
    ckpts = (Checkpoint(40, data(40, 12)), Checkpoint(96, data(96, 8)))
    parts, placed = on_disk(state, ckpts)
    assert placed == ((40, 12), (96, 8)) and [len(p) for p in parts] == [100, 12, 8]
    blob = (ctypes.c_uint8 * 120)()
    ctypes.memmove(blob, bytes(state) + bytes(ckpts[0].data) + bytes(ckpts[1].data), 120)
    back, read = from_disk(blob, placed)
    assert bytes(back) == bytes(state) and [(c.n_tokens, bytes(c.data)) for c in read] == [
        (40, bytes(ckpts[0].data)),
        (96, bytes(ckpts[1].data)),
    ]


def test_a_job_waits_for_a_prefix_another_slot_computes_only_up_to_where_that_slot_takes_a_checkpoint():
    """A recurrent slot computing 300 prompt tokens takes checkpoints at 296 and 300: a job sharing 250 of them gains
    nothing by waiting (the slot could only be cut back to 0 for it); one sharing all 300 waits and copies them."""
    prefixes, table, _ = recurrent()
    busy = table[0]
    first = task(PROMPT[:300])
    table.assign(busy, first)
    prefixes.place(first, busy)
    assert first.checkpoint_at == [0, 296, 300]
    assert not prefixes.awaits(task([*PROMPT[:250], 7, 7]))
    assert prefixes.awaits(task([*PROMPT[:300], 7, 7]))
