"""Agent sessions (issue 65) without the model: priority in the queue, conversations keyed by session and prompt head,
slots awaited after tool calls (selection's last resort, their time-to-live learned), and what status and the
metrics show of them."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from protocol import Delta, Error, ErrorCode, JobCancel, JobDelta, JobError, Result, Sampling, pack_tokens, unpack_tokens
from router import exposition
from router.config import RouterConfig
from router.mirror import CONVERSATION_HEAD, TTL_CAP_S, Mirror, Sessions, conversation_of, token_hash
from router.queue_order import in_order
from router.requests import Req
from router.select import AWAITED_COST, Dispatch, Params, WorkerLoad, select
from tests.router.scheduler_helpers import CLIENT, core, delta, done, hello, jobs, submit, to_client
from tests.router.test_queue_order import HISTORY, setup
from tests.router.test_select import hold, seq

# ---- priority -------------------------------------------------------------------------------------------------


def req(rid: str, tokens: np.ndarray, arrived: float, priority: int = 0) -> Req:
    r = Req(b"c", [], rid, Sampling(), False, None, tokens=tokens)
    r.arrived, r.priority = arrived, priority
    return r


@pytest.mark.parametrize("order", ["fifo", "shortest"])
def test_a_higher_priority_takes_a_freed_slot_first_keeping_the_order_within_a_priority(order: str) -> None:
    mirror, workers = setup()
    cfg = RouterConfig(queue_order=order)
    cold = np.arange(5000, 5300, dtype=np.int32)
    turn = np.concatenate([HISTORY, np.arange(7, 17, dtype=np.int32)])  # its history is held: `shortest` favours it
    queue = [
        req("bg", turn, 100.0, priority=-1),
        req("n1", cold, 100.5),
        req("i1", cold, 101.0, priority=1),
        req("n2", turn, 101.5),
        req("i2", turn, 102.0, priority=1),
    ]
    got = [r.rid for r in in_order(queue, mirror, workers, cfg, now=102.5)]
    within = {"fifo": (["i1", "i2"], ["n1", "n2"]), "shortest": (["i2", "i1"], ["n2", "n1"])}[order]
    assert got == [*within[0], *within[1], "bg"]
    # all of one priority: exactly the order without priorities
    for r in queue:
        r.priority = -1
    expected = {"fifo": ["bg", "n1", "i1", "n2", "i2"], "shortest": ["bg", "n2", "i2", "n1", "i1"]}[order]
    assert [r.rid for r in in_order(queue, mirror, workers, cfg, now=102.5)] == expected


def test_a_queued_interactive_request_goes_before_an_older_background_one_and_its_job_says_so() -> None:
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (first,) = jobs(submit(s, "first"))
    assert first.priority == 0
    assert not jobs(submit(s, "bg", np.arange(500, 540, dtype=np.int32), priority=-1))
    assert not jobs(submit(s, "fg", np.arange(600, 640, dtype=np.int32), priority=1))
    (nxt,) = jobs(done(s, first, [1, 2]))
    assert nxt.id.startswith("fg.") and nxt.priority == 1
    assert s.metrics.priorities == {0: 1, -1: 1, 1: 1}


# ---- conversations ----------------------------------------------------------------------------------------------


def test_a_conversation_is_its_session_and_its_prompt_head() -> None:
    system, sub_system = seq(CONVERSATION_HEAD), seq(CONVERSATION_HEAD)
    turn1 = np.concatenate([system, seq(50)])
    turn2 = np.concatenate([turn1, seq(80)])
    main = conversation_of("S", turn1)
    assert main is not None and main == conversation_of("S", turn2)  # its next turn: the same conversation
    assert conversation_of(None, turn1) is None  # no session: no conversation
    assert conversation_of("T", turn1) != main  # another session
    sub = conversation_of("S", np.concatenate([sub_system, seq(50)]))  # same session, another system prompt
    assert sub is not None and sub != main and sub[0] == "S"
    sessions = Sessions(60.0)
    assert sessions.conv(main).parent is None  # a session's first conversation
    assert sessions.conv(sub).parent == "S"  # a sub-agent of that session
    other_sub = conversation_of("S", seq(60))
    assert other_sub is not None and sessions.conv(other_sub, "P").parent == "P"  # unless parent_session says
    child = conversation_of("C", seq(60))  # a sub-agent with a session of its own
    assert child is not None and sessions.conv(child, "S").parent == "S"


def test_the_time_to_live_is_learned_from_the_conversations_pauses() -> None:
    m = Mirror()
    (slot,) = m.add_worker("w0", 1)
    hold(m, slot, seq(100))
    sessions = Sessions(60.0)
    key = ("S", "head")
    assert sessions.ended(key, slot, True, now=1000.0) == 60.0  # nothing learned yet: tool_wait_s
    assert slot.awaited(1059.0) == key and slot.awaited(1060.0) is None
    sessions.arrived(key, None, at=1100.0)  # it came back after 100 s
    assert sessions.ended(key, slot, True, now=1110.0) == 200.0  # 2 x its longest pause
    sessions.arrived(key, None, at=1115.0)  # a short pause: the longest of the last few still counts
    assert sessions.ended(key, slot, True, now=1120.0) == 200.0
    sessions.arrived(key, None, at=1120.0 + 1000)  # a very long one: capped
    assert sessions.ended(key, slot, True, now=3000.0) == TTL_CAP_S
    for t in range(4):  # the long pauses leave the window of the last few: back to tool_wait_s
        sessions.arrived(key, None, at=3001.0 + 10 * t)
        sessions.ended(key, slot, True, now=3001.0 + 10 * t + 1)
    assert sessions.ttl(sessions.conv(key)) == 60.0
    assert sessions.ended(key, slot, False, now=4000.0) == 0.0  # a reply without tool calls: nothing awaited
    sessions.arrived(key, None, at=5000.0)  # (a human's pause after a plain reply is not learned)
    assert sessions.ttl(sessions.conv(key)) == 60.0
    off = Sessions(0.0)
    assert off.ended(key, slot, True, now=1.0) == 0.0  # --tool-wait-s 0: off


# ---- selection ----------------------------------------------------------------------------------------------------


def two_workers() -> tuple[Mirror, list, list]:
    m = Mirror()
    return m, m.add_worker("w0", 2), m.add_worker("w1", 2)


def choose(m: Mirror, prompt: np.ndarray, conversation=None, busy: dict[str, int] | None = None):
    loads = [WorkerLoad(w, slots, busy=(busy or {}).get(w, 0)) for w, slots in m.workers.items()]
    params = Params(conversation=conversation)
    return select(m.index.match(prompt), loads, params, time.monotonic(), 0, 0.0)


def awaits(slot, key, ttl: float = 60.0) -> None:
    slot.awaited_by, slot.awaited_until = key, time.monotonic() + ttl


def test_an_awaited_slot_is_not_overwritten_while_another_idle_slot_exists() -> None:
    m, (a0, a1), (b0, b1) = two_workers()
    mine = ("A", "x")
    hold(m, a0, seq(20), age_s=3600)  # the coldest slot of all: what a cold request would overwrite...
    awaits(a0, mine)  # ...but A's agent is running a tool and comes back to it
    hold(m, a1, seq(900))
    hold(m, b0, seq(900))
    hold(m, b1, seq(900))  # every other slot holds a long, recent prefix
    d = choose(m, seq(100), ("B", "y"))
    assert isinstance(d, Dispatch) and d.slot is not a0 and d.cost < AWAITED_COST
    d = choose(m, seq(100))  # a request with no session alike
    assert isinstance(d, Dispatch) and d.slot is not a0
    a0.awaited_until = time.monotonic() - 1  # its time-to-live passed: an ordinary cold slot again
    d = choose(m, seq(100), ("B", "y"))
    assert isinstance(d, Dispatch) and d.slot is a0


def test_an_awaited_slot_is_its_own_conversations_and_a_last_resort_for_others() -> None:
    m, (a0, a1), (b0, b1) = two_workers()
    history = seq(300)
    hold(m, a0, history)
    mine = ("A", "x")
    awaits(a0, mine)
    own = choose(m, np.concatenate([history, seq(40)]), mine)  # its next turn: its slot, no penalty
    assert isinstance(own, Dispatch) and own.slot is a0 and own.reuse == 300 and own.cost < AWAITED_COST
    for s in (a1, b0, b1):
        m.assign(s, f"busy{s.index}{s.worker}", seq(10))  # every other slot is busy
    other = choose(m, seq(100), ("B", "y"), busy={"w0": 1, "w1": 2})
    assert isinstance(other, Dispatch) and other.slot is a0 and other.cost >= AWAITED_COST  # the last resort
    # a request sharing the awaited slot's prefix is another conversation all the same (a sub-agent, another session)
    m2, (c0, c1), _ = two_workers()
    hold(m2, c0, history)
    awaits(c0, mine)
    hold(m2, c1, seq(50))
    sub = choose(m2, np.concatenate([history, seq(10)]), ("A", "sub"))
    assert isinstance(sub, Dispatch) and sub.slot is not c0


def test_a_prefix_holder_among_many_idle_slots_is_costed_with_its_wait() -> None:
    """The many-slots path (numpy, over 32 idle slots at one match depth) leaves awaited slots to `consider`."""
    m = Mirror()
    slots = m.add_worker("w0", 40)
    system = seq(200)
    for i, s in enumerate(slots):
        hold(m, s, np.concatenate([system, seq(20)]), age_s=0.0 if i else 3600.0)
    awaits(slots[0], ("A", "x"))  # the cheapest of them to overwrite, were it not awaited
    d = choose(m, np.concatenate([system, seq(30)]), ("B", "y"))
    assert isinstance(d, Dispatch) and d.slot is not slots[0] and d.reuse == 200


def test_retention_is_counted_when_the_conversation_comes_back_or_its_slot_is_taken() -> None:
    m, (a0, a1), _ = two_workers()
    hold(m, a0, seq(100))
    retention: dict[str, int] = {}
    sessions = Sessions(60.0, retention)
    mine, theirs = ("A", "x"), ("B", "y")
    sessions.ended(mine, a0, True, now=10.0)
    assert sessions.placed(theirs, a1, now=20.0) == []  # another slot: nothing awaited there
    assert sessions.placed(mine, a0, now=30.0) == ["hit"] and a0.awaited_by is None
    sessions.ended(mine, a0, True, now=40.0)
    assert sessions.placed(theirs, a0, now=50.0) == ["overwrote:A"]  # taken within its TTL
    assert sessions.placed(mine, a1, now=60.0) == ["lost"]  # (counted when it was taken)
    sessions.ended(mine, a0, True, now=70.0)
    assert sessions.placed(mine, a1, now=80.0) == ["miss"]  # came back elsewhere (its slot's KV was not there)
    sessions.ended(mine, a0, True, now=100.0)
    assert sessions.placed(mine, a0, now=100.0 + sessions.ttl(sessions.conv(mine)) + 1) == ["expired"]
    assert retention == {"hit": 1, "miss": 2, "expired": 1}


# ---- the core: a session's tool calls, its next turn, status and metrics --------------------------------------------


def test_a_sessions_tool_calls_keep_its_slot_for_its_next_turn_and_status_shows_it() -> None:
    s = core()
    hello(s, slots=2)
    a_prompt = np.arange(1000, 1100, dtype=np.int32)
    (a1,) = jobs(submit(s, "a1", a_prompt, session="agent-A", cache_salt="t"))
    (b1,) = jobs(submit(s, "b1", np.arange(2000, 2300, dtype=np.int32), session="agent-B"))
    done(s, a1, [7, 8, 9], finish="tool_calls")  # A's slot: shorter and less recent than B's, yet awaited
    done(s, b1, [5, 6], finish="stop")
    a_slot = s.mirror.workers["w0"][a1.slot]
    assert a_slot.awaited(time.monotonic()) == conversation_of("agent-A", a_prompt)
    status = s.status(None, cache_salt="t").workers[0].slots[a1.slot]
    assert status.session == "agent-A" and status.awaited_s > 0
    hidden = s.status(None, cache_salt="other").workers[0].slots[a1.slot]  # another tenant's view
    assert hidden.other_tenant and hidden.session is None and hidden.awaited_s == 0.0
    assert "kvroute_awaited_slots 1.0" in exposition.text(s)
    (c1,) = jobs(submit(s, "c1", np.arange(3000, 3050, dtype=np.int32), session="agent-C"))
    assert c1.slot == b1.slot  # another session takes the other slot, though it holds more and is more recent
    turn = np.concatenate([a_prompt, [7, 8, 9], np.arange(4000, 4020, dtype=np.int32)])
    (a2,) = jobs(submit(s, "a2", turn, session="agent-A", cache_salt="t"))
    assert a2.slot == a1.slot and a2.predicted_reuse == len(a_prompt) + 2
    assert s.metrics.retention == {"hit": 1}
    assert s.status(None, cache_salt="t").workers[0].slots[a1.slot].awaited_s == 0.0  # placed: no longer awaited
    text = exposition.text(s)
    assert 'kvroute_retention_total{outcome="hit"} 1.0' in text and "kvroute_awaited_slots 0.0" in text


def test_with_tool_wait_off_a_sessions_slot_is_an_ordinary_one() -> None:
    s = core(tool_wait_s=0)
    hello(s, slots=1)
    (a1,) = jobs(submit(s, "a1", session="agent-A"))
    done(s, a1, [7, 8], finish="tool_calls")
    assert s.status(None).workers[0].slots[0].awaited_s == 0.0
    with pytest.raises(ValueError, match="tool_wait_s"):
        RouterConfig(tool_wait_s=-1)


def test_a_sub_agent_of_the_session_does_not_take_its_parents_awaited_slot_unless_nothing_else_is_idle() -> None:
    s = core()
    hello(s, slots=2)
    main = np.arange(1000, 1100, dtype=np.int32)
    (m1,) = jobs(submit(s, "m1", main, session="S"))
    (o1,) = jobs(submit(s, "o1", np.arange(2000, 2400, dtype=np.int32)))
    done(s, m1, [7, 8], finish="tool_calls")  # the parent calls a tool (which runs a sub-agent)
    done(s, o1, [5], finish="stop")
    sub_prompt = np.arange(5000, 5060, dtype=np.int32)  # the same session, another system prompt: a sub-agent
    (sub1,) = jobs(submit(s, "sub1", sub_prompt, session="S"))
    assert sub1.slot == o1.slot  # not its parent's slot, though that one is shorter and less recent
    assert s.sessions.conv(conversation_of("S", sub_prompt)).parent == "S"
    (last,) = jobs(submit(s, "other", np.arange(7000, 7050, dtype=np.int32), session="T"))
    assert last.slot == m1.slot  # nothing else idle: the last resort, counted as a miss
    assert s.metrics.retention == {"miss": 1}


# ---- preemption -------------------------------------------------------------------------------------------------


def _handed_back(s, job, kept: int, worker: str = "w0"):
    """The worker hands `job` back (preempted before its first token), its slot keeping `kept` of its prompt."""
    prompt = unpack_tokens(job.tokens)
    s.worker_message(
        worker.encode(),
        JobError(
            id=job.id, code=ErrorCode.PREEMPTED, message="handed back", slot=job.slot, slot_tokens=kept,
            slot_hash=token_hash(np.asarray(prompt[:kept], dtype=np.int32)),
        ),
    )  # fmt: skip
    return s.take()


def test_an_interactive_request_with_no_idle_slot_takes_one_from_a_job_not_yet_generating() -> None:
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (bg,) = jobs(submit(s, "bg", np.arange(500, 900, dtype=np.int32)))  # a normal job, computing its prompt
    out = submit(s, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
    (cancel,) = [o.msg for o in out if isinstance(o.msg, JobCancel)]
    assert cancel.id == bg.id and cancel.preempt and not jobs(out)
    assert s.metrics.preemptions == {"asked": 1}
    out = _handed_back(s, bg, kept=256)  # it had computed 256 of its 400 tokens
    (fg,) = jobs(out)
    assert fg.id.startswith("fg.") and fg.priority == 1
    assert not to_client(out, Error)  # the client of the job handed back sees nothing of it
    assert s.metrics.preemptions == {"asked": 1, "handed": 1}
    # then the job handed back is placed again, whole (what it computed went to the host tier, where its worker has one)
    (again,) = jobs(done(s, fg, [1, 2]))
    assert again.id.startswith("bg.") and unpack_tokens(again.tokens) == list(range(500, 900))


def _suspended(s, job, output: list[int], worker: str = "w0"):
    """The worker suspends `job` after its output began (`output` so far): its slot keeps its prompt and all of that
    output but the last token."""
    held = np.asarray(unpack_tokens(job.tokens) + output[:-1], dtype=np.int32)
    s.worker_message(
        worker.encode(),
        JobError(
            id=job.id, code=ErrorCode.PREEMPTED, message="suspended", suspended=True, tokens=pack_tokens(output),
            slot=job.slot, slot_tokens=len(held), slot_hash=token_hash(held),
        ),
    )  # fmt: skip
    return s.take()


BG = np.arange(500, 900, dtype=np.int32)


def test_an_interactive_request_suspends_a_job_whose_output_began_which_then_goes_on_where_it_stopped() -> None:
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (bg,) = jobs(submit(s, "bg", BG, sampling=Sampling(max_tokens=20, temperature=0.0)))
    assert to_client(delta(s, bg, [7, 8, 9]), Delta)  # its output began (streamed to its client)
    out = submit(s, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
    (cancel,) = [o.msg for o in out if isinstance(o.msg, JobCancel)]
    assert cancel.id == bg.id and cancel.preempt
    out = _suspended(s, bg, [7, 8, 9])
    (fg,) = jobs(out)
    assert fg.id.startswith("fg.") and fg.slot == bg.slot and not to_client(out, Error)
    assert s.metrics.preemptions == {"asked": 1, "suspended": 1}
    assert [r.rid for r in s.queue] == ["bg"]  # (it waits, its stream paused)
    # when a slot of its worker is free it goes on there, under its own id, its prompt now holding its output
    (resumed,) = jobs(done(s, fg, [1, 2]))
    assert resumed.id == bg.id and resumed.resume and resumed.slot == bg.slot
    assert unpack_tokens(resumed.tokens) == [*BG.tolist(), 7, 8, 9]
    assert s.metrics.preemptions == {"asked": 1, "suspended": 1, "resumed": 1}
    s.worker_message(b"w0", JobDelta(id=resumed.id, text="x", tokens=pack_tokens([10, 11])))  # (no usage: it came first)
    (more,) = to_client(s.take(), Delta)
    assert unpack_tokens(more.tokens) == [10, 11]  # the stream goes on
    final = done(s, msgspec.structs.replace(bg, slot=resumed.slot), [7, 8, 9, 10, 11])  # (the worker's end: all of it)
    (result,) = to_client(final, Result)
    assert unpack_tokens(result.tokens) == [7, 8, 9, 10, 11] and result.slot == bg.slot
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(BG), 5)
    assert s.metrics.mirror_mismatches == 0 and not s.jobs and not s.requests


def test_a_streaming_victim_stays_asked_until_its_suspension_comes_so_one_preemption_is_in_flight() -> None:
    """Its deltas keep coming until its worker reads the preemption: they do not lift the one-in-flight guard, so a
    request of a higher priority still, arriving meanwhile, does not ask another job back too."""
    s = core(queue_order="fifo")
    hello(s, slots=2)
    (a,) = jobs(submit(s, "a", BG, priority=-1))
    (b,) = jobs(submit(s, "b", np.arange(1500, 1900, dtype=np.int32), priority=-1))
    delta(s, a, [7])
    delta(s, b, [5])
    out = submit(s, "normal", np.arange(1000, 1040, dtype=np.int32))
    (cancel,) = [o.msg for o in out if isinstance(o.msg, JobCancel)]
    victim, other = (a, b) if cancel.id == a.id else (b, a)
    delta(s, victim, [8])  # (streamed before its worker read the preemption)
    out = submit(s, "interactive", np.arange(2000, 2040, dtype=np.int32), priority=1)
    assert not [o for o in out if isinstance(o.msg, JobCancel)], "a second preemption while one is in flight"
    (placed,) = jobs(_suspended(s, victim, [7, 8] if victim is a else [5, 8]))
    assert placed.id.startswith("interactive.")  # (the highest priority takes the slot handed back)
    assert s.metrics.preemptions["asked"] == 1 and other.id in s.jobs  # (the normal one took its one slot: it waits)


def test_a_suspended_request_cancelled_or_whose_worker_dies_ends_and_its_job_with_it() -> None:
    for ending in ("cancel", "death", "deadline"):
        s = core(queue_order="fifo")
        hello(s, slots=1)
        (bg,) = jobs(submit(s, "bg", BG))
        delta(s, bg, [7, 8])
        submit(s, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
        _suspended(s, bg, [7, 8])
        if ending == "cancel":
            s.cancel(CLIENT, "bg")
            out = s.take()
            assert [o.msg.id for o in out if isinstance(o.msg, JobCancel)] == [bg.id], "its job ends on its worker"
            (result,) = to_client(out, Result)
            assert result.finish_reason == "cancelled"
        elif ending == "death":
            s.worker_dead("w0", "test")
            (error,) = to_client(s.take(), Error)
            assert error.code == ErrorCode.WORKER_LOST and "suspended" in error.message
        else:  # its worker ended it (its deadline passed there while it waited)
            lost = JobError(id=bg.id, code=ErrorCode.DEADLINE_EXCEEDED, message="job deadline_exceeded while suspended")
            s.worker_message(b"w0", lost)
            (error,) = to_client(s.take(), Error)
            assert error.code == ErrorCode.DEADLINE_EXCEEDED
        assert all(r.rid != "bg" for r in s.queue) and bg.id not in s.jobs, ending


def test_a_suspended_request_whose_client_saw_none_of_its_output_is_placed_anew_when_its_worker_dies() -> None:
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (bg,) = jobs(submit(s, "bg", BG, stream=False))  # (its output reaches its client only in the result)
    delta(s, bg, [7, 8])
    submit(s, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
    assert jobs(_suspended(s, bg, [7, 8]))  # (fg)
    s.worker_dead("w0", "test")
    assert not to_client(s.take(), Error)
    placed = {j.id.split(".")[0]: j for j in jobs(hello(s, "w1", slots=2))}  # (fg too: it died before its first token)
    again = placed["bg"]
    assert again.id != bg.id and not again.resume and unpack_tokens(again.tokens) == BG.tolist()


def test_no_preemption_of_a_seeded_job_whose_output_began_nor_of_the_same_priority_nor_twice() -> None:
    s = core(queue_order="fifo")
    hello(s, slots=1)
    (bg,) = jobs(submit(s, "bg", np.arange(500, 900, dtype=np.int32), sampling=Sampling(max_tokens=8, seed=3)))
    delta(s, bg, [7])  # its output began, and its tokens depend on how its rows are computed: it is not suspended
    out = submit(s, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
    assert not [o for o in out if isinstance(o.msg, JobCancel)]
    sd = core(queue_order="fifo")
    hello(sd, slots=1, deterministic=True)
    (bg,) = jobs(submit(sd, "bg", np.arange(500, 900, dtype=np.int32)))
    delta(sd, bg, [7])  # (nor on a worker in deterministic mode)
    assert not [o for o in submit(sd, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1) if isinstance(o.msg, JobCancel)]
    s2 = core(queue_order="fifo")
    hello(s2, slots=1)
    jobs(submit(s2, "a", np.arange(500, 900, dtype=np.int32), priority=1))
    out = submit(s2, "b", np.arange(1000, 1040, dtype=np.int32), priority=1)  # same priority: it waits
    assert not [o for o in out if isinstance(o.msg, JobCancel)]
    s3 = core(queue_order="fifo", preempt=False)
    hello(s3, slots=1)
    jobs(submit(s3, "a", np.arange(500, 900, dtype=np.int32)))
    out = submit(s3, "b", np.arange(1000, 1040, dtype=np.int32), priority=1)  # --preempt off
    assert not [o for o in out if isinstance(o.msg, JobCancel)]
    # a job handed back once is not asked again; a request takes one slot so, once
    s4 = core(queue_order="fifo")
    hello(s4, slots=1)
    (bg,) = jobs(submit(s4, "bg", np.arange(500, 900, dtype=np.int32)))
    submit(s4, "fg", np.arange(1000, 1040, dtype=np.int32), priority=1)
    (fg,) = jobs(_handed_back(s4, bg, kept=100))
    out = submit(s4, "fg2", np.arange(2000, 2040, dtype=np.int32), priority=1)
    assert not [o for o in out if isinstance(o.msg, JobCancel)]  # (the only job running is the interactive one)
    (bg2,) = jobs(done(s4, fg, [1]))
    assert bg2.id.startswith(("bg.", "fg2."))
