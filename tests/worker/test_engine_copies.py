"""Prefix copies inside one worker, with the real default model: from another slot, from a slot still computing
the prefix, and from the host-RAM cache of evicted slot contents. Deterministic mode, so a copied prefix must
give exactly what a cold computation gives."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_helpers import assert_slot_invariant, complete, start

from common.slots import COPY_MIN
from protocol import JobDone, StateFetch, pack_tokens
from worker import state_copies
from worker.checkpoints import TAIL
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.saved_states import SAVE_MIN

pytestmark = pytest.mark.model

DOC = (
    "The lighthouse keeper's log, autumn. The wind turned north before dawn and the sea rose against the rocks. "
    "Three fishing boats came in early; the fourth, the Mary Ellen, was seen rounding the point at noon with a torn "
    "sail. The keeper lit the lamp at four, an hour before the usual time, and wound the clockwork twice. "
)


@pytest.fixture(scope="module")
def copier() -> Iterator[Engine]:
    """Its own engine (3 slots), so that what the host cache holds depends only on this module."""
    eng = Engine(WorkerConfig(slots=3, ctx_per_slot=1024, threads=2, deterministic=True, host_cache_mb=64)).start()
    yield eng
    eng.stop()


def counters(engine: Engine) -> dict[str, int]:
    c = engine.call(lambda e: e.counters).result(10)
    return {k: getattr(c, k) for k in ("slot_copies", "host_saves", "host_restores", "restored_tokens", "copy_failures")}


def clear_all(engine: Engine) -> None:
    engine.reset()
    engine.call(lambda e: None).result(10)  # the reset has run


def test_prefix_is_copied_from_another_idle_slot(copier, vocab):
    clear_all(copier)
    doc = vocab.tokenize(DOC * 2)
    first = complete(copier, doc + vocab.tokenize(" Question: which boat was late?", add_special=False), slot=0)
    before = counters(copier)
    prompt = doc + vocab.tokenize(" Question: when was the lamp lit?", add_special=False)
    warm = complete(copier, prompt, slot=1)
    cold = complete(copier, prompt, slot=2, prefix_cache=False)
    assert isinstance(first.final, JobDone) and isinstance(warm.final, JobDone) and isinstance(cold.final, JobDone)
    assert warm.final.restored_tokens == warm.final.reused_tokens >= len(doc) - 8
    assert warm.final.prefilled_tokens < len(prompt) - len(doc) + 16
    assert warm.tokens == cold.tokens  # the copied KV is the KV a cold run computes, bit for bit
    assert cold.final.reused_tokens == 0 and cold.final.restored_tokens == 0
    after = counters(copier)
    assert after["slot_copies"] == before["slot_copies"] + 1 and after["copy_failures"] == before["copy_failures"]
    assert_slot_invariant(copier, warm)
    assert_slot_invariant(copier, first)  # the source slot is untouched


def test_job_waits_for_a_slot_still_computing_its_prefix(copier, vocab):
    clear_all(copier)
    doc = vocab.tokenize(DOC * 3)
    q1 = doc + vocab.tokenize(" Question: how many boats came in early?", add_special=False)
    q2 = doc + vocab.tokenize(" Question: what was torn?", add_special=False)
    a = start(copier, q1, slot=0)
    b = start(copier, q2, slot=1)  # arrives while slot 0 is computing the document
    a.wait(), b.wait()
    assert isinstance(a.final, JobDone) and isinstance(b.final, JobDone)
    assert a.final.reused_tokens == 0
    assert b.final.restored_tokens == b.final.reused_tokens >= len(doc) - 8  # the document was computed once
    cold = complete(copier, q2, slot=2, prefix_cache=False)
    assert b.tokens == cold.tokens
    assert_slot_invariant(copier, b)


def test_evicted_conversation_is_restored_from_host_ram(copier, vocab):
    clear_all(copier)
    history = vocab.tokenize(DOC * 2 + " Keeper: the night was long.")
    assert len(history) > SAVE_MIN + COPY_MIN
    fills = [complete(copier, history, slot=i, max_tokens=2) for i in range(3)]  # every slot holds this history
    before = counters(copier)
    buffers = copier.figures()
    overwrites = [
        complete(copier, vocab.tokenize(f"Unrelated prompt number {i}: the price of bread."), slot=i, max_tokens=2)
        for i in range(3)
    ]
    saved = counters(copier)
    assert saved["host_saves"] == before["host_saves"] + 1  # three equal contents, one copy
    taken = copier.figures()  # (the heartbeat's: the save's buffer, new memory or one freed before)
    assert taken.state_buffers_mapped + taken.state_buffers_reused > buffers.state_buffers_mapped + buffers.state_buffers_reused
    # the router is told: the JobDone of the job that overwrote it names the slot and what it held (length, hash)
    (entry,) = [e for o in overwrites for e in o.cache_added]
    fill = fills[entry.slot].final
    assert isinstance(fill, JobDone) and (entry.n_tokens, entry.hash) == (fill.slot_tokens, fill.slot_hash)
    assert entry.nbytes > 0 and not entry.tokens
    prompt = history + vocab.tokenize(" Visitor: and the boat?", add_special=False)
    back = complete(copier, prompt, slot=0)
    cold = complete(copier, prompt, slot=1, prefix_cache=False)
    assert isinstance(back.final, JobDone) and isinstance(cold.final, JobDone)
    assert back.final.restored_tokens == back.final.reused_tokens >= len(history) - 8
    assert back.tokens == cold.tokens
    after = counters(copier)
    assert after["host_restores"] == saved["host_restores"] + 1 and after["copy_failures"] == saved["copy_failures"]
    assert_slot_invariant(copier, back)
    clear_all(copier)  # a reset drops every entry: the next JobDone says so
    told = complete(copier, vocab.tokenize("After the reset."), slot=0, max_tokens=1)
    assert isinstance(told.final, JobDone) and entry.id in told.cache_dropped


def test_a_failed_save_or_restore_fails_no_job_and_the_entry_that_failed_is_dropped(copier, vocab):
    clear_all(copier)
    history = vocab.tokenize(DOC * 2 + " Keeper: the storm passed.")
    llama = copier.llama
    get, put = llama.state_get, llama.state_set

    def failing_get(seq: int) -> None:
        raise MemoryError("no memory for the copy (injected)")

    def evict_all() -> list:
        for i in range(3):
            complete(copier, history, slot=i, max_tokens=2)
        return [complete(copier, vocab.tokenize(f"Other prompt {i}: the price of fish."), slot=i, max_tokens=2) for i in range(3)]

    failures = copier.call(lambda e: e.counters.host_save_failures).result(10)
    llama.state_get = failing_get
    try:
        others = evict_all()
    finally:
        llama.state_get = get
    assert all(isinstance(o.final, JobDone) for o in others)  # the save failed, the jobs did not
    assert copier.call(lambda e: (e.counters.host_save_failures, len(e.host))).result(10) == (failures + 1, 0)

    evict_all()  # this time the history is saved
    assert copier.call(lambda e: len(e.host)).result(10) == 1
    before = counters(copier)
    llama.state_set = lambda seq, data: False  # llama.cpp refuses the state
    try:
        back = complete(copier, history + vocab.tokenize(" Visitor: and the lamp?", add_special=False), slot=0)
    finally:
        llama.state_set = put
    assert isinstance(back.final, JobDone) and back.final.restored_tokens == 0  # served cold
    assert counters(copier)["copy_failures"] == before["copy_failures"] + 1
    assert copier.call(lambda e: len(e.host)).result(10) == 0  # dropped: it would fail again
    assert_slot_invariant(copier, back)


def test_no_copy_without_prefix_cache_or_for_a_small_gain(copier, vocab):
    clear_all(copier)
    doc = vocab.tokenize(DOC * 2)
    complete(copier, doc, slot=0, max_tokens=2)
    off = complete(copier, doc + vocab.tokenize(" More.", add_special=False), slot=1, prefix_cache=False)
    assert isinstance(off.final, JobDone) and off.final.reused_tokens == off.final.restored_tokens == 0
    short = vocab.tokenize("The lighthouse keeper's log, spring.")  # shares less than a slot copy's worth
    small = complete(copier, short, slot=2)
    assert isinstance(small.final, JobDone) and small.final.restored_tokens == 0 and small.final.reused_tokens == 0


# Gemma 3 attends over a sliding window of 512 positions in most layers. A copy must bring that window whole.
LONG = DOC * 9  # about 700 tokens: longer than the window


def test_copy_from_a_slot_holding_more_than_a_window_past_the_shared_prefix(copier, vocab):
    """The source holds a 1-window-plus conversation; the new prompt shares only its first part. A slot-to-slot
    copy carries every layer in full (llama.cpp's state data would carry only the last window), so the cut is
    valid and the answer is what a cold run gives."""
    clear_all(copier)
    failures = counters(copier)["copy_failures"]
    shared = vocab.tokenize(DOC)
    source = shared + vocab.tokenize(LONG, add_special=False)
    first = complete(copier, source, slot=0, max_tokens=2)
    assert len(source) - len(shared) > copier.llama.info.n_swa > 0
    prompt = shared + vocab.tokenize(" Question: what did the keeper wind?", add_special=False)
    warm = complete(copier, prompt, slot=1)
    cold = complete(copier, prompt, slot=2, prefix_cache=False)
    assert isinstance(warm.final, JobDone), warm.final
    assert warm.final.restored_tokens == warm.final.reused_tokens >= len(shared) - 8
    assert warm.tokens == cold.tokens
    assert counters(copier)["copy_failures"] == failures
    assert copier.call(lambda e: e.counters.invariant_violations).result(10) == 0
    assert_slot_invariant(copier, warm)
    assert_slot_invariant(copier, first)


def test_host_ram_entry_longer_than_a_window_is_only_extended(copier, vocab):
    """A state restored from host RAM has only the last window of its sliding-window layers: a prompt that extends
    the whole entry gets it back; one that shares only its beginning is computed instead of cut wrongly."""
    clear_all(copier)
    history = vocab.tokenize(LONG + " Keeper: the night was long.")
    assert len(history) > copier.llama.info.n_swa + SAVE_MIN
    complete(copier, history, slot=0, max_tokens=2)
    complete(copier, vocab.tokenize("Unrelated prompt: the price of bread."), slot=0, max_tokens=2)  # evicts it
    before = counters(copier)
    assert before["host_saves"] >= 1
    part = history[: len(history) // 2] + vocab.tokenize(" Visitor: what changed?", add_special=False)
    cut = complete(copier, part, slot=1)
    assert isinstance(cut.final, JobDone) and cut.final.restored_tokens == 0 and cut.final.reused_tokens == 0
    assert counters(copier)["host_restores"] == before["host_restores"]
    prompt = history + vocab.tokenize(" Visitor: and what became of the boat with the torn sail?", add_special=False)
    back = complete(copier, prompt, slot=2)
    cold = complete(copier, prompt, slot=1, prefix_cache=False)
    assert isinstance(back.final, JobDone) and back.final.restored_tokens == back.final.reused_tokens >= len(history) - 8
    assert back.tokens == cold.tokens
    # what the router's mirror is told: the restored slot cannot be cut before its window, the computed one anywhere
    assert 0 < back.final.slot_min_keep <= len(history) and cold.final.slot_min_keep == 0
    assert counters(copier)["host_restores"] == before["host_restores"] + 1
    assert copier.call(lambda e: e.counters.invariant_violations).result(10) == 0
    assert_slot_invariant(copier, back)


def test_host_ram_entry_longer_than_a_window_is_cut_back_to_its_prompts_end(copier, vocab):
    """A state longer than the window, whose reply the next turn does not share (a template that drops it, a client
    that rewrites it, a trace's next request), gives its prompt back through the checkpoint its slot took at the
    prompt's end (worker/checkpoints.py `for_saves`), exactly; a state within the window is saved without any."""
    clear_all(copier)
    history = vocab.tokenize(LONG + " Keeper: the night was long.")
    assert len(history) > copier.llama.info.n_swa + SAVE_MIN
    first = complete(copier, history, slot=0, max_tokens=24)
    evict = complete(copier, vocab.tokenize("Unrelated prompt: the price of bread."), slot=0, max_tokens=2)
    assert isinstance(first.final, JobDone) and isinstance(evict.final, JobDone)
    [saved] = evict.cache_added
    window = copier.llama.info.n_swa
    assert window < len(history) < 2 * window  # (one more checkpoint, a window in: `on_save`)
    assert saved.min_keep > len(history) and saved.cuts == sorted([window, len(history), saved.n_tokens - TAIL])
    prompt = history + vocab.tokenize(" Visitor: and what became of the boat with the torn sail?", add_special=False)
    back = complete(copier, prompt, slot=1)
    cold = complete(copier, prompt, slot=2, prefix_cache=False)
    assert isinstance(back.final, JobDone) and back.final.restored_tokens == back.final.reused_tokens == len(history)
    assert back.tokens == cold.tokens
    assert copier.call(lambda e: e.counters.invariant_violations).result(10) == 0
    assert_slot_invariant(copier, back)
    short = complete(copier, vocab.tokenize(DOC), slot=0, max_tokens=24)  # (within the window: cut anywhere)
    gone = complete(copier, vocab.tokenize("Unrelated prompt: the price of fish."), slot=0, max_tokens=2)
    assert isinstance(short.final, JobDone) and isinstance(gone.final, JobDone)
    assert [(e.min_keep, e.cuts) for e in gone.cache_added] == [(0, [])]


def saved_after(engine: Engine, vocab, history: list[int], evict_text: str, slot: int = 0):
    """The host-RAM entry saved when `history`, computed on `slot`, is evicted by an unrelated prompt."""
    complete(engine, history, slot=slot, max_tokens=2)
    evict = complete(engine, vocab.tokenize(evict_text), slot=slot, max_tokens=2)
    assert isinstance(evict.final, JobDone)
    [saved] = evict.cache_added
    return saved


def assert_resumes_exactly(engine: Engine, prompt: list[int], slot: int, cold_slot: int, restored: int) -> None:
    """`prompt` on `slot` restores `restored` tokens from host RAM and answers as a cold run on `cold_slot` does."""
    back = complete(engine, prompt, slot=slot)
    cold = complete(engine, prompt, slot=cold_slot, prefix_cache=False)
    assert isinstance(back.final, JobDone) and back.final.restored_tokens == back.final.reused_tokens == restored
    assert back.tokens == cold.tokens
    assert engine.call(lambda e: e.counters.invariant_violations).result(10) == 0
    assert_slot_invariant(engine, back)


def test_host_ram_entry_longer_than_a_window_is_cut_back_to_a_checkpoint_near_its_end(copier, vocab):
    """A prompt that shares all but the last few tokens of a state longer than the window (a rewritten tail, a
    trace's block boundary) resumes from the checkpoint the save took TAIL tokens before the state's end, exactly."""
    clear_all(copier)
    history = vocab.tokenize("Second log. " + LONG)
    saved = saved_after(copier, vocab, history, "Unrelated prompt: the price of rye.")
    tail = saved.n_tokens - TAIL
    assert tail in saved.cuts and tail > len(history) - 8 - TAIL
    prompt = history[:-5] + vocab.tokenize(" Visitor: was the lamp lit early?", add_special=False)
    assert_resumes_exactly(copier, prompt, slot=1, cold_slot=2, restored=tail)


def test_host_ram_entry_longer_than_a_window_is_cut_back_to_a_checkpoint_every_window(copier, vocab):
    """A prompt that shares only the first blocks of a state longer than the window (a conversation branching off an
    earlier turn, far from its end) resumes from the checkpoint the save took a window in, exactly (worker/checkpoints.py
    `on_save`)."""
    clear_all(copier)
    window = copier.llama.info.n_swa
    history = vocab.tokenize("Fourth log. " + LONG)
    saved = saved_after(copier, vocab, history, "Unrelated prompt: the price of malt.")
    assert window in saved.cuts
    prompt = history[: window + 40] + vocab.tokenize(" Visitor: and the boats?", add_special=False)
    assert_resumes_exactly(copier, prompt, slot=1, cold_slot=2, restored=window)


def test_a_prompt_branching_off_a_saved_state_takes_a_checkpoint_there_for_the_next_one_that_does(copier, vocab):
    """Two prompts sharing a first part (a system prompt) with a saved state longer than the window, where it has no
    checkpoint: the first computes that part again and its slot takes a checkpoint where it parted from the state
    (worker/checkpoints.py `positions`, `branch`), saved with it; the second resumes there, exactly."""
    clear_all(copier)
    window = copier.llama.info.n_swa
    history = vocab.tokenize("Fifth log. " + LONG)
    saved = saved_after(copier, vocab, history, "Unrelated prompt: the price of spelt.")
    shared = 100
    assert not any(0 < c <= shared for c in saved.cuts)  # (nothing of it below the branch can be given)
    other = vocab.tokenize(" ".join(reversed(LONG.split())), add_special=False)
    first = complete(copier, history[:shared] + other, slot=1, max_tokens=2)
    assert isinstance(first.final, JobDone) and first.final.reused_tokens == 0 and shared in first.final.slot_cuts
    evict = complete(copier, vocab.tokenize("Unrelated prompt: the price of hops."), slot=1, max_tokens=2)
    assert isinstance(evict.final, JobDone)
    [branched] = evict.cache_added
    assert branched.n_tokens > window and branched.min_keep > shared and shared in branched.cuts
    prompt = history[:shared] + vocab.tokenize(" Visitor: and who kept the other lamp?", add_special=False)
    assert_resumes_exactly(copier, prompt, slot=2, cold_slot=0, restored=shared)


def test_a_restored_state_extended_a_little_is_saved_without_a_tail_it_cannot_give(copier, vocab):
    """A slot holding a restored state has its window layers only from late positions on: cutting it back to TAIL
    tokens before its end, when that is further back than its own window reaches, would take a checkpoint with holes.
    The save then keeps the checkpoints it has, and a cut back from them is still exact."""
    clear_all(copier)
    history = vocab.tokenize("Third log. " + LONG)
    complete(copier, history, slot=0, max_tokens=2)
    complete(copier, vocab.tokenize("Unrelated prompt: the price of oats."), slot=0, max_tokens=2)  # saved, with a tail
    longer = history + vocab.tokenize(" Keeper: calm, and the lamp burned all night.", add_special=False)
    resumed = complete(copier, longer, slot=1, max_tokens=2)
    assert isinstance(resumed.final, JobDone) and resumed.final.restored_tokens >= len(history) - 1
    assert resumed.final.slot_min_keep > resumed.final.slot_tokens - TAIL  # (its window begins within the last TAIL)
    evict = complete(copier, vocab.tokenize("Unrelated prompt: the price of barley."), slot=1, max_tokens=2)
    assert isinstance(evict.final, JobDone)
    [saved] = evict.cache_added
    assert saved.n_tokens - TAIL not in saved.cuts
    prompt = history[:-5] + vocab.tokenize(" Visitor: how calm was it?", add_special=False)
    back = complete(copier, prompt, slot=2)
    cold = complete(copier, prompt, slot=0, prefix_cache=False)
    assert isinstance(back.final, JobDone) and back.final.restored_tokens == back.final.reused_tokens > 0
    assert back.tokens == cold.tokens
    assert_slot_invariant(copier, back)


def test_a_tenants_kv_is_reused_and_copied_only_for_the_same_tenant(copier, vocab):
    """Jobs with another cache_salt never reuse a slot's prefix, copy another slot's or restore a saved state: one
    tenant's time to first token tells nothing of another's prompts. The same tenant reuses as ever."""
    clear_all(copier)
    prompt = vocab.tokenize(DOC * 2 + " Question: who lit the lamp?")
    first = complete(copier, prompt, slot=0, cache_salt="tenant-a")
    other = complete(copier, prompt, slot=1, cache_salt="tenant-b")  # slot 0 holds it: not copied for b
    same_slot = complete(copier, prompt, slot=0, cache_salt="tenant-c")  # slot 0 itself: cleared, not reused
    assert all(isinstance(r.final, JobDone) for r in (first, other, same_slot))
    assert other.final.reused_tokens == 0 and same_slot.final.reused_tokens == 0
    assert other.tokens == first.tokens == same_slot.tokens  # (deterministic: the same answer, computed again)
    # tenant a's history went to host RAM when c took slot 0: a gets it back, b does not
    back_a = complete(copier, prompt, slot=2, cache_salt="tenant-a")
    assert back_a.final.restored_tokens == back_a.final.reused_tokens >= len(prompt) - 8
    assert [e.salt for e in same_slot.cache_added] == ["tenant-a"]  # what the router is told of it
    plain = complete(copier, prompt, slot=2)  # no salt: not tenant a's either
    assert plain.final.reused_tokens == 0


@pytest.fixture(scope="module")
def other_worker() -> Iterator[Engine]:
    """A second worker of the same model and settings, for states copied between workers."""
    eng = Engine(WorkerConfig(slots=3, ctx_per_slot=1024, threads=2, deterministic=True, host_cache_mb=64)).start()
    yield eng
    eng.stop()


def test_a_state_copied_from_another_worker_is_restored_as_its_own(copier, other_worker, vocab):
    """The router copies a state one worker saved in host RAM to another (worker/state_copies.py): read out on the
    saving worker (as its I/O thread does), kept in the other's host-RAM tier with its checkpoints, restored there
    and cut back to the checkpoint near its end exactly as on the worker that saved it; reported to the router."""
    clear_all(copier)
    clear_all(other_worker)
    history = vocab.tokenize("Third log. " + LONG)
    complete(copier, history, slot=0, max_tokens=2)
    evict = complete(copier, vocab.tokenize("Unrelated prompt: the price of oats."), slot=0, max_tokens=2)
    assert isinstance(evict.final, JobDone)
    [saved] = evict.cache_added
    prompt = history[:-5] + vocab.tokenize(" Visitor: was the lamp lit early?", add_special=False)
    tail = saved.n_tokens - TAIL
    restorable = copier.core.prefixes.restorable
    named = StateFetch(id="f", entry=saved.id, tokens=pack_tokens(prompt))
    gone = StateFetch(id="f", entry=10**9, tokens=pack_tokens(prompt))  # (superseded: the one giving most is sent)
    other = StateFetch(id="f", entry=10**9, tokens=pack_tokens(prompt), salt="another tenant")
    entry, gives = state_copies.chosen(copier.host, named, restorable)
    assert entry is not None and entry.id == saved.id and gives == tail
    assert state_copies.chosen(copier.host, gone, restorable) == (entry, tail)
    assert state_copies.chosen(copier.host, other, restorable) == (None, 0)
    stranger = StateFetch(id="f", entry=saved.id, tokens=pack_tokens(prompt), salt="another tenant")
    assert state_copies.chosen(copier.host, stranger, restorable) == (None, 0)  # (named, but not its tenant's)
    blob = state_copies.blob_of(entry)
    assert len(blob.data) + sum(len(c.data) for c in blob.checkpoints) == saved.nbytes and blob.checkpoints
    there = complete(other_worker, prompt, slot=0, state=blob)
    cold = complete(other_worker, prompt, slot=1, prefix_cache=False)
    assert isinstance(there.final, JobDone) and there.final.restored_tokens == there.final.reused_tokens == tail
    assert there.tokens == cold.tokens  # the copied KV is what a cold computation gives there, bit for bit
    (kept,) = there.cache_added  # the router's mirror learns the copy is in this worker's tier now
    assert kept.slot == -1 and kept.n_tokens == saved.n_tokens and kept.hash == saved.hash and kept.cuts == saved.cuts
    assert other_worker.call(lambda e: e.counters.invariant_violations).result(10) == 0
    assert_slot_invariant(other_worker, there)
