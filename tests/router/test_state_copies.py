"""A conversation a full worker saved in host RAM, placed on an idle worker with a copy of that state: the router asks
the saving worker for it, sends the job with it once it comes, or without it when it is gone or late (router/
state_copies.py). The router's core driven with plain calls."""

from __future__ import annotations

import time

import numpy as np
from scheduler_helpers import CLIENT, core, done, hello, jobs, submit

import protocol as p
from protocol import CacheEntry, Job, JobCancel, StateBlob, StateCopy, StateFetch, pack_tokens, token_hash
from router.state_copies import TIMEOUT_S

HISTORY = np.arange(1000, 1400, dtype=np.int32)
STATE = StateBlob(tokens=pack_tokens(HISTORY.tolist()), data=b"kv")


def two_workers_one_saved():
    """w0 and w1 of one slot each, both keeping copies (host RAM); w0 saved HISTORY and runs a job on its slot; the
    conversation's next turn comes. What the core sent for it."""
    s = core()
    hello(s, "w0", slots=1, host_cache_bytes=1 << 30)
    hello(s, "w1", slots=1, host_cache_bytes=1 << 30)
    entry = CacheEntry(id=7, n_tokens=len(HISTORY), hash=token_hash(HISTORY.tolist()), nbytes=40_000)
    entry.tokens = pack_tokens(HISTORY.tolist())
    s.mirror.cache_changed("w0", [entry])
    (running,) = jobs(submit(s, "busy", np.concatenate([HISTORY, [5, 6]]).astype(np.int32)))
    assert s.jobs[running.id].worker == "w0"  # (its own saved state: restored there)
    out = submit(s, "next", np.concatenate([HISTORY, [7, 8, 9]]).astype(np.int32))
    return s, out


def test_the_job_goes_with_the_copy_once_it_comes():
    s, out = two_workers_one_saved()
    (fetch,) = [o for o in out if isinstance(o.msg, StateFetch)]
    assert fetch.to == b"w0" and fetch.msg.entry == 7 and not jobs(out)  # (the job waits for the copy)
    req = s.jobs[fetch.msg.id]
    assert req.worker == "w1" and req.attempt is not None and req.attempt.predicted == len(HISTORY)
    assert p.unpack_tokens(fetch.msg.tokens) == [*HISTORY.tolist(), 7, 8, 9]  # (for a state that superseded it)
    s.worker_message(b"w0", StateCopy(id=fetch.msg.id, state=STATE, gives=len(HISTORY)))
    (job,) = jobs(sent := s.take())
    assert [o.to for o in sent if isinstance(o.msg, Job)] == [b"w1"]
    assert job.state == STATE and job.predicted_reuse == len(HISTORY)
    assert s.metrics.state_copies["copied"] == 1 and s.metrics.state_copy_bytes == 2
    done(s, job, [3], worker="w1")
    assert s.metrics.reuse_mispredictions == 0


def test_a_copy_that_is_gone_or_late_leaves_the_job_to_go_without_it():
    s, out = two_workers_one_saved()
    (fetch,) = [o.msg for o in out if isinstance(o.msg, StateFetch)]
    s.worker_message(b"w0", StateCopy(id=fetch.id))  # (evicted there meanwhile)
    (job,) = jobs(s.take())
    assert job.state is None and job.predicted_reuse == 0 and s.jobs[job.id].attempt.predicted == 0
    done(s, job, [3], worker="w1")
    assert s.metrics.reuse_mispredictions == 0 and s.metrics.state_copies["gone"] == 1

    s, out = two_workers_one_saved()
    (fetch,) = [o.msg for o in out if isinstance(o.msg, StateFetch)]
    s.tick(time.monotonic() + TIMEOUT_S + 0.1)  # (its worker hangs)
    (job,) = jobs(s.take())
    assert job.id == fetch.id and job.state is None and s.metrics.state_copies["late"] == 1
    s.worker_message(b"w0", StateCopy(id=fetch.id, state=STATE, gives=len(HISTORY)))  # (too late: nothing more is sent)
    assert not jobs(s.take())


def test_a_cancel_while_the_copy_is_on_its_way_follows_the_job():
    s, out = two_workers_one_saved()
    (fetch,) = [o.msg for o in out if isinstance(o.msg, StateFetch)]
    s.cancel(CLIENT, "next")
    assert not [o for o in s.take() if isinstance(o.msg, JobCancel)]  # (its job has not gone yet)
    s.worker_message(b"w0", StateCopy(id=fetch.id, state=STATE, gives=len(HISTORY)))
    sent = [o.msg for o in s.take() if o.to == b"w1"]
    assert [type(m) for m in sent] == [Job, JobCancel] and sent[1].id == fetch.id


def test_a_copy_for_a_job_whose_worker_died_is_dropped():
    s, out = two_workers_one_saved()
    (fetch,) = [o.msg for o in out if isinstance(o.msg, StateFetch)]
    s.worker_dead("w1", "test")
    s.take()
    s.worker_message(b"w0", StateCopy(id=fetch.id, state=STATE))
    assert not [o for o in s.take() if isinstance(o.msg, Job) and o.msg.state is not None]
    assert s.metrics.state_copies["dropped"] == 1


def test_a_longer_state_sent_for_one_gone_is_predicted_as_what_it_gives():
    """The mirror learns of a state superseded by a longer one (a save of the same conversation, further on) only with
    the job that did it, at its end: the saving worker sends the one giving most of the prompt, and says how much."""
    s, out = two_workers_one_saved()
    (fetch,) = [o.msg for o in out if isinstance(o.msg, StateFetch)]
    longer = np.concatenate([HISTORY, [7, 8]]).astype(np.int32)
    s.worker_message(b"w0", StateCopy(id=fetch.id, state=StateBlob(tokens=pack_tokens(longer.tolist()), data=b"kv"), gives=402))
    (job,) = jobs(s.take())
    assert job.state is not None and job.predicted_reuse == 402 and s.jobs[job.id].attempt.predicted == 402
    done(s, job, [3], worker="w1")
    assert s.metrics.reuse_mispredictions == 0
