"""The router core's failure rules, driven with plain calls: hung and silent workers (found, killed), poison
requests, deadlines of running jobs, a restarted router rebuilding its mirror from what workers hold, workers of
other weights or smaller slots, and a send that fails in the middle of a dispatch."""

from __future__ import annotations

import time

import numpy as np
from scheduler_helpers import PROMPT, core, delta, done, hello, jobs, submit, to_client

from protocol import Error, Heartbeat, JobCancel, Refuse, Result, Sampling, SlotHeld, pack_tokens
from router.requests import ReqState
from router.scheduler import Scheduler


def beat(s: Scheduler, worker: str = "w0", progress: int = 0, incarnation: int = 1) -> None:
    msg = Heartbeat(worker_id=worker, incarnation=incarnation, slots=[], queue=0, progress=progress)
    s.worker_message(worker.encode(), msg)


def tick(s: Scheduler, at: float, *, silent: tuple[str, ...] = ()) -> None:
    """A tick at `at`, every worker but the `silent` ones having just been heard from."""
    for w in s.workers.values():
        if w.id not in silent:
            w.last_seen = at
    s.tick(at)


def test_a_hung_worker_is_killed_its_unstarted_requests_move_and_started_ones_fail() -> None:
    s = core(hung_after_s=5.0)
    hello(s, "w0")
    (_j1,) = jobs(submit(s, "quiet"))
    (j2,) = jobs(submit(s, "loud", tokens=PROMPT[::-1].copy()))
    delta(s, j2, [1])
    t0 = time.monotonic()
    beat(s, progress=7)  # progress moved: alive
    tick(s, t0 + 4)
    assert "w0" in s.workers and not s.take_kills()
    beat(s, progress=7)  # heartbeats still come (the I/O thread is fine), but the engine is stuck
    tick(s, t0 + 6)
    (kill,) = s.take_kills()
    assert (kill.worker, kill.incarnation) == ("w0", 1) and "no engine progress" in kill.reason
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("loud", "worker_lost")
    (quiet,) = s.requests.values()
    assert quiet.state is ReqState.QUEUED and quiet.deaths == 1


def test_an_idle_worker_is_never_hung() -> None:
    s = core(hung_after_s=5.0)
    hello(s, "w0")
    beat(s, progress=3)
    tick(s, time.monotonic() + 50)
    assert "w0" in s.workers and not s.take_kills()


def test_a_silent_worker_is_dead_at_once_and_killed_if_it_stays_silent() -> None:
    s = core(hung_after_s=10.0, heartbeat_timeout_s=3.0)
    hello(s, "w0", pid=4242)
    hello(s, "w1", pid=4343)
    now = time.monotonic()
    tick(s, now + 4, silent=("w0", "w1"))
    assert not s.workers and not s.take_kills()  # dead, not killed yet: they may come back (SIGCONT)
    hello(s, "w1", pid=4343)  # w1 comes back in time (the router had forgotten it: it says hello again)
    tick(s, now + 4 + 11)
    (kill,) = s.take_kills()
    assert (kill.worker, kill.pid) == ("w0", 4242) and "silent" in kill.reason
    assert set(s.workers) == {"w1"}


def test_a_poison_request_fails_after_two_worker_deaths_and_innocents_finish() -> None:
    s = core(max_worker_deaths=2)
    hello(s, "w0", slots=2)
    jobs(submit(s, "poison"))
    jobs(submit(s, "innocent", tokens=PROMPT[::-1].copy()))
    s.worker_dead("w0", "process exited with status -9")
    assert {r.rid: r.deaths for r in s.queue} == {"poison": 1, "innocent": 1}
    # both were on the worker that died: they go back one at a time, never two such on one worker
    (first,) = jobs(hello(s, "w0", incarnation=2))
    assert first.id.startswith("innocent") and [r.rid for r in s.queue] == ["poison"]
    (res,) = to_client(out := done(s, first, [1]), Result)
    (second,) = jobs(out)
    assert res.id == "innocent" and second.id.startswith("poison")
    s.worker_dead("w0", "process exited with status -9")
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("poison", "worker_lost") and "2 workers died" in err.message
    assert not s.requests and not s.queue


