"""The router sees the workers' saved states (host RAM): the mirror indexes what they report, selection sends a
conversation whose slot was overwritten back to the worker that saved it, and predicts the restore exactly."""

from __future__ import annotations

import time

import numpy as np
from test_select import hold, loads, seq

from common.slots import COPY_RATIO
from protocol import CacheEntry, pack_tokens, token_hash
from router.mirror import Mirror, Saved, Slot
from router.select import Dispatch, Params, Wait, expected_reuse, select


def overwrite(m: Mirror, worker: str, slot: int, new: np.ndarray, entry_id: int, nbytes: int = 1000) -> None:
    """A job overwrites the slot; its JobDone reports the slot's previous contents saved as entry `entry_id`."""
    s = m.workers[worker][slot]
    before = s.tokens
    m.assign(s, f"j{entry_id}", new)
    added = CacheEntry(id=entry_id, n_tokens=len(before), hash=token_hash(before), nbytes=nbytes, slot=slot)
    assert m.cache_changed(worker, [added], []) == []
    assert m.finish(s, f"j{entry_id}", new, new[:0], len(new), token_hash(new)) is None


def pick(m: Mirror, prompt: np.ndarray, params: Params | None = None):
    return select(m.index.match(prompt), loads_with_saved(m), params or Params(), time.monotonic(), 0, 0.0)


def loads_with_saved(m: Mirror):
    out = loads(m)
    for w in out:
        w.saved = m.saved[w.worker]
    return out


def test_an_entry_named_by_its_slot_takes_the_tokens_the_slot_held_and_is_indexed():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    history = seq(300)
    hold(m, s, history)
    overwrite(m, "w0", 0, seq(50), entry_id=7)
    (saved,) = m.saved["w0"].values()
    assert isinstance(saved, Saved) and saved.key == ("ram", 7) and saved.tokens.tolist() == history.tolist()
    assert m.index.match(np.concatenate([history, seq(5)])).lcp(saved) == 300
    m.cache_changed("w0", [], [7])
    assert not m.saved["w0"] and m.index.match(history).best == 0  # dropped: out of the index


def test_an_entry_whose_hash_disagrees_is_a_counted_mismatch_and_not_indexed():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    hold(m, s, seq(100))
    m.assign(s, "j", seq(20))
    wrong = CacheEntry(id=1, n_tokens=100, hash=token_hash(seq(100)), nbytes=10, slot=0)
    (problem,) = m.cache_changed("w0", [wrong], [])
    assert "differs from the mirror" in problem and m.mismatches == 1 and not m.saved["w0"]


def test_an_entry_of_a_slot_whose_contents_the_mirror_does_not_know_is_ignored():
    m = Mirror()
    (s,) = m.add_worker("w0", 1, contents_known=False)  # dirty: the mirror does not know what it held
    m.assign(s, "j", seq(20))
    entry = CacheEntry(id=1, n_tokens=100, hash="x", nbytes=10, slot=0)
    assert m.cache_changed("w0", [entry], []) == [] and not m.saved["w0"] and m.mismatches == 0


def test_entries_with_tokens_from_a_hello_are_indexed_and_go_with_their_worker():
    m = Mirror()
    tokens = seq(200)
    entry = CacheEntry(id=3, n_tokens=200, hash=token_hash(tokens), nbytes=10, tokens=pack_tokens(tokens))
    m.add_worker("w0", 1, cached=[entry])
    assert m.index.match(tokens).best == 200
    m.cache_changed("w0", [entry], [])  # reported again (a JobDone after the hello): known, not doubled
    assert len(m.saved["w0"]) == 1 and len(m.index) == 1
    m.remove_worker("w0")
    assert len(m.index) == 0 and "w0" not in m.saved


def test_a_returning_conversation_goes_to_the_worker_that_saved_it_and_the_restore_is_predicted():
    m = Mirror()
    a = m.add_worker("w0", 1)
    b = m.add_worker("w1", 1)
    history = seq(600)
    hold(m, a[0], history, age_s=10)
    overwrite(m, "w0", 0, seq(400), entry_id=1)  # another conversation took w0's slot; w0 saved the history
    hold(m, b[0], seq(100), age_s=3600)  # w1's slot: stale, cheaper to overwrite than w0's fresh one
    prompt = np.concatenate([history, seq(20)])
    d = pick(m, prompt)
    assert isinstance(d, Dispatch) and d.slot is a[0] and d.restore and d.reuse == 600
    # without the saved state in view the stale slot elsewhere would have been the choice
    m.cache_changed("w0", [], [1])
    d = pick(m, prompt)
    assert isinstance(d, Dispatch) and d.slot is b[0] and not d.restore and d.reuse == 0


