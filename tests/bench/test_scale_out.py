"""The scale-out benchmark without a server: the workload's construction, the offline oracle's arithmetic, the
router's counters read from /metrics, the goals, and the harness giving the workload its own layout."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import pytest

from bench import report
from bench import run as bench_run
from bench.client import metrics_delta, parse_metrics
from bench.oracle import BOS, Oracle, Request, oracle
from bench.workloads import QUICK, Sizes, build
from common.slots import common_prefix

_IDS: dict[str, int] = {}


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word, equal words equal tokens."""
    return [_IDS.setdefault(w, len(_IDS)) for w in text.split()]


# --- the workload ------------------------------------------------------------------------------------------------


def test_scale_out_is_many_agents_on_two_workers_of_two_slots_sharing_one_system_prompt() -> None:
    w = build("scale-out", Sizes(), words)
    assert (w.workers, w.slots) == (2, 2)
    assert len(w.sessions) == 12 and w.concurrency == 12 and w.n_requests == 12 * 8
    assert {s.opening for s in w.sessions} == {w.sessions[0].opening}  # one shared system prompt
    assert 395 <= len(words(w.sessions[0].opening)) <= 402
    assert all(s.max_tokens == 16 and len(s.messages) == 8 for s in w.sessions)
    firsts = [s.messages[0] for s in w.sessions]
    assert len(set(firsts)) == 12 and all(m.startswith("\n\nUser: ") for m in firsts)  # each agent its own task
    assert all(38 <= len(words(m)) <= 42 for s in w.sessions for m in s.messages)
    assert "12 concurrent sessions on kvroute 2 workers x 2 slots" in w.description


def test_scale_out_turns_append_the_reply_and_a_new_message() -> None:
    s = build("scale-out", Sizes(), words).sessions[0]
    replies = ["first reply.", "second reply."]
    assert s.prompt(2, replies) == s.opening + s.messages[0] + replies[0] + s.messages[1] + replies[1] + s.messages[2]
    assert s.prompt(2, replies).startswith(s.prompt(1, replies[:1]) + replies[1])


def test_scale_out_sessions_pause_before_each_turn_the_same_in_every_run() -> None:
    w = build("scale-out", Sizes(), words)
    pauses = [s.think_s for s in w.sessions]
    assert all(len(p) == 8 and all(0 <= x <= 0.5 for x in p) for p in pauses)
    assert len({p for p in pauses}) == 12  # each session its own: arrivals do not keep a fixed cycle
    assert [s.think_s for s in build("scale-out", Sizes(), words).sessions] == pauses  # seeded: every system alike
    assert all(x == 0 for s in build("scale-out", Sizes(scale_think_s=0), words).sessions for x in s.think_s)
    assert "0-0.5 s pause before each turn" in w.description
    assert build("many-agents", Sizes(), words).sessions[0].think_s == ()  # the other workloads do not pause


def test_a_session_waits_its_pause_before_each_turn() -> None:
    import asyncio
    import time

    from bench.client import run_session
    from bench.workloads import Session

    class Recorder:
        def __init__(self) -> None:
            self.sent: list[float] = []

        async def complete(self, prompt: str, max_tokens: int, **kw: object) -> object:
            self.sent.append(time.perf_counter())
            return type("S", (), {"error": None, "text": "ok"})()

    rec = Recorder()
    t0 = time.perf_counter()
    asyncio.run(run_session(rec, Session("s", "open", ("a", "b"), 4, (0.05, 0.1)), t0))  # type: ignore[arg-type]
    assert rec.sent[0] - t0 >= 0.05 and rec.sent[1] - rec.sent[0] >= 0.1


def test_scale_out_sizes_are_flags_and_quick_shrinks_them() -> None:
    sizes = Sizes(scale_sessions=3, scale_turns=2, scale_workers=3, scale_slots=1, scale_shared_tokens=50)
    w = build("scale-out", sizes, words)
    assert (len(w.sessions), w.n_requests, w.workers, w.slots) == (3, 6, 3, 1)
    quick = build("scale-out", dataclasses.replace(Sizes(), **QUICK), words)
    assert quick.n_requests < 12 and quick.workers == 2
    # the other workloads leave the layout to --workers/--slots
    assert (build("many-agents", Sizes(), words).workers, build("fanout", Sizes(), words).slots) == (0, 0)


# --- the oracle --------------------------------------------------------------------------------------------------


