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
    got = {g.workload: g for g in report.goals(results, floor) if g.baseline in ("kvroute-cold", "llama-cpp-python", "itself")}
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
    assert got.workload == "multi-agent" and got.met is False and got.baseline == "llama-cpp-python"
    assert "ratio 0.041" in got.detail and "failed requests (kvroute 24 of 48)" in got.detail


def test_combine_takes_medians_keeps_the_spread_and_adds_up_failures() -> None:
    runs = [
        {"ttft_mean_s": 0.3, "errors": 0, "requests": 8, "reuse": None, "ttft_per_turn_s": [1.0, 0.2]},
        {"ttft_mean_s": 0.1, "errors": 1, "requests": 8, "reuse": 0.9, "ttft_per_turn_s": [3.0, None]},
        {"ttft_mean_s": 0.2, "errors": 0, "requests": 8, "reuse": 0.8, "ttft_per_turn_s": [2.0, 0.4]},
    ]
    got = report.combine(runs)
    assert got["ttft_mean_s"] == 0.2 and got["spread"]["ttft_mean_s"] == (0.1, 0.3)
    assert (got["errors"], got["requests"]) == (1, 24)
    assert got["reuse"] == pytest.approx(0.85)
    assert got["ttft_per_turn_s"] == [2.0, pytest.approx(0.3)]
    assert got["runs"] == runs
    assert "0.200 s (0.100 s to 0.300 s)" in report.table("multi-agent", {"kvroute": got})


def test_llama_server_goals_pair_the_repeats() -> None:
    def system(*means: float) -> dict:
        return report.combine([{"ttft_mean_s": m, "ttft_p90_s": 2 * m, "errors": 0, "requests": 4} for m in means])

    # Repeat by repeat kvroute is 0.4x, 0.5x and 0.6x llama-server; the ratio of the medians would be 0.5 too, but
    # the spread comes from the pairs.
    results = {"fanout": {"kvroute": system(0.4, 1.0, 0.3), "llama-server": system(1.0, 2.0, 0.5)}}
    got = {(g.workload, g.baseline): g for g in report.goals(results)}
    fanout = got[("fanout", "llama-server")]
    assert fanout.met is False and "ratio 0.500, repeats 0.400-0.600 (goal <= 0.4)" in fanout.detail
    results["multi-agent"] = {"kvroute": system(0.3, 0.3), "llama-server": system(1.0, 1.0)}
    multi = [g for g in report.goals(results) if g.workload == "multi-agent" and g.baseline == "llama-server"]
    assert [g.met for g in multi] == [True, True] and "p90" in multi[1].text
    results["multi-agent"]["kvroute"]["errors"] = 1  # a refused request in any repeat: the goal is not met
    assert not any(g.met for g in report.goals(results) if g.workload == "multi-agent" and g.baseline == "llama-server")
    assert got[("many-agents", "llama-server")].met is None


def test_agent_long_against_llama_cpp_alone() -> None:
    results = {"agent-long": {"kvroute": {"ttft_p50_last10_s": 0.21}}}
    floor = {"points": [[2000, 80, 0.2]] * 10, "turns": list(range(21, 31)), "p50_s": 0.2}
    goal = next(g for g in report.goals(results, agent_floor=floor) if g.baseline == "llama.cpp alone")
    assert goal.met is True and "ratio 1.050" in goal.detail
    assert "median of the last 10 turns" in report.floor_line(floor)
    goal = next(g for g in report.goals(results) if g.baseline == "llama.cpp alone")
    assert goal.met is None


def test_floor_line_when_skipped() -> None:
    assert "not measured: needs more" in report.floor_line({"skipped": "needs more than 12 turns"})


@pytest.mark.model
def test_floor_times_each_point_in_the_order_given() -> None:
    from bench.floor import measure
    from common.model import resolve_model
    from worker.llama import Llama

    llama = Llama(resolve_model(None), slots=2, ctx_per_slot=512, n_batch=64, threads=1)
    try:
        points = measure(llama, [(300, 8), (40, 8), (300, 8)], repeat=2)
        assert [(h, n) for h, n, _ in points] == [(300, 8), (40, 8), (300, 8)]
        assert all(t > 0 for *_, t in points)
        assert llama.seq_len(0) == 300  # the longest history stays; every timed prefill was trimmed off again
    finally:
        llama.close()