def saved_on_w0(nbytes: int = 1000) -> tuple[Mirror, Slot, Slot, np.ndarray]:
    """Two workers of one slot each; w0 saved a 300-token history (its slot now holds another prompt)."""
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    (b,) = m.add_worker("w1", 1)
    history = seq(300)
    hold(m, a, history)
    overwrite(m, "w0", 0, seq(100), entry_id=1, nbytes=nbytes)
    return m, a, b, history


def test_a_conversation_saved_on_a_full_worker_waits_for_it_a_while_then_goes_elsewhere():
    m, a, b, history = saved_on_w0()
    m.assign(a, "busy", seq(100))  # and is busy: w0 has no idle slot
    prompt = np.concatenate([history, seq(10)])
    out = loads_with_saved(m)
    out[0].busy = 1
    params = Params(busy_wait_ms=500)
    wait = select(m.index.match(prompt), out, params, time.monotonic(), 0, 0.0)
    assert isinstance(wait, Wait) and wait.saved and wait.slot.worker == "w0" and wait.reuse == 300
    late = select(m.index.match(prompt), out, params, time.monotonic(), 0, 600.0)  # waited long enough
    assert isinstance(late, Dispatch) and late.slot is b and late.reuse == 0


def test_restoring_costs_its_bytes_at_the_workers_speed():
    m, _, b, history = saved_on_w0(nbytes=10**7)
    hold(m, b, seq(100), age_s=3600)
    prompt = np.concatenate([history, seq(10)])
    out = loads_with_saved(m)
    cheap = select(m.index.match(prompt), out, Params(), time.monotonic(), 0, 0.0)
    assert isinstance(cheap, Dispatch) and cheap.restore
    out[0].restore_cost = 1e-4  # a worker that restores slowly: 1,000 tokens' worth for this state (10 by default)
    dear = select(m.index.match(prompt), out, Params(), time.monotonic(), 0, 0.0)
    assert isinstance(dear, Dispatch) and dear.slot is b and not dear.restore


def test_other_policies_still_predict_the_restore_the_worker_will_do():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(300)
    hold(m, a, history)
    overwrite(m, "w0", 0, seq(100), entry_id=1)
    prompt = np.concatenate([history, seq(10)])
    d = pick(m, prompt, Params(policy="round-robin"))
    assert isinstance(d, Dispatch) and d.restore and d.reuse == 300
    # a gain under 1/COPY_RATIO of the cells restored is not worth it: the worker keeps what the slot gives, and so
    # does the prediction
    short = np.concatenate([history[: len(history) // COPY_RATIO - 1], seq(10)])
    assert expected_reuse(m.index.match(short), a, Params(), m.saved["w0"]) == (0, False)


def test_a_saved_state_cut_before_its_sliding_window_gives_nothing():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(900)
    hold(m, a, history)
    new = seq(100)
    m.assign(a, "j", new)
    entry = CacheEntry(id=1, n_tokens=900, hash=token_hash(history), nbytes=10, min_keep=700, slot=0)
    m.cache_changed("w0", [entry], [])
    assert m.finish(a, "j", new, new[:0], len(new), token_hash(new)) is None
    far = np.concatenate([history[:800], seq(50)])
    near = np.concatenate([history[:600], seq(50)])
    assert expected_reuse(m.index.match(far), a, Params(), m.saved["w0"]) == (800, True)
    assert expected_reuse(m.index.match(near), a, Params(), m.saved["w0"]) == (0, False)


def test_a_slot_holding_a_restored_state_predicts_nothing_for_a_prompt_that_would_cut_it_before_its_window():
    # The worker reports the slot's min_keep after every job (it restored a state whose sliding-window layers hold
    # only their last window); the prediction follows the worker's rule, so such a job is not a misprediction.
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(900)
    m.assign(a, "j", history)
    assert m.finish(a, "j", history, history[:0], 900, token_hash(history), min_keep=700) is None
    assert a.min_keep == 700
    far = np.concatenate([history[:800], seq(50)])
    near = np.concatenate([history[:600], seq(50)])
    assert expected_reuse(m.index.match(far), a, Params(), {}) == (800, False)
    assert expected_reuse(m.index.match(near), a, Params(), {}) == (0, False)
    d = pick(m, near)
    assert isinstance(d, Dispatch) and d.slot is a and d.reuse == 0 and not d.affinity
    # a job that clears the slot leaves nothing to keep; a job that fails untouched leaves it as it was
    m.assign(a, "k", near)
    assert m.fail(a, "k", near, near[:0], False, 0, "") is None and a.min_keep == 700
    m.assign(a, "k2", near)
    assert m.finish(a, "k2", near, near[:0], len(near), token_hash(near)) is None and a.min_keep == 0