def req(session: str, turn: int, prompt: list[int], reply: list[int]) -> Request:
    return Request(session, turn, (BOS, *prompt), (BOS, *prompt, *reply))


# Two sessions sharing a 3-token system prompt (4 with BOS), two turns each.
A0 = req("a", 0, [1, 2, 3, 10, 11], [20, 21])
A1 = req("a", 1, [1, 2, 3, 10, 11, 20, 21, 12], [22])
B0 = req("b", 0, [1, 2, 3, 30, 31], [40])
B1 = req("b", 1, [1, 2, 3, 30, 31, 40, 32], [41])


def test_oracle_reuses_each_history_and_the_shared_prompt_once_per_worker() -> None:
    one = oracle([A0, A1, B0, B1], workers=1)
    # a0 computes everything; b0 reuses BOS + the shared 3; each turn 2 reuses its whole previous context
    assert one.per_request == {("a", 0): 0, ("b", 0): 4, ("a", 1): 8, ("b", 1): 7}
    assert (one.reused, one.prompt, one.shared, one.workers) == (19, 6 + 9 + 6 + 8, 4, 1)
    two = oracle([A0, A1, B0, B1], workers=2)
    assert two.reused == 19 - 4  # the second worker computes the shared prompt itself
    assert (two.first_turns, two.later_turns) == (0, 15)


def test_oracle_spreads_over_no_more_workers_than_sessions() -> None:
    assert oracle([A0, A1, B0, B1], workers=8).workers == 2
    assert oracle([A0, A1], workers=2).reused == 8  # one session, so one worker: nothing shared to pay twice
    assert oracle([], workers=2) == Oracle(0, 0, 0, 1, {})


def test_oracle_does_not_depend_on_the_order_it_is_given() -> None:
    reqs = [A0, A1, B0, B1]
    want = oracle(reqs, 2)
    for seed in range(5):
        random.Random(seed).shuffle(reqs)
        assert oracle(reqs, 2) == want


def test_oracle_computes_a_prompts_last_token_again() -> None:
    again = req("a", 1, [1, 2, 3, 10, 11, 20, 21], [])  # the whole previous context, nothing new
    assert oracle([A0, again], 1).per_request[("a", 1)] == 7  # of 8
    assert oracle([A0, again], 1).reused == 7


def test_oracle_stops_where_the_next_prompt_tokenizes_the_reply_differently() -> None:
    split = req("a", 1, [1, 2, 3, 10, 11, 20, 99, 12], [])  # the reply's second token came back as another one
    assert oracle([A0, split], 1).per_request[("a", 1)] == 7  # BOS, 1, 2, 3, 10, 11, 20


def test_oracle_requests_rebuild_prompts_and_replies_from_the_samples() -> None:
    w = build("scale-out", Sizes(scale_sessions=2, scale_turns=2, scale_shared_tokens=30, scale_user_tokens=8), words)
    rows = [{"session": s.name, "turn": t, "text": f" reply {s.name} {t}", "error": None} for s in w.sessions for t in range(2)]
    rows.append({"session": "agent-2", "turn": 2, "text": "", "error": "HTTP 500"})  # failed: left out
    reqs = bench_run.oracle_requests(w, rows, words)
    assert len(reqs) == 4
    a1 = next(r for r in reqs if (r.session, r.turn) == ("agent-1", 1))
    a0 = next(r for r in reqs if (r.session, r.turn) == ("agent-1", 0))
    assert a1.prompt[: len(a0.context)] == a0.context  # the next prompt carries the reply
    got = oracle(reqs, 2)
    first = [r.prompt for r in reqs if r.turn == 0]
    # BOS, the system prompt, "User:" and whatever the two tasks start with alike
    assert got.shared == common_prefix(*first) >= 1 + len(words(w.sessions[0].opening)) + 1
    assert got.later_turns == len(a0.context) + len(next(r for r in reqs if r.session == "agent-2").context)


