"""The router's core driven with plain calls (no sockets, no threads, no model): every transition of a request,
and what each event sends."""

from __future__ import annotations

import time

import numpy as np
import pytest
from scheduler_helpers import CLIENT, PROMPT, core, delta, done, hello, jobs, submit, to_client

from chat.output import OutputSpec
from protocol import (
    Accept,
    CacheEntry,
    Delta,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Job,
    JobCancel,
    JobError,
    Overflow,
    Refuse,
    Result,
    Sampling,
    SlotHeld,
    SlotState,
    Submit,
    pack_tokens,
    token_hash,
)
from router.prepare import Prepared, PrepareError
from router.requests import ReqState


def test_a_request_goes_tokenizing_queued_running_done() -> None:
    s = core()
    out = submit(s)  # no worker yet: it waits in the queue
    assert not out and [r.state for r in s.queue] == [ReqState.QUEUED]
    out = hello(s)
    assert isinstance(out[0].msg, Accept) and out[0].worker
    (job,) = jobs(out)
    (req,) = s.requests.values()
    assert req.state is ReqState.RUNNING and not s.queue and s.jobs[job.id] is req
    assert s.workers["w0"].load.busy == 1 and s.workers["w0"].load.queued_prefill == len(PROMPT)
    (d,) = to_client(delta(s, job, [7]), Delta)
    assert d.id == "a" and d.usage is not None and d.usage.prompt_tokens == len(PROMPT) and req.started
    assert s.workers["w0"].load.queued_prefill == 0  # the prompt is computed
    (res,) = to_client(done(s, job, [7, 8]), Result)
    assert res.finish_reason == "length" and res.usage.completion_tokens == 2
    assert req.state is ReqState.DONE and not s.requests and not s.jobs and not s.workers["w0"].jobs
    assert s.workers["w0"].load.busy == 0
    # the next turn goes to the slot that holds the history, and the router predicts its reuse exactly
    (job2,) = jobs(submit(s, "b", np.concatenate([PROMPT, [7, 9, 9]]).astype(np.int32)))
    assert job2.slot == job.slot and job2.predicted_reuse == len(PROMPT) + 1


def test_cancel_while_queued_and_while_running() -> None:
    s = core()
    submit(s)
    s.cancel(CLIENT, "a")
    (res,) = to_client(s.take(), Result)
    assert res.finish_reason == "cancelled" and not s.requests and not s.queue
    hello(s)
    (job,) = jobs(submit(s, "b"))
    s.cancel(CLIENT, "b")
    (req,) = s.requests.values()
    out = s.take()
    assert req.state is ReqState.CANCELLING and [type(o.msg) for o in out] == [JobCancel]
    (res,) = to_client(done(s, job, [5], finish="cancelled"), Result)
    assert res.finish_reason == "cancelled" and req.state is ReqState.DONE
    s.cancel(CLIENT, "b")  # unknown or finished: nothing
    assert not s.take()


def test_a_dead_worker_s_unstarted_request_is_requeued_and_a_started_one_fails() -> None:
    s = core()
    hello(s, "w0", slots=2)
    (j1,) = jobs(submit(s, "quiet"))
    (j2,) = jobs(submit(s, "loud", tokens=PROMPT[::-1].copy()))
    delta(s, j2, [1])  # "loud" has streamed, "quiet" has not
    s.worker_dead("w0", "test")
    out = s.take()
    (err,) = to_client(out, Error)
    assert err.id == "loud" and err.code == "worker_lost"
    (quiet,) = s.requests.values()
    assert quiet.state is ReqState.QUEUED and list(s.queue) == [quiet] and s.metrics.redispatched == 1
    (job,) = jobs(hello(s, "w1"))  # re-dispatched to the next worker
    assert job.id != j1.id and quiet.state is ReqState.RUNNING and quiet.attempts == 2


