"""The mirror follows the worker's reports, counts and repairs a mismatch, and keeps the index in step."""

from __future__ import annotations

import numpy as np

from common.slots import common_prefix
from protocol import token_hash
from router.metrics import mispredicted
from router.mirror import EMPTY, Mirror
from router.select import Params, predicted_reuse


def toks(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def test_token_hash_and_common_prefix_agree_on_lists_and_arrays():
    seq = [1, 2, 300_000, 7, 0]
    assert token_hash(np.array(seq, dtype=np.int32)) == token_hash(seq)
    other = [1, 2, 300_000, 8]
    assert common_prefix(seq, other) == common_prefix(np.array(seq, dtype=np.int32), np.array(other, dtype=np.int32)) == 3


def test_finish_records_prompt_plus_generated_minus_last():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    prompt, gen = toks(1, 2, 3), toks(4, 5)
    m.assign(s, "j1", prompt)
    assert s.busy and m.index.match(prompt).lcp(s) == 3  # routes on the prompt while running
    kept = [1, 2, 3, 4]
    assert m.finish(s, "j1", prompt, gen, 4, token_hash(kept)) is None
    assert not s.busy and s.tokens.tolist() == kept
    assert m.index.match(toks(1, 2, 3, 4, 9)).lcp(s) == 4
    assert m.mismatches == 0


def test_mismatching_report_is_counted_and_repaired():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    prompt = toks(1, 2, 3)
    m.assign(s, "j1", prompt)
    mm = m.finish(s, "j1", prompt, toks(4), 4, token_hash([9, 9, 9, 9]))  # worker holds something else
    assert mm is not None and mm.error_id and mm.reported_hash == token_hash([9, 9, 9, 9])
    assert m.mismatches == 1
    # repaired: the slot is empty in the mirror and out of the index, and dirty, so the next job clears it
    assert s.dirty and len(s.tokens) == 0 and s not in m.index
    assert predicted_reuse(3, 4, s, Params()) == 0
    m.assign(s, "j2", prompt)
    assert not s.dirty
    assert m.finish(s, "j2", prompt, toks(8, 8), 4, token_hash([1, 2, 3, 8])) is None
    assert s.tokens.tolist() == [1, 2, 3, 8] and m.mismatches == 1


def test_report_longer_than_what_was_sent_is_a_mismatch():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    m.assign(s, "j1", toks(1, 2))
    assert m.finish(s, "j1", toks(1, 2), EMPTY, 5, token_hash([1, 2])) is not None
    assert s.dirty


def test_untouched_error_restores_previous_contents():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    m.assign(s, "j1", toks(1, 2, 3))
    m.finish(s, "j1", toks(1, 2, 3), EMPTY, 3, token_hash([1, 2, 3]))
    m.assign(s, "j2", toks(5, 6))
    assert m.fail(s, "j2", toks(5, 6), EMPTY, False, 0, "") is None
    assert s.tokens.tolist() == [1, 2, 3] and m.index.match(toks(1, 2)).lcp(s) == 2


def test_touched_error_keeps_what_the_worker_reports():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    m.assign(s, "j1", toks(1, 2, 3))
    assert m.fail(s, "j1", toks(1, 2, 3), toks(4), True, 0, token_hash([])) is None
    assert len(s.tokens) == 0 and s not in m.index and not s.dirty


def test_heartbeat_length_disagreement_marks_slot_dirty():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    m.assign(s, "j1", toks(1, 2, 3))
    assert m.check_idle(s, 0)  # busy: the heartbeat may predate the job
    m.finish(s, "j1", toks(1, 2, 3), EMPTY, 3, token_hash([1, 2, 3]))
    assert m.check_idle(s, 3)
    assert not m.check_idle(s, 7)
    assert s.dirty and m.mismatches == 1 and s not in m.index


def test_remove_worker_purges_its_slots_from_the_index():
    m = Mirror()
    slots = m.add_worker("w0", 2) + m.add_worker("w1", 1)
    for i, s in enumerate(slots):
        m.assign(s, f"j{i}", toks(1, 2, 3, i))
    m.remove_worker("w0")
    assert set(m.index.match(toks(1, 2, 3)).all()) == {slots[2]}
    new = m.add_worker("w1", 1, contents_known=False)  # a re-accepted worker whose KV we do not know
    assert new[0].dirty and len(m.index) == 0


def test_deterministic_worker_reuse_covers_generated_tokens_and_leaves_a_chunk():
    m = Mirror()
    (s,) = m.add_worker("w0", 1, exact=True)
    prompt = toks(*range(1, 41))
    m.assign(s, "j1", prompt)
    gen = toks(90, 91, 92)
    assert m.finish(s, "j1", prompt, gen, 42, token_hash([*range(1, 41), 90, 91]), n_exact=42) is None
    assert s.n_exact == 42  # the worker's word: generated tokens are computed in padded batches, as a prompt pass
    nxt = toks(*range(1, 41), 90, 91, *([7] * 10))
    assert predicted_reuse(42, len(nxt), s, Params()) == 42
    # at least 8 prompt tokens are always computed
    assert predicted_reuse(42, 44, s, Params()) == 36
    # a prompt under 8 tokens is computed in a small ubatch: nothing of it or its reply is reusable
    m.assign(s, "j2", toks(1, 2, 3))
    assert m.finish(s, "j2", toks(1, 2, 3), toks(4, 5), 4, token_hash([1, 2, 3, 4])) is None
    assert s.n_exact == 0


def test_a_seeded_job_on_a_default_worker_is_predicted_to_reuse_only_what_seeded_prompts_computed():
    m = Mirror()
    (s,) = m.add_worker("w0", 1)
    prompt = toks(*range(1, 101))
    m.assign(s, "j1", prompt)
    # a seeded job: its prompt but the last token computed in padded chunks of its own (worker/core.py)
    assert m.finish(s, "j1", prompt, toks(7), 101, token_hash([*range(1, 101), 7]), n_exact=99) is None
    assert s.n_exact == 99
    longer = toks(*range(1, 101), 7, 8, 9)
    seeded = Params(seeded=True)
    assert predicted_reuse(101, len(longer), s, Params()) == 101  # an unseeded job reuses every token held
    assert predicted_reuse(101, len(longer), s, seeded) == 99  # a seeded one not the reply's nor the last prompt token
    m.assign(s, "j2", longer)
    assert m.finish(s, "j2", longer, toks(), 103, token_hash(longer[:103].tolist()), n_exact=99) is None
    assert predicted_reuse(103, 104, s, seeded) == 99 and predicted_reuse(103, 104, s, Params()) == 103
    m.assign(s, "j3", toks(1, 2))  # the worker said nothing of exact KV (an unseeded job after a cut): none
    assert m.finish(s, "j3", toks(1, 2), toks(), 2, token_hash([1, 2])) is None
    assert predicted_reuse(2, 3, s, seeded) == 0


def test_worker_copies_count_as_predicted_only_when_reported_and_never_below_prediction():
    assert not mispredicted(40, 40, 0)
    assert mispredicted(40, 41, 0)  # more reuse with nothing restored: the mirror was wrong
    assert not mispredicted(0, 900, 900)  # the worker copied a prefix from another slot or its host RAM
    assert mispredicted(40, 30, 30)  # a copy must never give less than the slot's own prefix
