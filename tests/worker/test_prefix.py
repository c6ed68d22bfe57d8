"""Prefix sourcing with plain data, no model: which slot or saved state a prompt's prefix is copied from, what is
saved before a slot loses it, and when a job waits for a prefix another slot is computing."""

from __future__ import annotations

import ctypes

from worker_prefix_fakes import FakeLlama, prefixes_for

from common.slots import COPY_MIN, COPY_RATIO, SlotPhase
from protocol import Job, Sampling, pack_tokens
from worker.host_cache import HostCache
from worker.prefix import Prefixes
from worker.saved_states import SAVE_MIN
from worker.slots import Slot, SlotTable
from worker.task import Task

N_CTX = 1024


def setup(slots: int = 3, host_mb: int = 1, exact: bool = False) -> tuple[Prefixes, SlotTable, HostCache, FakeLlama]:
    llama, table = FakeLlama(slots), SlotTable(slots)
    prefixes = prefixes_for(llama, table, N_CTX, host_mb, exact)
    return prefixes, table, prefixes.host, llama


def hold(slot: Slot, tokens: list[int], n_exact: int = 0, salt: str = "") -> None:
    slot.tokens, slot.n_exact, slot.salt = list(tokens), n_exact, salt


def task(prompt: list[int], seed: int | None = None, salt: str = "", priority: int = 0) -> Task:
    job = Job(id="j", slot=-1, tokens=pack_tokens(prompt), sampling=Sampling(seed=seed), cache_salt=salt, priority=priority)
    return Task("j", job, prompt, sink=lambda m: None, max_gen=10, t_arrival=0.0, deadline=None)


PROMPT = list(range(1, 201))


def test_the_longest_worthwhile_prefix_is_copied_from_another_slot_or_host_ram():
    prefixes, table, host, llama = setup()
    mine, other, third = table.slots
    hold(mine, PROMPT[:10])
    hold(other, [*PROMPT[:150], 999])
    hold(third, PROMPT[:120])
    src = prefixes.source(mine, PROMPT, prefixes.held(mine, PROMPT), seeded=False)
    assert src is not None and src.slot is other and src.lcp == 150
    assert prefixes.copy(mine, src) == 150 and llama.copies == [(1, 0)] and mine.id in prefixes.copying
    assert mine.tokens == other.tokens

    host.put(PROMPT[:180], 0, 0, (ctypes.c_uint8 * 10)(), "")
    hold(mine, [])
    src = prefixes.source(mine, PROMPT, 0, seeded=False)
    assert src is not None and src.slot is other  # a copy into it is pending: a restore now would be overwritten
    prefixes.copying.clear()
    src = prefixes.source(mine, PROMPT, 0, seeded=False)
    assert src is not None and src.saved in host.entries and src.lcp == 180
    assert prefixes.copy(mine, src) == 180 and mine.tokens == PROMPT[:180]


def test_a_copy_must_gain_enough_and_never_crosses_tenants():
    prefixes, table, _, _ = setup()
    mine, other, _ = table.slots
    hold(mine, PROMPT[:100])
    hold(other, PROMPT[: 100 + max(COPY_MIN, N_CTX // COPY_RATIO) - 1])  # not worth a copy of the slot's stream
    assert prefixes.source(mine, PROMPT, prefixes.held(mine, PROMPT), seeded=False) is None
    hold(other, PROMPT[:190], salt="tenant-b")
    assert prefixes.source(mine, PROMPT, 100, seeded=False) is None


def test_a_seeded_job_takes_only_kv_computed_for_seeded_prompts():
    prefixes, table, _, _ = setup()
    mine, computed_plain, computed_seeded = table.slots
    hold(computed_plain, PROMPT[:190])
    hold(computed_seeded, PROMPT[:190], n_exact=80)
    assert prefixes.held(computed_plain, PROMPT, seeded=True) == 0
    assert prefixes.held(computed_seeded, PROMPT, seeded=True) == 80
    src = prefixes.source(mine, PROMPT, 0, seeded=True)
    assert src is not None and src.slot is computed_seeded and src.lcp == 80
    src = prefixes.source(mine, PROMPT, 0, seeded=False)
    assert src is not None and src.lcp == 190  # (an unseeded job takes either)


def test_what_a_slot_loses_is_saved_to_host_ram_once():
    prefixes, table, host, _ = setup()
    slot, twin, _ = table.slots
    hold(slot, PROMPT[:150], n_exact=40)
    prefixes.save(slot, 150 - SAVE_MIN + 1)  # loses too little to be worth it
    assert len(host) == 0
    prefixes.save(slot, 0)
    assert [(e.tokens, e.n_exact, e.slot) for e in host.entries] == [(PROMPT[:150], 40, 0)]
    prefixes.save(slot, 0)  # held there already
    hold(twin, PROMPT[:160])
    hold(slot, PROMPT[:100])
    prefixes.save(slot, 0)  # another slot holds it (and more)
    assert len(host) == 1


def test_a_job_waits_for_a_prefix_another_slot_is_computing_unless_it_has_it():
    prefixes, table, _, _ = setup()
    busy, idle, _ = table.slots
    busy.phase, busy.task = SlotPhase.BUSY, task(PROMPT)
    hold(busy, PROMPT[:20])  # computing: 20 of 200 so far
    assert prefixes.awaits(task([*PROMPT[:150], 7]))
    hold(idle, PROMPT[:140])  # held nearly all of it already
    assert not prefixes.awaits(task([*PROMPT[:150], 7]))
    hold(idle, [])
    assert not prefixes.awaits(task([*PROMPT[:150], 7], seed=3))  # an unseeded job's KV is no use to a seeded one
    busy.task = task(PROMPT, seed=4)
    assert prefixes.awaits(task([*PROMPT[:150], 7], seed=3))


def test_a_job_does_not_wait_for_a_prefix_a_paused_job_of_lower_priority_is_computing():
    prefixes, table, _, _ = setup()
    computing, interactive, _ = table.slots
    computing.phase, computing.task = SlotPhase.BUSY, task(PROMPT, priority=-1)
    hold(computing, PROMPT[:20])
    assert prefixes.awaits(task([*PROMPT[:150], 7], priority=1))  # it runs now: worth waiting for
    interactive.phase, interactive.task = SlotPhase.BUSY, task([5, 6, 7], priority=1)
    assert not prefixes.awaits(task([*PROMPT[:150], 7], priority=1))  # paused until the interactive job ends
    assert not prefixes.awaits(task([*PROMPT[:150], 7], priority=-1))
    computing.task = task(PROMPT, priority=1)  # one priority: waited for as before
    assert prefixes.awaits(task([*PROMPT[:150], 7], priority=1))