def test_a_draining_worker_hands_back_a_job_that_is_then_requeued() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s))
    s.worker_message(
        b"w0", JobError(id=job.id, code="draining", message="bye", slot=job.slot, slot_tokens=0, slot_hash=token_hash([]))
    )
    (req,) = s.requests.values()
    assert req.state is ReqState.QUEUED and s.workers["w0"].state.value == "draining"
    assert not to_client(s.take(), Error)
    (job,) = jobs(hello(s, "w1"))
    assert req.state is ReqState.RUNNING and req.worker == "w1"


def test_deadline_and_no_workers_fail_queued_requests() -> None:
    s = core(no_workers_grace_s=5.0)
    submit(s, "late", deadline_ms=1)
    submit(s, "patient")
    s.tick(time.monotonic() + 1)
    errs = to_client(s.take(), Error)
    assert [(e.id, e.code) for e in errs] == [("late", "deadline_exceeded")]
    s.table.no_workers_since = time.monotonic() - 10  # no worker for longer than the grace: queued and new ones fail
    s.tick(time.monotonic())
    (err,) = to_client(s.take(), Error)
    assert (err.id, err.code) == ("patient", "no_workers")
    (err,) = to_client(submit(s, "nobody"), Error)
    assert err.code == "no_workers" and not s.requests


def test_refusals_at_accept_and_after_preparing() -> None:
    s = core(queue_size=1)
    hello(s, slots=1)
    submit(s, "a")  # runs
    big = np.arange(5000, dtype=np.int32)
    (err,) = to_client(submit(s, "d", tokens=big), Error)
    assert err.code == "context_overflow" and "4096" in err.message
    assert err.overflow == Overflow(prompt_tokens=5000, max_tokens=8, context=4096)  # (the numbers, for each API)
    tokenizing = s.accept(CLIENT, (), Submit(id="t", prompt="a long text"))  # counts against the queue already
    (err,) = to_client(submit(s, "c"), Error)
    assert tokenizing is not None and err.code == "queue_full" and err.retry_after_ms
    s.prepared(tokenizing, Prepared(PROMPT, None, OutputSpec()))  # queued now
    (err,) = to_client(submit(s, "c"), Error)
    assert err.code == "queue_full"
    (err,) = to_client(submit(s, "a"), Error)
    assert err.code == "bad_request" and "already in flight" in err.message
    s = core()
    req = s.accept(CLIENT, (), Submit(id="e", prompt="x"))
    assert req is not None
    s.prepared(req, PrepareError("`tool_choice` names an unknown function", "tool_choice"))
    (err,) = to_client(s.take(), Error)
    assert err.param == "tool_choice" and not any(r.rid == "e" for r in s.requests.values())
    s.draining = True
    (err,) = to_client(submit(s, "f"), Error)
    assert err.code == "draining"


def test_a_client_that_left_gets_nothing_more_and_its_job_is_cancelled() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s))
    s.client_gone(CLIENT)
    (req,) = s.requests.values()
    assert req.state is ReqState.CANCELLING and [type(o.msg) for o in s.take()] == [JobCancel]
    assert not [o for o in delta(s, job, [1]) if not o.worker]
    assert not [o for o in done(s, job, [1], finish="cancelled") if not o.worker]
    assert not s.requests


def test_n_choices_go_beside_the_first_and_one_result_ends_them() -> None:
    s = core()
    hello(s, slots=2)
    out = submit(s, "n", n=2, sampling=Sampling(max_tokens=4, temperature=0.9, seed=5))
    first, second = jobs(out)
    assert {first.slot, second.slot} == {0, 1} and (first.sampling.seed, second.sampling.seed) == (5, 6)
    assert not to_client(done(s, second, [3]), Result)  # one result, once every choice has ended
    (res,) = to_client(done(s, first, [4, 4]), Result)
    assert [c.index for c in res.choices] == [0, 1] and res.usage.completion_tokens == 3


