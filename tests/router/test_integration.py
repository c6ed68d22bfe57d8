"""The real router and 2 real workers (2 slots each, CPU, 1 thread) over real ZMQ sockets with the
default model, shared by every test in this module: affinity with exact reuse prediction, bad input,
and a worker killed with SIGKILL mid-load."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from router_client import RawClient
from router_helpers import RouterThread, endpoints

from commands.serve import LocalWorkers, serve
from protocol import ChatMessage, Delta, Error, Result, Sampling, StatusRequest, Submit, Tool
from router.config import RouterConfig
from router.supervisor import SupervisorConfig

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[RouterThread, str]]:
    cep, wep = endpoints()
    cfg = RouterConfig(client_endpoint=cep, worker_endpoint=wep, busy_wait_ms=0)
    local = LocalWorkers(cpu_workers=2, slots=2, ctx_per_slot=1024, threads=1)
    sup_cfg = SupervisorConfig(restart_backoff_s=0.2)

    async def main(rt: RouterThread) -> None:
        await serve(cfg, local, sup_cfg, signals=False, started=lambda r, s: rt.extra.update(router=r, sup=s))

    rt = RouterThread(main)
    rt.thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = rt.extra.get("router")
        if r is not None and len(r.workers) == 2:
            break
        time.sleep(0.2)
    rt.router = rt.extra.get("router")
    assert rt.router is not None and len(rt.router.workers) == 2, "workers did not connect in 120 s"
    yield rt, cep
    rt.stop()


Replies = dict[str, tuple[list[Delta], Any]]


def collect(c: RawClient, ids: set[str], timeout_s: float = 120, out: Replies | None = None) -> Replies:
    """Every request's deltas and final message (added to `out`'s); fails if any does not end in time (nothing
    hangs)."""
    out = out if out is not None else {}
    for i in ids:
        out.setdefault(i, ([], None))
    deadline = time.monotonic() + timeout_s
    while any(out[i][1] is None for i in ids):
        _receive(c, out, deadline)
    return out


def send_one_after_another(c: RawClient, submits: list[Submit], timeout_s: float = 120) -> Replies:
    """Sends each request once the one before it has answered (its first delta): the router places them in this
    order (requests sent at once are placed in the order their prompts are tokenized, which varies)."""
    out: Replies = {}
    deadline = time.monotonic() + timeout_s
    for sub in submits:
        out[sub.id] = ([], None)
        c.send(sub)
        while not out[sub.id][0] and out[sub.id][1] is None:
            _receive(c, out, deadline)
    return collect(c, {s.id for s in submits}, timeout_s, out)


def _receive(c: RawClient, out: Replies, deadline: float) -> None:
    msg = c.recv(max(0.1, deadline - time.monotonic()))
    if msg.id not in out:
        return
    if isinstance(msg, Delta):
        out[msg.id][0].append(msg)
    else:
        out[msg.id] = (out[msg.id][0], msg)


def test_sessions_stick_to_their_slots_and_reuse_is_predicted_exactly(system):
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    users = ["Tell me about the sea.", "Name three colours.", "What is a cat?", "Count to five."]
    history = {s: [ChatMessage(role="system", content=f"You are assistant number {s}. Answer briefly.")] for s in range(4)}
    where: dict[int, tuple[str, int]] = {}
    order = list(range(4))
    for turn in range(3):
        submits = []
        for s in order:
            history[s].append(ChatMessage(role="user", content=f"{users[s]} (turn {turn})"))
            submits.append(Submit(id=f"s{s}t{turn}", messages=history[s], sampling=Sampling(max_tokens=6, temperature=0.0)))
        # Placed one by one, alternating workers, no worker is loaded by more than a session reuses on it. (Two
        # sessions of one worker arriving first would rightly move one to the other, idle worker: the cost model
        # weighs a busy worker's queued prefill against recomputing the session's history.)
        results = send_one_after_another(c, submits)
        for s in range(4):
            res = results[f"s{s}t{turn}"][1]
            assert isinstance(res, Result), res
            history[s].append(ChatMessage(role="assistant", content=res.text))
            rec = next(r for r in reversed(router.metrics.recent) if r.id == f"s{s}t{turn}")
            assert rec.predicted_reuse == rec.reused_tokens == res.usage.cached_tokens
            if turn == 0:
                where[s] = (res.worker, res.slot)
            else:
                assert (res.worker, res.slot) == where[s], f"session {s} turn {turn} moved"
                assert res.usage.cached_tokens > 20  # its history was reused
        if turn == 0:
            assert len(set(where.values())) == 4  # four sessions, four slots
            order = sorted(order, key=lambda s: (where[s][1], where[s][0]))  # slot 0 of each worker, then slot 1
    assert router.metrics.reuse_mispredictions == 0 and router.metrics.mirror_mismatches == 0
    c.close()


def test_a_seeded_conversation_repeats_and_the_router_predicts_what_a_seeded_job_reuses(system):
    """A seeded job on a default worker reuses only KV computed for seeded prompts (their tokens but the last): the
    worker says how much each slot holds of it (`slot_n_exact`), and the router predicts with that."""
    rt, cep = system
    router = rt.router
    mispredicted = router.metrics.reuse_mispredictions
    c = RawClient(cep)
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=4321)
    system_prompt = ChatMessage(role="system", content="You answer in one line.")
    turn1 = [system_prompt, ChatMessage(role="user", content="Why is the sea salty?")]

    def ask(rid: str, messages: list[ChatMessage]) -> Result:
        c.send(Submit(id=rid, messages=messages, sampling=sampling))
        res = collect(c, {rid})[rid][1]
        assert isinstance(res, Result), res
        rec = next(r for r in reversed(router.metrics.recent) if r.id == rid)
        assert rec.predicted_reuse == rec.reused_tokens == res.usage.cached_tokens
        return res

    first = ask("seeded-1", turn1)
    again = ask("seeded-1-again", turn1)
    turn2 = [*turn1, ChatMessage(role="assistant", content=first.text), ChatMessage(role="user", content="And rivers?")]
    second = ask("seeded-2", turn2)
    assert again.text == first.text and again.usage.cached_tokens == first.usage.prompt_tokens - 1
    # turn 1's prompt but its last token: that token and the reply were computed a row at a time, not as a prompt
    assert second.usage.cached_tokens == first.usage.prompt_tokens - 1
    assert router.metrics.reuse_mispredictions == mispredicted and router.metrics.mirror_mismatches == 0
    c.close()


def test_questions_on_one_document_share_its_kv_inside_a_worker(system):
    """Three questions on one document at once on 2 workers: two land on one worker, which computes the
    document once and copies it into the other slot; the router counts that copy as reported, not mispredicted."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    doc = "Minutes of the harbour board. " + " ".join(f"Item {i}: the pier lamp {i} was repaired and painted." for i in range(12))
    ids = {f"doc{q}" for q in range(3)}
    for q, rid in enumerate(sorted(ids)):
        c.send(
            Submit(
                id=rid, prompt=f"{doc}\nQuestion {q}: which lamp was painted?", sampling=Sampling(max_tokens=4, temperature=0.0)
            )
        )
    results = collect(c, ids)
    assert all(isinstance(r[1], Result) for r in results.values()), results
    recs = [next(r for r in reversed(router.metrics.recent) if r.id == rid) for rid in ids]
    copied = [r for r in recs if r.restored_tokens]
    assert copied, recs
    for r in copied:
        assert r.reused_tokens == r.restored_tokens > 100 and r.reused_tokens >= r.predicted_reuse
        assert results[r.id][1].usage.cached_tokens == r.reused_tokens
    assert router.metrics.reuse_mispredictions == 0 and router.metrics.mirror_mismatches == 0
    c.close()