def test_a_running_request_past_its_deadline_is_answered_and_its_job_cancelled() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s, "late", deadline_ms=50))
    s.tick(time.monotonic() + 0.5)  # the worker's own deadline check gets a second first
    assert not to_client(s.take(), Error)
    s.tick(time.monotonic() + 2)
    out = s.take()
    (err,) = to_client(out, Error)
    assert err.code == "deadline_exceeded" and "running" in err.message
    assert [o.msg.id for o in out if isinstance(o.msg, JobCancel)] == [job.id]
    (req,) = s.requests.values()
    assert req.state is ReqState.CANCELLING  # its slot is known again only once the job ends
    assert not to_client(done(s, job, [5], finish="cancelled"), Result) and not s.requests
    assert s.workers["w0"].load.busy == 0 and s.metrics.requests["deadline_exceeded"] == 1


def test_a_worker_that_reports_what_it_holds_keeps_its_conversations_cached() -> None:
    s = core()
    history = [*PROMPT.tolist(), 7]
    held = [SlotHeld(slot=0, tokens=b""), SlotHeld(slot=1, tokens=pack_tokens(history), n_exact=len(PROMPT))]
    hello(s, "w0", held=held)  # a new router: the worker outlived the old one
    nxt = np.asarray([*history, 9, 9], dtype=np.int32)
    (job,) = jobs(submit(s, "next-turn", tokens=nxt))
    assert job.slot == 1 and job.predicted_reuse == len(history) and job.prefix_cache


def test_a_worker_with_other_weights_is_refused() -> None:
    s = core()
    s.weights = "aaaa"
    out = hello(s, "w0", weights_fingerprint="bbbb")
    assert isinstance(out[0].msg, Refuse) and out[0].msg.code == "model_mismatch" and "weights" in out[0].msg.reason
    assert not s.workers
    hello(s, "w1", weights_fingerprint="aaaa")
    hello(s, "w2")  # a worker that sends none is not compared
    assert set(s.workers) == {"w1", "w2"}


def test_requests_go_only_to_workers_whose_slots_hold_them() -> None:
    s = core(no_workers_grace_s=5.0)
    hello(s, "small", ctx_per_slot=64)
    hello(s, "big", ctx_per_slot=4096)
    long = np.arange(100, 400, dtype=np.int32)
    for i in range(3):  # the big worker's two slots fill; the third waits for them, not for the small worker
        submit(s, f"long{i}", tokens=long + i, sampling=Sampling(max_tokens=8))
    assert [s.requests[k].worker for k in sorted(s.requests)] == ["big", "big", None]
    (short,) = jobs(submit(s, "short", tokens=PROMPT[:10].copy(), sampling=Sampling(max_tokens=8)))
    assert s.jobs[short.id].worker == "small"
    # the big worker leaves: the long one waits for a worker that can hold it, then gets context_overflow
    s.worker_dead("big", "gone")
    s.take()
    now = time.monotonic()
    tick(s, now)
    assert not [e for e in to_client(s.take(), Error) if e.code == "context_overflow"]
    tick(s, now + 6)
    errors = [e for e in to_client(s.take(), Error) if e.code == "context_overflow"]
    assert {e.id for e in errors} == {"long0", "long1", "long2"} and "64 tokens" in errors[0].message


def test_a_send_that_fails_inside_a_dispatch_moves_the_request_once_and_leaks_no_slot() -> None:
    s = core()
    hello(s, "w0", slots=2)
    out = submit(s, "a")
    out += submit(s, "b", tokens=PROMPT[::-1].copy())
    assert len(jobs(out)) == 2
    hello(s, "w1", slots=2)
    s.take()
    # the shell's first send to w0 fails (EHOSTUNREACH): w0 is dead; the rest of the batch is still sent after
    s.worker_dead("w0", "unreachable")
    s.worker_dead("w0", "unreachable")  # the second failing send of the same batch changes nothing
    (moved,) = jobs(s.take())  # one at a time: both were on the worker that died
    assert moved.id.startswith("b") and [r.rid for r in s.queue] == ["a"]
    assert s.workers["w1"].load.busy == 1 and sum(sl.busy for sl in s.mirror.slots()) == 1
    (then,) = jobs(done(s, moved, [1], worker="w1"))
    assert then.id.startswith("a") and s.workers["w1"].load.busy == 1
    done(s, then, [1], worker="w1")
    assert not s.requests and s.workers["w1"].load.busy == 0 and not any(sl.busy for sl in s.mirror.slots())