def test_one_failing_choice_fails_the_request_once_and_cancels_the_others() -> None:
    s = core()
    hello(s, slots=2)
    first, second = jobs(submit(s, "n", n=2))
    s.worker_message(b"w0", JobError(id=first.id, code="internal", message="boom", error_id="e1", slot=-1))
    out = s.take()
    assert [(type(o.msg), o.worker) for o in out] == [(JobCancel, True), (Error, False)]
    assert out[1].msg.error_id == "e1"
    assert not to_client(done(s, second, [1], finish="cancelled"), Result)  # silenced: the error was the reply
    assert not s.requests


def test_drain_timeout_ends_every_open_request_with_draining() -> None:
    s = core()
    hello(s, slots=1)
    (job,) = jobs(submit(s, "running"))
    submit(s, "queued")
    s.drain_expired()
    out = s.take()
    assert sorted(e.id for e in to_client(out, Error)) == ["queued", "running"]
    assert all(e.code == "draining" for e in to_client(out, Error))
    assert [o.msg.id for o in out if isinstance(o.msg, JobCancel)] == [job.id]
    # the running one is answered, and stays cancelling until its job's end says what its slot holds
    assert [r.state for r in s.requests.values()] == [ReqState.CANCELLING] and not s.queue
    assert not to_client(done(s, job, [5], finish="cancelled"), Result) and not s.requests
    assert s.metrics.requests["draining"] == 2 and not s.metrics.requests["cancelled"]  # counted once


def test_workers_say_hello_first_and_a_wrong_model_is_refused() -> None:
    s = core()
    s.worker_message(b"w9", Heartbeat(worker_id="w9", incarnation=1, slots=[], queue=0))
    (out,) = s.take()
    assert isinstance(out.msg, Refuse) and out.msg.code == "not_found"
    bad = Hello(worker_id="w1", incarnation=1, slots=1, ctx_per_slot=64, model_fingerprint="other", device="cpu")
    s.hello(b"w1", bad)
    (out,) = s.take()
    assert isinstance(out.msg, Refuse) and out.msg.code == "model_mismatch"
    hello(s, "w0")
    hello(s, "w0", incarnation=2)  # a restarted process: the old one's slots are gone
    assert s.metrics.dead_workers == 1 and s.workers["w0"].hello.incarnation == 2


def test_a_heartbeat_that_contradicts_the_mirror_is_counted() -> None:
    s = core()
    hello(s)
    (job,) = jobs(submit(s))
    done(s, job, [1, 2])
    s.worker_message(
        b"w0", Heartbeat(worker_id="w0", incarnation=1, slots=[SlotState(slot=job.slot, busy=False, n_tokens=0)], queue=0)
    )
    assert s.metrics.mirror_mismatches == 1


@pytest.mark.parametrize("state", ["queued", "running"])
def test_status_shows_what_each_slot_holds(state: str) -> None:
    s = core()
    if state == "running":
        hello(s)
    submit(s)
    st = s.status("q")
    assert st.queued == (1 if state == "queued" else 0)
    if state == "running":
        assert [sl.request_id for sl in st.workers[0].slots].count("a") == 1


def test_the_exposition_counts_a_two_turn_conversation_and_the_readme_names_every_metric() -> None:
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from router.exposition import text

    s = core()
    hello(s)
    (job,) = jobs(submit(s))
    done(s, job, [7, 8])
    (job2,) = jobs(submit(s, "b", np.concatenate([PROMPT, [7, 9, 9]]).astype(np.int32)))
    done(s, job2, [3])
    families = {f.name: f for f in text_string_to_metric_families(text(s))}
    value = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in families.values() for x in f.samples}
    assert value[("kvroute_prefix_cache_queries_total", ())] == 2 * len(PROMPT) + 3
    assert value[("kvroute_prefix_cache_hits_total", ())] == len(PROMPT) + 1
    assert value[("kvroute_reuse_predicted_tokens_total", ())] == len(PROMPT) + 1
    assert value[("kvroute_reuse_mispredictions_total", ())] == 0
    assert value[("kvroute_requests_total", (("outcome", "length"),))] == 2
    assert value[("kvroute_worker_slots", (("worker", "w0"),))] == 2
    assert value[("kvroute_time_to_first_token_seconds_count", ())] == 2
    readme = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    undocumented = [n for n in families if n.removeprefix("kvroute_worker_") not in readme and n not in readme]
    assert not undocumented, f"docs/metrics.md's metrics table lacks {undocumented}"


