"""The benchmark's goals and its llama.cpp floor: figures in, verdicts out; the floor measured on the real model."""

from __future__ import annotations

import pytest

from bench import report


def long_session(turn10: float, last: float, turns: int = 300) -> dict:
    return {"ttft_turn10_s": turn10, "ttft_last_s": last, "last_over_turn10": last / turn10, "turns": turns}


def test_goals_read_the_ratios_and_say_what_was_not_run() -> None:
    results = {
        "agent-long": {"kvroute": {"ttft_p50_last10_s": 0.2}, "kvroute-cold": {"ttft_p50_last10_s": 10.0}},
        "fanout": {"kvroute": {"ttft_mean_s": 2.0}, "llama-cpp-python": {"ttft_mean_s": 3.0}},
        "long-session": {"kvroute": long_session(0.2, 0.7)},
    }
    floor = {"turn10_s": 0.15, "last_s": 0.6, "last_over_turn10": 4.0}
    got = {g.workload: g for g in report.goals(results, floor)}
    assert got["agent-long"].met is True and "ratio 0.020" in got["agent-long"].detail
    assert got["fanout"].met is False and "ratio 0.667" in got["fanout"].detail
    assert got["long-session"].met is False
    assert "ratio 3.50" in got["long-session"].detail and "llama.cpp alone" in got["long-session"].detail
    assert "ratio 4.00" in got["long-session"].detail
    assert got["multi-agent"].met is None and got["throughput"].met is None
    assert report.goal_line(got["throughput"]).startswith("NOT EVALUATED")


def test_a_short_long_session_says_how_many_turns_it_had() -> None:
    got = report.goals({"long-session": {"kvroute": long_session(0.2, 0.25, turns=40)}})
    assert got[1].met is True and "this run had 40 turns, not 300" in got[1].detail


def test_a_goal_is_not_met_on_a_run_with_failed_requests() -> None:
    results = {
        "multi-agent": {"kvroute": {"ttft_mean_s": 0.7, "errors": 24, "requests": 48}, "llama-cpp-python": {"ttft_mean_s": 17.0}}
    }
    got = report.goals(results)[2]
    assert got.workload == "multi-agent" and got.met is False
    assert "ratio 0.041" in got.detail and "failed requests (kvroute 24 of 48)" in got.detail


def test_floor_line_when_skipped() -> None:
    assert "not measured: needs more" in report.floor_line({"skipped": "needs more than 12 turns"})


@pytest.mark.model
def test_floor_times_each_point_in_the_order_given() -> None:
    from bench.floor import measure
    from kvroute.model import resolve_model
    from worker.llama import Llama

    llama = Llama(resolve_model(None), slots=2, ctx_per_slot=512, n_batch=64, threads=1)
    try:
        points = measure(llama, [(300, 8), (40, 8), (300, 8)], repeat=2)
        assert [(h, n) for h, n, _ in points] == [(300, 8), (40, 8), (300, 8)]
        assert all(t > 0 for *_, t in points)
        assert llama.seq_len(0) == 300  # the longest history stays; every timed prefill was trimmed off again
    finally:
        llama.close()
