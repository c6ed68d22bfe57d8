"""Routers side by side over one fleet (worker/links.py), as one router's core sees it: another router's job on a
worker's slot makes the slot busy here (SlotTaken) until the worker says what it holds after (SlotUpdate), in either
order; the mirror learns those contents and the saved states the other router's jobs made; a job the worker refused
because another router's job held its slot (slot_busy) is placed again, elsewhere."""

from __future__ import annotations

import numpy as np
from scheduler_helpers import PROMPT, core, done, hello, jobs, submit, to_client

from protocol import CacheEntry, Error, ErrorCode, JobError, SlotTaken, SlotUpdate, pack_tokens, token_hash
from router.requests import ReqState

OTHER = np.arange(500, 560, dtype=np.int32)  # what another router's conversation left in a slot


def test_another_routers_job_makes_the_slot_busy_here_and_its_update_makes_the_mirror_exact() -> None:
    s = core()
    hello(s, slots=2)
    conn = s.workers["w0"]
    s.worker_message(b"w0", SlotTaken(slot=0, epoch=1))
    assert conn.slots[0].busy and conn.load.busy == 1  # the other router's load counts here too
    (job,) = jobs(submit(s, "a"))
    assert job.slot == 1  # not the slot another router's job runs on
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=1, tokens=pack_tokens(OTHER.tolist())))
    assert not conn.slots[0].busy and conn.slots[0].tokens.tolist() == OTHER.tolist()
    done(s, job, [7, 8])
    # that conversation's next turn, through this router: placed where the other router's job left it, reuse predicted
    (nxt,) = jobs(submit(s, "b", np.concatenate([OTHER, [9, 9, 9]]).astype(np.int32)))
    assert nxt.slot == 0 and nxt.predicted_reuse == len(OTHER)
    assert s.metrics.mirror_mismatches == 0


def test_a_claim_and_its_end_may_cross_the_later_claim_wins() -> None:
    s = core()
    hello(s, slots=1)
    slot = s.workers["w0"].slots[0]
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=2, tokens=pack_tokens(OTHER.tolist())))
    s.worker_message(b"w0", SlotTaken(slot=0, epoch=2))  # (sent first, by another thread of the worker)
    assert not slot.busy
    s.worker_message(b"w0", SlotTaken(slot=0, epoch=3))
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=2, tokens=pack_tokens(OTHER[:10].tolist())))  # a stale one
    assert slot.busy
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=3, tokens=pack_tokens(OTHER[:20].tolist())))
    assert not slot.busy and len(slot.tokens) == 20


def test_a_job_refused_for_another_routers_job_on_its_slot_is_placed_again_elsewhere() -> None:
    s = core()
    hello(s, slots=2)
    (first,) = jobs(submit(s, "a"))
    assert first.slot == 0
    s.worker_message(b"w0", JobError(id=first.id, code=ErrorCode.SLOT_BUSY, message="slot 0 runs another's job"))
    out = s.take()
    (again,) = jobs(out)
    (req,) = s.requests.values()
    assert req.state is ReqState.RUNNING and again.slot == 1 and again.id != first.id
    assert s.metrics.slot_conflicts == 1 and not to_client(out, Error)  # the client hears nothing of it
    slot0 = s.workers["w0"].slots[0]
    assert slot0.busy  # until the worker says what the other router's job left
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=4, tokens=pack_tokens(OTHER.tolist())))
    assert not slot0.busy and slot0.tokens.tolist() == OTHER.tolist()


def test_a_saved_state_another_routers_job_made_is_indexed_here_and_a_returning_conversation_restores_it() -> None:
    s = core(min_match=4)
    hello(s, slots=1)
    (job,) = jobs(submit(s, "a"))
    done(s, job, [7])
    held = s.workers["w0"].slots[0].tokens.copy()  # PROMPT: our conversation, in slot 0
    s.worker_message(b"w0", SlotTaken(slot=0, epoch=1))  # another router's job overwrites it; the worker saves it
    entry = CacheEntry(id=5, n_tokens=len(held), hash=token_hash(held.tolist()), nbytes=1000, slot=0)
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=1, tokens=pack_tokens(OTHER.tolist()), cache_added=[entry]))
    assert ("ram", 5) in s.mirror.saved["w0"]
    (back,) = jobs(submit(s, "b", np.concatenate([PROMPT, [3, 3]]).astype(np.int32)))
    assert back.predicted_reuse == len(held)  # restored from host RAM, and predicted so
    assert s.metrics.decisions["restore"] == 1 and s.metrics.mirror_mismatches == 0


def test_an_update_for_a_slot_our_job_was_sent_to_meanwhile_is_what_the_job_starts_from() -> None:
    s = core()
    hello(s, slots=1)
    (job,) = jobs(submit(s, "a"))
    slot = s.workers["w0"].slots[0]
    s.worker_message(b"w0", SlotTaken(slot=0, epoch=1))  # another router's job got there first ...
    s.worker_message(b"w0", SlotUpdate(slot=0, epoch=1, tokens=pack_tokens(OTHER.tolist())))  # ... and ended
    assert slot.busy and slot.before is not None and slot.before.tolist() == OTHER.tolist()
    s.worker_message(b"w0", JobError(id=job.id, code=ErrorCode.CANCELLED, message="x"))  # never touched the slot
    assert not slot.busy and slot.tokens.tolist() == OTHER.tolist()