def test_the_default_queue_lets_a_dozen_agents_wait_their_turn():
    s = core()  # --queue-size 0: the default bound
    assert s.queue_limit() >= 256


@pytest.mark.parametrize(("order", "bound_ms", "first"), [("shortest", 3000, "d"), ("fifo", 3000, "c"), ("shortest", 0, "c")])
def test_a_freed_slot_goes_to_the_waiting_turn_with_the_least_left_to_compute(order: str, bound_ms: int, first: str) -> None:
    s = core(queue_order=order, queue_bound_ms=bound_ms)
    hello(s, slots=1)
    (job_b,) = jobs(submit(s, "b"))
    cold = np.arange(1000, 1300, dtype=np.int32)  # 300 tokens no slot holds, queued first
    assert not jobs(submit(s, "c", cold))
    turn = np.concatenate([PROMPT, [7, 9, 9, 9]]).astype(np.int32)  # b's conversation, next turn: 4 tokens to compute
    assert not jobs(submit(s, "d", turn))
    (nxt,) = jobs(done(s, job_b, [7, 8]))
    assert nxt.id.startswith(first)
    # the other one is next: a waiting request is never dropped by the ordering
    (last,) = jobs(done(s, nxt, [5]))
    assert last.id.startswith("c" if first == "d" else "d")


def test_round_robin_sends_each_request_on_as_it_arrives_and_it_waits_for_that_worker() -> None:
    # the baseline of bench/ scale-out: a load balancer in front of independent servers, first come first served
    s = core(policy="round-robin")
    hello(s, "w0", slots=1)
    hello(s, "w1", slots=1)
    started = {o.to: o.msg for o in submit(s, "a") + submit(s, "b") if isinstance(o.msg, Job)}
    assert set(started) == {b"w0", b"w1"}
    turn = np.concatenate([PROMPT, [7, 9, 9, 9]]).astype(np.int32)
    assert not jobs(submit(s, "c", turn))  # arrives third: sent to w0
    assert not jobs(submit(s, "d", turn))  # fourth: w1
    (nxt,) = jobs(done(s, started[b"w1"], [5], worker="w1"))
    assert nxt.id.startswith("d")  # w1's slot is free, and c waits for w0 though it holds the same prefix
    (last,) = jobs(done(s, started[b"w0"], [5]))
    assert last.id.startswith("c")


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_the_baseline_policies_serve_the_queue_first_come_first_served(policy: str) -> None:
    s = core(policy=policy)  # --queue-order shortest is the default: it orders by prefixes, which these ignore
    hello(s, slots=1)
    (job_b,) = jobs(submit(s, "b"))
    assert not jobs(submit(s, "c", np.arange(1000, 1300, dtype=np.int32)))
    assert not jobs(submit(s, "d", np.concatenate([PROMPT, [7, 9, 9, 9]]).astype(np.int32)))
    (nxt,) = jobs(done(s, job_b, [7, 8]))
    assert nxt.id.startswith("c")