def test_oracle_figures_compare_the_measured_reuse_with_the_oracles() -> None:
    got = oracle([A0, A1, B0, B1], workers=2)  # reuses 0 + 0 on first turns, 8 + 7 later
    samples = [
        {"session": "a", "turn": 0, "prompt_tokens": 6, "cached_tokens": 0, "error": None},
        {"session": "b", "turn": 0, "prompt_tokens": 6, "cached_tokens": 0, "error": None},
        {"session": "a", "turn": 1, "prompt_tokens": 9, "cached_tokens": 8, "error": None},
        {"session": "b", "turn": 1, "prompt_tokens": 8, "cached_tokens": 4, "error": None},
    ]
    f = report.oracle_figures(samples, got)
    assert f["reuse_of_oracle"] == 12 / 15 and f["reuse_of_oracle_later_turns"] == 12 / 15
    assert f["reuse_of_oracle_first_turns"] is None  # the oracle had nothing to reuse there
    assert (f["prefilled_tokens"], f["oracle_prefilled_tokens"], f["oracle_shared_tokens"]) == (29 - 12, 29 - 15, 4)
    assert report.fmt("reuse_of_oracle", f["reuse_of_oracle"]) == "80.0%"
    # the later turns' own histories, after the 4 tokens every prompt shares: a reused 4 of 5, b 0 of 4
    assert f["history_reuse"] == 4 / 9


# --- the router's counters -----------------------------------------------------------------------------------------

BEFORE = """# HELP kvroute_prefix_cache_hits_total Prompt tokens found in the prefix cache
# TYPE kvroute_prefix_cache_hits_total counter
kvroute_prefix_cache_hits_total 10.0
kvroute_reuse_predicted_tokens_total 10.0
kvroute_reuse_mispredictions_total 0.0
kvroute_router_decisions_total{kind="cold"} 1.0
kvroute_worker_jobs_done_total{worker="w-0"} 1.0
kvroute_worker_restored_tokens_total{worker="w-0",source="host"} 0.0
"""
AFTER = """kvroute_prefix_cache_hits_total 510.0
kvroute_reuse_predicted_tokens_total 400.0
kvroute_reuse_mispredictions_total 3.0
kvroute_router_decisions_total{kind="cold"} 3.0
kvroute_router_decisions_total{kind="affinity"} 9.0
kvroute_worker_jobs_done_total{worker="w-0"} 7.0
kvroute_worker_jobs_done_total{worker="w-1"} 6.0
kvroute_worker_restored_tokens_total{worker="w-0",source="host"} 90.0
kvroute_worker_restored_tokens_total{worker="w-1",source="host"} 10.0
kvroute_worker_restored_tokens_total{worker="w-1",source="slot"} 5.0
kvroute_worker_reused_tokens_total{worker="w-0"} 300.0
kvroute_worker_reused_tokens_total{worker="w-1"} 210.0
kvroute_time_to_first_token_seconds_bucket{le="+Inf"} 13.0
"""


def test_router_figures_are_what_the_counters_grew_by_over_the_workload() -> None:
    parsed = parse_metrics(AFTER)
    assert parsed["kvroute_worker_restored_tokens_total"][(("source", "host"), ("worker", "w-0"))] == 90.0
    f = report.router_figures(metrics_delta(parse_metrics(BEFORE), parsed))
    assert (f["router_reused_tokens"], f["router_predicted_tokens"], f["router_mispredictions"]) == (500, 390, 3)
    assert (f["restored_host_tokens"], f["restored_slot_tokens"], f["worker_reused_tokens"]) == (100, 5, 510)
    assert f["jobs_per_worker"] == [6, 6] and f["router_decisions"] == {"affinity": 9, "cold": 2}
    line = report.router_line("kvroute", {**f, "cached_tokens": 500})
    assert "counted 500 reused prompt tokens (the responses' usage 500, the workers 510)" in line


# --- goals -----------------------------------------------------------------------------------------------------------


def scale_out(reuse: float, of_oracle: float, ttft: float, errors: int = 0) -> dict:
    return {"reuse": reuse, "reuse_of_oracle": of_oracle, "ttft_mean_s": ttft, "errors": errors, "requests": 96}


def scale_out_goals(results: dict) -> dict[str, report.Goal]:
    return {g.baseline: g for g in report.goals(results) if g.workload == "scale-out"}


