"""The router core's parts directly, no sockets and no model: the worker table (router/workers.py), the queue's
placements (router/dispatch_queue.py) and a submit's admission checks (router/admission.py)."""

from __future__ import annotations

import numpy as np
from scheduler_helpers import core, hello, jobs, submit

from protocol import ErrorCode, Heartbeat, Hello, Refusal, Sampling, SlotState
from router import admission
from router.config import RouterConfig
from router.metrics import Metrics
from router.mirror import Mirror
from router.requests import Req, WorkerState
from router.workers import DEFAULT_QUEUE, WorkerTable


def table(**cfg: float) -> WorkerTable:
    return WorkerTable(RouterConfig(**cfg), Mirror(), Metrics())  # type: ignore[arg-type]


def join(t: WorkerTable, worker: str = "w0", slots: int = 2, incarnation: int = 1, ctx: int = 4096) -> None:
    msg = Hello(
        worker_id=worker, incarnation=incarnation, slots=slots, model_fingerprint="fp", device="cpu", ctx_per_slot=ctx, pid=42
    )
    assert t.repeated(msg) is None
    t.join(msg)


def test_a_worker_joins_reports_and_leaves_with_its_slots() -> None:
    t = table()
    assert t.none_for(0.0) and t.slot_context() is None
    join(t, slots=3)
    conn = t.get("w0")
    assert conn is not None and len(t.mirror.slots()) == 3 and t.slot_context() == 4096 and not t.none_for(0.0)
    again = Hello(worker_id="w0", incarnation=1, slots=3, model_fingerprint="fp", device="cpu", ctx_per_slot=4096)
    assert t.repeated(again) is conn  # the same incarnation again: the router's accept crossed it
    idle = [SlotState(slot=0, busy=False, n_tokens=0), SlotState(slot=1, busy=False, n_tokens=7)]
    t.heartbeat(conn, Heartbeat(worker_id="w0", incarnation=1, slots=idle, queue=2, draining=True, progress=5))
    assert conn.state is WorkerState.DRAINING and conn.queue == 2 and conn.progress == 5 and not t.ready()
    assert t.metrics.mirror_mismatches == 1  # slot 1 says it holds 7 tokens; the mirror knows it empty
    assert t.remove("w0", "test") is conn and not t.mirror.slots() and t.metrics.dead_workers == 1
    assert t.none_for(0.0) and t.remove("w0", "again") is None


def test_silent_and_hung_workers_are_declared_dead_and_killed() -> None:
    t = table(heartbeat_timeout_s=3.0, hung_after_s=10.0)
    join(t, "quiet")
    join(t, "stuck")
    quiet, stuck = t.get("quiet"), t.get("stuck")
    assert quiet is not None and stuck is not None
    now = quiet.last_seen
    stuck.jobs["j"] = Req(b"c", [], "r", Sampling(), False, None, 1)
    quiet.last_seen, stuck.last_seen, stuck.progress_at = now - 5, now, now - 11
    dead = dict(t.overdue(now))
    assert "no heartbeat for 5.0 s" in dead["quiet"] and dead["stuck"].startswith("hung: 1 jobs")
    assert [(k.worker, k.pid) for k in t.take_kills()] == [("stuck", 42)]  # the silent one may still come back
    for worker, reason in dead.items():
        t.remove(worker, reason)
    assert t.overdue(now + 5) == [] and t.take_kills() == []
    assert t.overdue(now + 11) == [] and [k.worker for k in t.take_kills()] == ["quiet"]  # silent, and never came back


def test_no_worker_can_come_once_every_expected_one_failed_and_the_queue_bound_grows_with_slots() -> None:
    t = table()
    t.expected |= {"w0", "w1"}
    t.failed["w0"] = "crashed at start"
    assert t.none_can_come() is None  # w1 may still come
    t.failed["w1"] = "no GPU"
    assert t.none_can_come() == "worker w0: crashed at start; worker w1: no GPU"
    assert t.queue_limit() == DEFAULT_QUEUE
    join(t, slots=100)
    assert t.none_can_come() is None and t.queue_limit() == 400
    assert table(queue_size=3).queue_limit() == 3


def test_the_queue_places_requests_in_order_and_round_robin_pins_each_to_the_next_worker() -> None:
    s = core(policy="round-robin")
    hello(s, "w0", slots=1)
    hello(s, "w1", slots=1)
    sent = [jobs(submit(s, rid, np.arange(i * 50, i * 50 + 40, dtype=np.int32))) for i, rid in enumerate("abc")]
    assert [j[0].slot for j in sent[:2]] == [0, 0] and sent[2] == []
    assert [r.pinned for r in s.requests.values()] == ["w0", "w1", "w0"] and [r.rid for r in s.queue] == ["c"]
    assert list(s.queue.placements()) == []  # every slot busy


def test_another_choice_goes_beside_its_first_on_the_same_worker() -> None:
    s = core()
    hello(s, "w0", slots=2)
    hello(s, "w1", slots=2)
    sent = jobs(submit(s, "a", n=2))  # (w1 is idle: without the rule the second choice would go there)
    workers = {r.worker for r in s.requests.values()}
    assert len(sent) == 2 and len(workers) == 1 and {j.slot for j in sent} == {0, 1}


def test_a_submit_is_refused_for_draining_a_repeated_id_or_a_full_queue_in_that_order() -> None:
    assert admission.at_submit(True, "x", 10**6, 1, 4) == Refusal(ErrorCode.DRAINING, "the router is shutting down")
    repeated = admission.at_submit(False, "x", 10**6, 1, 4)
    assert repeated is not None and repeated.code == ErrorCode.BAD_REQUEST and "'x' is already in flight" in repeated.message
    full = admission.at_submit(False, None, 4, 1, 4)
    assert full == Refusal(ErrorCode.QUEUE_FULL, "4 requests are already waiting", retry_after_ms=1000)
    assert admission.at_submit(False, None, 0, 8, 4) is None  # n choices over the bound still go in alone


def test_a_prepared_request_is_refused_when_empty_unfit_or_without_workers() -> None:
    t = table(no_workers_grace_s=0.0)
    req = Req(b"c", [], "r", Sampling(max_tokens=100), False, None, 1, np.zeros(0, dtype=np.int32))
    assert admission.when_prepared(req, t, 0, 0.0) == Refusal(ErrorCode.BAD_REQUEST, "the prompt has no tokens")
    req.tokens = np.arange(5000, dtype=np.int32)
    assert admission.when_prepared(req, t, 0, 0.0) == Refusal(ErrorCode.NO_WORKERS, "no worker is connected")
    join(t)
    refusal = admission.when_prepared(req, t, 0, 0.0)
    assert refusal is not None and refusal.code == ErrorCode.CONTEXT_OVERFLOW
    assert refusal.message == "prompt of 5000 tokens + max_tokens 100 does not fit a slot of 4096 tokens"
    assert admission.capped(Sampling(max_tokens=None), 50).max_tokens == 50
    assert admission.capped(Sampling(max_tokens=10), 50).max_tokens == 10
    assert admission.capped(Sampling(max_tokens=None), 0).max_tokens is None