def test_a_freed_slot_goes_first_to_a_waiting_turn_whose_history_is_on_its_worker() -> None:
    # X has the least left to compute, but its history is saved on w0; w1 frees: Y, whose history w1 saved, goes
    # there first, and X waits for w0 instead of computing its history again on w1
    s = core()
    history_x, history_y = np.arange(1000, 1200, dtype=np.int32), np.arange(2000, 2200, dtype=np.int32)
    for worker, history in (("w0", history_x), ("w1", history_y)):
        saved = CacheEntry(id=1, n_tokens=200, hash=token_hash(history), nbytes=1000, tokens=pack_tokens(history.tolist()))
        hello(s, worker, slots=1, held=[SlotHeld(slot=0, tokens=pack_tokens([]))], cached=[saved])
    fillers = {o.to: o.msg for o in submit(s, "f", np.arange(5000, 5100, dtype=np.int32)) if isinstance(o.msg, Job)}
    fillers.update({o.to: o.msg for o in submit(s, "g", np.arange(6000, 6100, dtype=np.int32)) if isinstance(o.msg, Job)})
    assert set(fillers) == {b"w0", b"w1"}
    assert not jobs(submit(s, "x", np.concatenate([history_x, [7, 7, 7, 7]]).astype(np.int32)))  # 4 tokens left
    assert not jobs(submit(s, "y", np.concatenate([history_y, np.full(30, 9)]).astype(np.int32)))  # 30 left
    (nxt,) = jobs(done(s, fillers[b"w1"], [5], worker="w1"))
    assert nxt.id.startswith("y") and nxt.predicted_reuse == 200
    (last,) = jobs(done(s, fillers[b"w0"], [5]))
    assert last.id.startswith("x") and last.predicted_reuse == 200


def test_max_tokens_caps_what_a_request_asks_for_and_keeps_less() -> None:
    s = core(max_tokens=16)
    hello(s, slots=4)
    asked = {"over": 500, "none": None, "under": 5}
    got = {}
    for rid, n in asked.items():
        (job,) = jobs(submit(s, rid, sampling=Sampling(max_tokens=n, temperature=0.0)))
        got[rid] = job.sampling.max_tokens
    assert got == {"over": 16, "none": 16, "under": 5}
    assert core().cfg.max_tokens == 0  # no cap by default


def test_a_worker_that_failed_at_start_is_reported_and_queued_requests_fail_once_no_worker_can_come() -> None:
    s = core()
    s.expected |= {"w0", "w1"}
    submit(s, "a")
    s.worker_failed("w1", "crashed (signal 11) in its first decode")
    assert [r.rid for r in s.queue] == ["a"]  # w0 may still come
    assert [(f.worker, f.reason) for f in s.status(None).failed] == [("w1", "crashed (signal 11) in its first decode")]
    s.worker_failed("w0", "crashed (signal 4) while loading the model")
    (err,) = to_client(s.take(), Error)
    assert err.code == ErrorCode.NO_WORKERS and "signal 4" in err.message and "signal 11" in err.message
    assert not s.queue and s.none_can_come() is not None
    hello(s, "w0")  # one came back after all (started by hand)
    assert s.none_can_come() is None and [f.worker for f in s.status(None).failed] == ["w1"]


def test_a_burst_on_an_idle_worker_fills_its_free_slots_and_the_queue() -> None:
    """Requests being prepared count as waiting; as many of them as there are free slots will take a slot, not a queue
    place (a burst of 40 on 4 idle slots and a queue of 4 got 4 served: every one of them was still being prepared)."""
    s = core(queue_size=1)
    hello(s, slots=2)
    taken = [s.accept(CLIENT, (), Submit(id=f"b{i}", prompt="hi")) for i in range(4)]  # (none prepared yet)
    assert [r is not None for r in taken] == [True, True, True, False]
    (err,) = to_client(s.take(), Error)
    assert err.id == "b3" and err.code == "queue_full"


def test_a_worker_message_with_no_handler_is_counted_and_logged_not_taken_for_another() -> None:
    from protocol import Accept

    s = core()
    hello(s)
    s.worker_message(b"w0", Accept(worker_id="w0", router_id="r"))  # (a router's message: no worker sends it)
    assert s.metrics.unknown_messages == 1 and s.take() == []