def test_scale_out_goals_against_the_oracle_round_robin_and_least_loaded() -> None:
    results = {
        "scale-out": {
            "kvroute": scale_out(0.9, 0.95, 1.0),
            "kvroute-rr": scale_out(0.25, 0.26, 1.5),
            "kvroute-ll": scale_out(0.5, 0.52, 0.9),
        }
    }
    got = scale_out_goals(results)
    assert set(got) == {"oracle", "kvroute-rr", "kvroute-ll"}
    assert got["oracle"].met is True and "ratio 0.950" in got["oracle"].detail
    assert got["kvroute-rr"].met is True and "ratio 3.600" in got["kvroute-rr"].detail
    assert got["kvroute-ll"].met is False and "ratio 1.111" in got["kvroute-ll"].detail
    assert "own histories" not in got["kvroute-rr"].detail  # no history figures: nothing said about them
    results["scale-out"]["kvroute"]["history_reuse"] = 0.9
    results["scale-out"]["kvroute-rr"]["history_reuse"] = 0.45
    detail = scale_out_goals(results)["kvroute-rr"].detail
    assert "ratio 3.600" in detail and "kvroute 90.0% vs kvroute-rr 45.0%: ratio 2.000" in detail


def test_scale_out_goals_pair_repeats_and_fail_on_errors() -> None:
    runs = [scale_out(0.9, 0.85, 1.0), scale_out(0.9, 0.93, 1.0), scale_out(0.9, 0.91, 1.0)]
    mine = {**scale_out(0.9, 0.91, 1.0, errors=1), "runs": runs}
    got = scale_out_goals({"scale-out": {"kvroute": mine}})
    assert "ratio 0.910, repeats 0.850-0.930" in got["oracle"].detail
    assert got["oracle"].met is False and "failed requests (kvroute 1 of 96)" in got["oracle"].detail
    assert got["kvroute-rr"].met is None and got["kvroute-ll"].met is None  # not run
    assert scale_out_goals({})["oracle"].met is None


# --- the harness ---------------------------------------------------------------------------------------------------


def args(**kw: object) -> argparse.Namespace:
    base = {"repeats": 1, "ctx_per_slot": 2048, "model": "m", "threads": 2, "workers": 1, "slots": 4}
    ns = argparse.Namespace(**{**base, "kvroute_flags": "", "gpu": None, "cold_long_session": False, "systems": None, **kw})
    return ns


def test_scale_out_runs_the_routing_policies_even_with_one_worker_elsewhere() -> None:
    everything = ["kvroute", "kvroute-cold", "kvroute-rr", "kvroute-ll", "kvroute-nospec", "llama-server"]
    skipped = dict(bench_run.systems_for("scale-out", everything, args(), workers=2))
    assert [s for s, why in skipped.items() if why is None] == ["kvroute", "kvroute-rr", "kvroute-ll"]
    assert "no router" in (skipped["llama-server"] or "")
    named = dict(bench_run.systems_for("scale-out", ["kvroute-cold"], args(systems="kvroute-cold"), workers=2))
    assert named["kvroute-cold"] is None  # asked for by name: it runs
    one = dict(bench_run.systems_for("multi-agent", everything, args()))
    assert one["kvroute-rr"] and one["kvroute-ll"] and one["llama-server"] is None


def test_run_one_gives_scale_out_its_own_workers_and_slots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []

    def fake(wname, workload, name, setup, a, tokenize, log_path):
        seen.append((name, setup.workers, setup.slots))
        return {"samples": [], "figures": {"reuse": 0.5, "errors": 0, "requests": 1}, "load_average": [0.0, 0.0]}

    monkeypatch.setattr(bench_run, "measure_once", fake)
    sizes = Sizes(scale_sessions=2, scale_turns=1, scale_shared_tokens=20, scale_user_tokens=6)
    run: dict = {"workloads": {}}
    bench_run.run_one("scale-out", run, args(), sizes, ["kvroute", "kvroute-rr", "llama-server"], words, tmp_path, "t")
    assert seen == [("kvroute", 2, 2), ("kvroute-rr", 2, 2)]
    assert run["workloads"]["scale-out"]["setup"]["workers"] == 2
    assert "llama-server" in run["workloads"]["scale-out"]["skipped"]


def test_the_report_explains_the_oracle_even_with_figures_missing() -> None:
    f = {"reuse_of_oracle": 0.9, "oracle_reuse": 0.8, "oracle_workers": 2, "oracle_shared_tokens": 401}
    text = bench_run.scale_out_lines({"kvroute": f, "kvroute-rr": {"oracle_reuse": 0.8}}, {"workers": 2})
    assert "on the 2 of 2 workers kvroute ran jobs on, the 401 tokens" in text and "reached 90.0%" in text
    assert "`kvroute-rr`: the oracle" in text and "router" not in text  # no /metrics figures: no router line
