"""Priorities on the real model (worker/batching.py `runnable`): while a job of higher priority runs, the steps leave
the jobs of lower priority out; those keep their slots and KV and go on after it, with the text they give alone; a
paused job's deadline and cancel still end it at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from worker_helpers import Run, complete, decodes, job

from protocol import ErrorCode, JobDelta, JobDone, JobError, Message, unpack_tokens
from worker.core import EngineCore
from worker.engine import Engine

pytestmark = pytest.mark.model

LOW = "Write a long story about a lighthouse keeper and the storm."


def until(what: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_job_of_higher_priority_pauses_the_lower_ones_which_go_on_after_it_as_they_would_alone(engine: Engine):
    eng, vocab = engine, engine.vocab
    prompt = vocab.tokenize(LOW)
    alone = complete(eng, prompt, max_tokens=24, ignore_eos=True, prefix_cache=False)
    paused_before = eng.call(lambda e: e.counters.paused_steps).result(10)
    order: list[tuple[str, str]] = []  # (job, "token" or "end") in the order the compute thread sent them

    def submit(name: str, text: str, **kw) -> tuple[str, Run]:
        run, msg = Run(vocab.tokenize(text)), job(vocab.tokenize(text), prefix_cache=False, **kw)

        def sink(m: Message) -> None:
            if isinstance(m, JobDone | JobError):
                order.append((name, "end"))
            elif unpack_tokens(m.tokens):
                order.append((name, "token"))
            run(m)

        eng.submit(msg, sink)
        return msg.id, run

    with decodes(eng) as seen:
        _, low = submit("low", LOW, priority=-1, max_tokens=24, ignore_eos=True)
        until(lambda: len(low.deltas) >= 3)
        high_id, high = submit("high", "List the planets of the solar system.", priority=1, max_tokens=32, ignore_eos=True)
        until(lambda: len(high.deltas) >= 1)
        # two more jobs of lower priority while it runs, taken in one step (the engine held meanwhile): one's deadline
        # passes while it is paused, the other is cancelled then
        held, gate = threading.Event(), threading.Event()
        eng.call(lambda e: (held.set(), gate.wait(30)))
        assert held.wait(30)
        late_id, late = submit("late", "The capital of France is", priority=0, max_tokens=8, deadline_ms=200)
        cancel_id, cancelled = submit("cancelled", "Once upon a time", priority=-1, max_tokens=8)
        gate.set()

        def settle(e: EngineCore) -> bool:  # (between two steps, on the compute thread)
            jobs = {s.job_id: s.task for s in e.table.busy()}
            if late_id not in jobs or cancel_id not in jobs:
                return False  # (not taken yet: the step after the gate)
            assert high_id in jobs, "the high job ended too soon"
            assert all(t.paused for t in jobs.values() if t.id != high_id)
            e.cancel(cancel_id)
            time.sleep(0.25)  # past the late job's deadline: both end at the next step, the high job still running
            return True

        until(lambda: eng.call(settle).result(30), timeout=20)
        for run in (late, cancelled, high, low):
            run.wait()
    for run, reason in ((late, "deadline_exceeded"), (cancelled, "cancelled"), (high, "length"), (low, "length")):
        assert isinstance(run.final, JobDone) and run.final.finish_reason == reason, run.final
    assert late.streamed_tokens == cancelled.streamed_tokens == []
    assert len(high.streamed_tokens) == 32
    assert eng.call(lambda e: e.counters.paused_steps).result(10) - paused_before >= 3  # (low, late, cancelled: 1+ each)

    # while the high job ran (its first token to its end), nothing else produced a token; the paused ends came then
    first, end = order.index(("high", "token")), order.index(("high", "end"))
    assert {name for name, _ in order[first:end]} <= {"high", "late", "cancelled"}
    assert ("late", "end") in order[first:end] and ("cancelled", "end") in order[first:end]
    assert ("low", "token") in order[:first] and ("low", "token") in order[end:]  # before it and after it
    # every batch from the high job's first to its last holds its rows only (its prompt's too: no decode row, no chunk,
    # no padding of the others), and the low job went on after it
    high_slot, low_slot = high.final.slot, low.final.slot
    mine = [i for i, rows in enumerate(seen) if any(s == high_slot for s, _, _ in rows)]
    assert all({s for s, _, _ in rows} == {high_slot} for rows in seen[mine[0] : mine[-1] + 1])
    assert any(s == low_slot for rows in seen[mine[-1] + 1 :] for s, _, _ in rows)

    # the paused job's text is what it gives alone (greedy)
    assert low.streamed_tokens == alone.streamed_tokens
    assert "".join(d.text for d in low.deltas) == "".join(d.text for d in alone.deltas)


def test_a_job_paused_its_longest_runs_beside_the_higher_one_until_it_ends(engine: Engine, monkeypatch):
    """Priority never starves: a job paused PRIORITY_MAX_PAUSE_S (here: at once) is computed beside the job of higher
    priority from then on, with the text it gives alone."""
    monkeypatch.setattr("worker.core.PRIORITY_MAX_PAUSE_S", 0.0)
    eng, vocab = engine, engine.vocab
    prompt = vocab.tokenize(LOW)
    alone = complete(eng, prompt, max_tokens=24, ignore_eos=True, prefix_cache=False)
    order: list[str] = []

    def submit(name: str, text: str, **kw) -> Run:
        run, msg = Run(vocab.tokenize(text)), job(vocab.tokenize(text), prefix_cache=False, **kw)

        def sink(m: Message) -> None:
            order.append(f"{name}:{'token' if isinstance(m, JobDelta) and unpack_tokens(m.tokens) else 'other'}")
            run(m)

        eng.submit(msg, sink)
        return run

    low = submit("low", LOW, priority=-1, max_tokens=24, ignore_eos=True)
    until(lambda: len(low.deltas) >= 3)
    high = submit("high", "List the planets of the solar system.", priority=1, max_tokens=32, ignore_eos=True)
    for run in (high, low):
        run.wait()
    first, last = order.index("high:token"), len(order) - 1 - order[::-1].index("high:token")
    assert "low:token" in order[first:last]  # (aged: its tokens came while the high job generated)
    assert low.streamed_tokens == alone.streamed_tokens


def test_a_job_preempted_before_its_first_token_is_handed_back_keeping_its_kv_and_after_it_runs_on(engine: Engine):
    """JobCancel.preempt: a job still computing its prompt ends with `preempted`, its slot keeping what it computed (the
    router places it again and reuses that); one whose output began runs on as if not asked."""
    eng, vocab = engine, engine.vocab
    long = vocab.tokenize(" ".join([LOW] * 100))  # (over the step's prefill budget: several steps before a token)
    run, msg = Run(long), job(long, prefix_cache=False, max_tokens=8, ignore_eos=True)
    eng.submit(msg, run)

    def preempt_in_prefill(e: EngineCore) -> bool:  # (between two steps, on the compute thread)
        slot = next((s for s in e.table.busy() if s.job_id == msg.id), None)
        if slot is None or slot.n_tokens == 0:
            return False
        assert not slot.task.generated, "its prompt was computed in one step"
        e.cancel(msg.id, preempt=True)
        return True

    until(lambda: eng.call(preempt_in_prefill).result(30), timeout=60)
    final = run.wait()
    assert isinstance(final, JobError) and final.code == ErrorCode.PREEMPTED, final
    assert final.slot >= 0 and 0 < final.slot_tokens < len(long) and run.deltas == []

    short = vocab.tokenize("List the planets of the solar system.")
    late, msg2 = Run(short), job(short, prefix_cache=False, max_tokens=16, ignore_eos=True)
    eng.submit(msg2, late)
    until(lambda: len(late.deltas) >= 2)
    eng.cancel(msg2.id, preempt=True)  # too late: its output began (in deterministic mode it is not suspended)
    done = late.wait()
    assert isinstance(done, JobDone) and done.finish_reason == "length" and len(late.streamed_tokens) == 16
    eng.reset()  # (the shared engine's next tests expect empty slots, not the half-computed prompt kept above)