def test_a_conversation_whose_slot_was_overwritten_goes_back_to_the_worker_that_saved_it(system):
    """The router sees the workers' host-RAM caches: after every slot was taken by other prompts, a conversation's
    next turn goes to the worker holding its history in host RAM, which restores it, as predicted."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    sampling = Sampling(max_tokens=4, temperature=0.0)
    rules = " ".join(f"Rule {i}: keep the harbour log {i} dry and signed." for i in range(10))
    system_prompt = ChatMessage(role="system", content=f"You are the harbour master. {rules}")
    history = [system_prompt, ChatMessage(role="user", content="Hi.")]
    c.send(Submit(id="saved-t0", messages=history, sampling=sampling))
    first = collect(c, {"saved-t0"})["saved-t0"][1]
    assert isinstance(first, Result), first
    ids = {f"other{i}" for i in range(4)}  # four cold prompts at once take all four slots
    for i, rid in enumerate(sorted(ids)):
        text = f"Unrelated request {i}: " + " ".join(f"the price of item {i}-{k} is {k} coins." for k in range(8))
        c.send(Submit(id=rid, prompt=text, sampling=sampling))
    assert all(isinstance(r[1], Result) for r in collect(c, ids).values())
    restores = router.metrics.decisions["restore"]
    mispredicted = router.metrics.reuse_mispredictions
    history += [ChatMessage(role="assistant", content=first.text), ChatMessage(role="user", content="And rule 3?")]
    c.send(Submit(id="saved-t1", messages=history, sampling=sampling))
    back = collect(c, {"saved-t1"})["saved-t1"][1]
    assert isinstance(back, Result), back
    rec = next(r for r in reversed(router.metrics.recent) if r.id == "saved-t1")
    assert back.worker == first.worker and router.metrics.decisions["restore"] == restores + 1
    assert rec.predicted_reuse == rec.reused_tokens == rec.restored_tokens == back.usage.cached_tokens > 100
    assert router.metrics.reuse_mispredictions == mispredicted and router.metrics.mirror_mismatches == 0
    c.close()


def test_a_conversation_saved_by_a_busy_worker_resumes_on_an_idle_one_with_a_copy_of_its_state(system):
    """A conversation's history is in one worker's host RAM, that worker's slots are both busy, the other worker is
    idle: the router has the state copied to the idle worker (state_fetch, state_copy, job.state) instead of
    computing the history there again or waiting, and predicts what the copy gives exactly."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    sampling = Sampling(max_tokens=4, temperature=0.0)
    rules = " ".join(f"Rule {i}: count the nets of boat {i} twice and log them." for i in range(10))
    history = [ChatMessage(role="system", content=f"You are the net keeper. {rules}"), ChatMessage(role="user", content="Hi.")]
    c.send(Submit(id="copy-t0", messages=history, sampling=sampling))
    first = collect(c, {"copy-t0"})["copy-t0"][1]
    assert isinstance(first, Result), first
    texts = {
        f"fill{i}": f"Unrelated request {i}: " + " ".join(f"the weight of crate {i}-{k} is {k} stone." for k in range(8))
        for i in range(4)
    }
    for rid, text in texts.items():  # four cold prompts at once take all four slots
        c.send(Submit(id=rid, prompt=text, sampling=sampling))
    fills = collect(c, set(texts))
    assert all(isinstance(r[1], Result) for r in fills.values())
    on_first = [rid for rid, r in fills.items() if r[1].worker == first.worker]
    assert len(on_first) == 2, {rid: r[1].worker for rid, r in fills.items()}  # (the history is in host RAM there now)
    long_run = Sampling(max_tokens=200, temperature=0.0, ignore_eos=True)
    for rid in on_first:  # both slots of that worker busy a while, each on its own prompt's longer version
        c.send(Submit(id=f"{rid}-more", prompt=texts[rid] + " And the next crate?", sampling=long_run))
    deadline = time.monotonic() + 60
    while sum(s.busy for s in router.mirror.workers[first.worker]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    copies, mispredicted = dict(router.metrics.state_copies), router.metrics.reuse_mispredictions
    history += [ChatMessage(role="assistant", content=first.text), ChatMessage(role="user", content="And boat 3?")]
    c.send(Submit(id="copy-t1", messages=history, sampling=sampling))
    replies = collect(c, {"copy-t1", *(f"{rid}-more" for rid in on_first)})
    back = replies["copy-t1"][1]
    assert isinstance(back, Result), back
    rec = next(r for r in reversed(router.metrics.recent) if r.id == "copy-t1")
    assert back.worker != first.worker and router.metrics.state_copies["copied"] == copies.get("copied", 0) + 1
    assert rec.predicted_reuse == rec.reused_tokens == rec.restored_tokens == back.usage.cached_tokens > 100
    assert router.metrics.reuse_mispredictions == mispredicted and router.metrics.mirror_mismatches == 0
    c.close()


def test_tenants_share_no_prefix_and_see_no_lengths_of_each_others_slots(system):
    """Tenant B's prompt, identical to tenant A's, reports cached_tokens 0 (and so does a request without a
    tenant); A's next one is cached; `status` asked as B shows A's slots without their lengths or request ids."""
    _, cep = system
    c = RawClient(cep)
    prompt = "Secret plan of tenant A: " + " ".join(f"step {i} is to paint the boat number {i}." for i in range(12))
    sampling = Sampling(max_tokens=2, temperature=0.0)
    results = {}
    for rid, salt in (("ta1", "tenant-a"), ("tb1", "tenant-b"), ("tn1", None), ("ta2", "tenant-a")):
        c.send(Submit(id=rid, prompt=prompt, sampling=sampling, cache_salt=salt))
        results[rid] = collect(c, {rid})[rid][1]
        assert isinstance(results[rid], Result), results[rid]
    assert results["tb1"].usage.cached_tokens == 0
    assert results["tn1"].usage.cached_tokens <= 1  # (at most the BOS of another tenant-less prompt: not A's)
    assert results["ta2"].usage.cached_tokens >= results["ta1"].usage.prompt_tokens - 1
    c.send(StatusRequest(id="st-b", cache_salt="tenant-b"))
    status = c.recv(10)
    a_slot = next(
        s for w in status.workers for s in w.slots if (w.worker, s.slot) == (results["ta2"].worker, results["ta2"].slot)
    )
    assert a_slot.other_tenant and a_slot.n_tokens == 0 and a_slot.request_id is None
    c.send(StatusRequest(id="st-a", cache_salt="tenant-a"))
    status = c.recv(10)
    mine = next(s for w in status.workers for s in w.slots if (w.worker, s.slot) == (results["ta2"].worker, results["ta2"].slot))
    assert not mine.other_tenant and mine.n_tokens >= results["ta2"].usage.prompt_tokens
    c.close()


def test_an_agents_slot_waits_for_its_tool_result_while_other_sessions_take_the_others(system):
    """Session A's reply is a (forced) tool call: its slot is awaited by it (status shows A's session and the time
    left); three other sessions arriving together take the three other slots; A's next turn, with the tool's result,
    is placed on its slot again and reuses its prompt (predicted exactly)."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    tools = [
        Tool(
            name="get_weather",
            description="The weather in a city",
            parameters={
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        )
    ]
    history = [
        ChatMessage(role="system", content="You are a weather agent. Use the tools you are given."),
        ChatMessage(role="user", content="What is the weather in Paris today?"),
    ]
    sampling = Sampling(max_tokens=64, temperature=0.0)
    misses = router.metrics.retention.get("miss", 0)
    first_turn = Submit(
        id="ag1", messages=history, tools=tools, tool_choice="required", parallel_tool_calls=False, sampling=sampling, session="A"
    )
    c.send(first_turn)
    first = collect(c, {"ag1"})["ag1"][1]
    assert isinstance(first, Result) and first.finish_reason == "tool_calls" and first.tool_calls, first
    c.send(StatusRequest(id="st-ag"))
    status = c.recv(10)
    mine = next(s for w in status.workers for s in w.slots if (w.worker, s.slot) == (first.worker, first.slot))
    assert mine.session == "A" and mine.awaited_s > 0 and not mine.busy
    others = {f"ag-{x}": x for x in ("B", "C", "D")}
    for rid, session in others.items():
        prompt = f"Session {session} writes a short story about a lighthouse keeper named {session}."
        c.send(Submit(id=rid, prompt=prompt, sampling=Sampling(max_tokens=24, temperature=0.0), session=session))
    got = collect(c, set(others))
    places = {(r.worker, r.slot) for _, r in got.values() if isinstance(r, Result)}
    assert len(places) == 3 and (first.worker, first.slot) not in places  # the three other slots
    call = first.tool_calls[0]
    history += [
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id=call.id, content='{"temp_c": 21, "sky": "clear"}'),
    ]
    c.send(Submit(id="ag2", messages=history, tools=tools, sampling=Sampling(max_tokens=8, temperature=0.0), session="A"))
    back = collect(c, {"ag2"})["ag2"][1]
    assert isinstance(back, Result), back
    assert (back.worker, back.slot) == (first.worker, first.slot)
    assert back.usage.cached_tokens >= first.usage.prompt_tokens - 4
    rec = next(r for r in reversed(router.metrics.recent) if r.id == "ag2")
    assert rec.predicted_reuse == rec.reused_tokens == back.usage.cached_tokens
    assert router.metrics.retention.get("miss", 0) == misses  # its slot was not taken meanwhile
    c.close()


def test_an_interactive_request_finding_every_slot_computing_takes_one_and_the_job_handed_back_loses_nothing(system):
    """Four long prompts take the four slots; an interactive request then has one of them handed back before its first
    token (JobCancel.preempt): it ends first, and the job handed back is placed again, reusing what it had computed
    (predicted exactly), with the text it gives alone."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    handed, mispredicted = router.metrics.preemptions["handed"], router.metrics.reuse_mispredictions
    sampling = Sampling(max_tokens=4, temperature=0.0)
    lines = " ".join(f"Line {k} says the tide was {k % 7} feet." for k in range(45))
    longs = {f"long{i}": f"Report {i}. {lines}" for i in range(4)}
    for rid, prompt in longs.items():
        c.send(Submit(id=rid, prompt=prompt, sampling=sampling))
    deadline = time.monotonic() + 30
    while rt.call(lambda: sum(len(w.jobs) for w in router.workers.values())) < 4:  # (all four placed)
        assert time.monotonic() < deadline, "the long prompts were not placed"
        time.sleep(0.01)
    c.send(Submit(id="urgent", prompt="Say hello.", sampling=sampling, priority=1))
    finals: list[str] = []
    out: Replies = {rid: ([], None) for rid in [*longs, "urgent"]}
    end = time.monotonic() + 120
    while any(v[1] is None for v in out.values()):
        _receive(c, out, end)
        finals += [rid for rid, v in out.items() if v[1] is not None and rid not in finals]
    assert all(isinstance(v[1], Result) for v in out.values()), out
    assert router.metrics.preemptions["handed"] == handed + 1
    (again,) = [r for r in router.metrics.recent if r.id in longs and r.attempts == 2]
    assert finals.index("urgent") < finals.index(again.id)  # it went first
    assert again.reused_tokens == again.predicted_reuse and router.metrics.reuse_mispredictions == mispredicted
    c.send(Submit(id="alone", prompt=longs[again.id], sampling=sampling))
    alone = collect(c, {"alone"})["alone"][1]
    assert isinstance(alone, Result) and alone.text == out[again.id][1].text
    c.close()


def test_an_interactive_request_finding_every_slot_generating_suspends_one_which_goes_on_losing_nothing(system):
    """Four streams take the four slots and begin their output; an interactive request then has one of them suspended
    (JobCancel.preempt, JobError.suspended): it ends first, and the suspended job goes on on its worker from what it
    kept (Job.resume), predicted exactly; its client's stream paused meanwhile and holds the text it gives alone, nothing
    lost or repeated."""
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    time.sleep(router.cfg.hold_ms / 1000)  # (slots the earlier tests used may be held for their conversations)
    before = dict(router.metrics.preemptions)
    mispredicted, mismatches = router.metrics.reuse_mispredictions, router.metrics.mirror_mismatches
    sampling = Sampling(max_tokens=48, temperature=0.0, ignore_eos=True)
    log = " ".join(f"Line {k} says the tide was {k % 5} feet." for k in range(20))  # (long enough to be worth saving)
    stories = {f"story{i}": f"Log {i}. {log} Story {i}: the lighthouse keeper climbed the stairs and" for i in range(4)}
    out: Replies = {rid: ([], None) for rid in [*stories, "urgent"]}
    for rid, prompt in stories.items():
        c.send(Submit(id=rid, prompt=prompt, sampling=sampling))
    end = time.monotonic() + 120
    while not all(out[rid][0] for rid in stories):  # (every one's output has begun)
        _receive(c, out, end)
    c.send(Submit(id="urgent", prompt="Say hello.", sampling=Sampling(max_tokens=4, temperature=0.0), priority=1))
    finals: list[str] = []
    while any(v[1] is None for v in out.values()):
        _receive(c, out, end)
        finals += [rid for rid, v in out.items() if v[1] is not None and rid not in finals]
    assert all(isinstance(v[1], Result) for v in out.values()), out
    after = router.metrics.preemptions
    assert (after["suspended"], after["resumed"]) == (before.get("suspended", 0) + 1, before.get("resumed", 0) + 1)
    (again,) = [r for r in router.metrics.recent if r.id in stories and r.attempts == 2]
    assert finals.index("urgent") < finals.index(again.id)  # it went first
    deltas, result = out[again.id]
    assert "".join(d.text for d in deltas) == result.text and result.usage.completion_tokens == 48
    # it computed again only its last token (whose KV its step had not computed yet), from its slot or host RAM
    assert again.reused_tokens == again.predicted_reuse == again.prompt_tokens - 1
    assert router.metrics.reuse_mispredictions == mispredicted and router.metrics.mirror_mismatches == mismatches
    c.close()


def test_bad_client_input_gets_errors_while_others_complete(system):
    _, cep = system
    good, bad = RawClient(cep), RawClient(cep)
    for i in range(3):
        good.send(Submit(id=f"g{i}", prompt=f"The number {i} is", sampling=Sampling(max_tokens=16, temperature=0.0)))
    frames = [
        b"\xde\xad\xbe\xef",
        msgpack.packb({"v": 1, "type": "submit", "id": "x", "prompt": ["not", "a", "string"]}),
        msgpack.packb({"v": 1, "type": "submit", "id": "y", "sampling": {"max_tokens": "many"}, "prompt": "hi"}),
        msgpack.packb({"v": 1, "type": "submit", "id": "z", "messages": [{"role": "wizard", "content": "hi"}]}),
        b"\x91" * (9 * 1024 * 1024),
        msgpack.packb({"v": 1, "type": "submit", "id": "big", "prompt": "word " * 2000}),  # over a 1024-token slot
    ]
    for frame in frames:
        bad.send_raw(frame)
        err = bad.recv(30)
        assert isinstance(err, Error) and err.code in ("bad_request", "too_large", "context_overflow") and err.message
    results = collect(good, {"g0", "g1", "g2"})
    assert all(isinstance(v[1], Result) and v[1].usage.completion_tokens > 0 for v in results.values())
    good.close()
    bad.close()


def test_kill_9_mid_load_nothing_hangs_and_the_worker_comes_back(system):
    rt, cep = system
    router = rt.router
    sup = rt.extra["sup"]
    c = RawClient(cep)
    # with a hold set (--hold-ms), slots the earlier tests used are kept for their conversations: wait that out,
    # so that each worker runs two of these jobs at once
    time.sleep(router.cfg.hold_ms / 1000)
    ids = set()
    for i in range(8):
        rid = f"k{i}"
        sampling = Sampling(max_tokens=48, temperature=0.0, ignore_eos=True)
        # streamed every third: however the router spreads the eight (alternating, in pairs, in fours), each
        # worker gets both kinds
        c.send(Submit(id=rid, prompt=f"Story number {i}: once upon a time", sampling=sampling, stream=i % 3 == 0))
        ids.add(rid)
    out: dict[str, tuple[list[Delta], Any]] = {i: ([], None) for i in ids}
    # wait until some worker runs a non-streaming job and at least one stream has started
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.02)
        while c.sock.poll(0):  # (not poll(50): deltas of 3 streams can come faster than that, and never stop it)
            msg = c.recv()
            if isinstance(msg, Delta):
                out[msg.id][0].append(msg)
            else:
                out[msg.id] = (out[msg.id][0], msg)
        snap = rt.call(
            lambda: {w: [(r.rid, r.stream, r.started) for r in conn.jobs.values()] for w, conn in router.workers.items()}
        )
        for w, jobs in snap.items():
            if any(not stream for _, stream, _ in jobs) and any(started for *_, started in jobs):
                victim, on_victim = w, jobs
    assert victim is not None, "no worker had both a streamed and an unstreamed job"
    old_inc = rt.call(lambda: router.workers[victim].hello.incarnation)
    os.kill(sup.pid(victim), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while any(v[1] is None for v in out.values()):
        missing = sorted(k for k, v in out.items() if v[1] is None)
        assert c.sock.poll(int(max(0.1, deadline - time.monotonic()) * 1000)), f"no end for {missing}"
        msg = c.recv()
        if isinstance(msg, Delta):
            out[msg.id][0].append(msg)
        else:
            out[msg.id] = (out[msg.id][0], msg)
    hit = 0  # (a job may have finished in the moment between the look and the kill: then its result stands)
    for rid, stream, started in on_victim:
        final = out[rid][1]
        if started:
            lost = isinstance(final, Error) and final.code == "worker_lost"
            assert lost or (isinstance(final, Result) and final.worker == victim), (rid, final)
            hit += lost
        elif not stream:  # re-dispatched: to the other worker, or to the victim's next incarnation
            assert isinstance(final, Result), (rid, final)
            rec = next(r for r in router.metrics.recent if r.id == rid)
            assert rec.attempts in (1, 2) and rec.predicted_reuse == rec.reused_tokens
            hit += rec.attempts == 2
    others = [v[1] for rid, v in out.items() if rid not in {j[0] for j in on_victim}]
    assert all(isinstance(f, Result) for f in others)
    assert hit >= 1 and router.metrics.dead_workers >= 1
    # the supervisor restarts it as a new incarnation, with empty slots in the mirror
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        c.send(StatusRequest(id="st"))
        st = c.recv(10)
        back = [w for w in st.workers if w.worker == victim]
        if back and back[0].incarnation > old_inc:
            assert back[0].restarts >= 1
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"worker {victim} did not come back")
    c.send(Submit(id="after", prompt="Back again", sampling=Sampling(max_tokens=4)))
    assert isinstance(collect(c, {"after"})["after"][1], Result)
    # across everything this module did, every finished request's reuse was predicted exactly
    assert router.metrics.recent and router.metrics.reuse_mispredictions == 0 and router.metrics.mirror_mismatches == 0
    c.close()