def test_server_sampling_defaults_fill_only_what_a_request_left_to_the_server() -> None:
    """--temp, --top-k, --seed ... are the router's, so every client gets them (HTTP, ZMQ, any language); a field no
    flag sets gets llama-server's default (a model's own, read from its GGUF: test_sampling_defaults.py)."""
    s = core(temp=0.0, top_k=40, seed=7)
    hello(s, slots=3)
    chosen = Sampling(temperature=0.5, top_k=3, max_tokens=8)
    (job,) = jobs(submit(s, "a", sampling=chosen, sampling_unset=["seed"]))
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.seed) == (0.5, 3, 7)
    (job,) = jobs(submit(s, "b", sampling=Sampling(max_tokens=8), sampling_unset=["temperature", "top_k", "top_p", "seed"]))
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.top_p, job.sampling.seed) == (0.0, 40, 0.95, 7)
    (job,) = jobs(submit(s, "c", sampling=Sampling(max_tokens=8), sampling_unset=["min_p", "repeat_last_n"]))
    assert (job.sampling.min_p, job.sampling.repeat_last_n, job.sampling.top_p) == (0.05, 64, 1.0)


def test_a_request_that_sets_no_output_cap_gets_the_default_one_or_its_slots_room() -> None:
    """--default-max-tokens bounds a reply that asked for no limit (Codex asks none), never one that asked for a number,
    and never lets a prompt that fits the slot without it overflow: a long prompt gets the room its slot has."""
    s = core(default_max_tokens=100)
    hello(s, ctx_per_slot=4096)
    (open_,) = jobs(submit(s, "a", sampling=Sampling(max_tokens=None)))
    (asked,) = jobs(submit(s, "b", sampling=Sampling(max_tokens=500)))
    assert (open_.sampling.max_tokens, asked.sampling.max_tokens) == (100, 500)
    s = core(default_max_tokens=100)
    hello(s, ctx_per_slot=128)
    (long_,) = jobs(submit(s, "c", np.arange(300, 340, dtype=np.int32), sampling=Sampling(max_tokens=None)))
    assert long_.sampling.max_tokens is None, "the room left (88 tokens) is under the default: the slot's end stops it"
    s = core(default_max_tokens=0)
    hello(s, ctx_per_slot=4096)
    (unbounded,) = jobs(submit(s, "d", sampling=Sampling(max_tokens=None)))
    assert unbounded.sampling.max_tokens is None


def test_an_owner_holds_at_most_its_share_of_the_slots_while_another_owner_waits() -> None:
    """Issue 61 item 4: one key with n=4 held every slot and the other key's request waited for all of them. With
    --queue-share 0.5 of 4 slots, key A runs 2 choices; the others wait while key B's request does, and B gets a
    slot; once B no longer waits, A's wait for free slots as usual."""
    s = core(queue_share=0.5)
    hello(s, slots=4)
    a = jobs(submit(s, "a", n=4, owner="key-a"))
    assert len(a) == 4, "alone, an owner takes every slot"
    for job in a[:2]:
        done(s, job, [7])
    a2 = jobs(submit(s, "a2", np.arange(300, 340, dtype=np.int32), n=4, owner="key-a"))
    assert len(a2) == 2, "2 slots free, no other owner waiting: both go to A"
    b = jobs(submit(s, "b", np.arange(500, 540, dtype=np.int32), owner="key-b"))
    assert not b, "every slot busy"
    out = done(s, a[2], [7])
    assert [j.id.split(".")[0] for j in jobs(out)] == ["b"], "A holds 3 > its share 2 while B waits: B takes the slot"
    out = done(s, a[3], [7])
    assert len(jobs(out)) == 1, "B runs now, nobody else waits: A's next choice takes the freed slot"


def test_an_owners_admission_counts_its_running_choices_too() -> None:
    """--queue-share covers waiting and running: with a queue of 8 and 2 slots, a key may have 4 + 1 in flight."""
    s = core(queue_share=0.5, queue_size=8)
    hello(s, slots=2)
    for i in range(5):
        assert not to_client(submit(s, f"a{i}", owner="key-a"), Error), f"a{i} is within the share"
    (refused,) = to_client(submit(s, "a5", owner="key-a"), Error)
    assert refused.code == "queue_full" and "waiting or running" in refused.message
    assert not to_client(submit(s, "b0", owner="key-b"), Error)
