"""Figures from samples, the markdown report, the PNG plots and the goals (issue 6's against kvroute-cold and
llama-cpp-python, issue 16's against llama-server and llama.cpp alone).

Every figure is computed from the raw samples kept in the run's JSON file, so a report can be rebuilt from it.
With interleaved repeats, a system's figure is the median over the repeats, its spread their min and max, and a
ratio between two systems the median of the ratios of the same repeat (each pair measured minutes apart).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

Samples = list[dict[str, Any]]
Results = dict[str, dict[str, dict[str, Any]]]  # workload -> system -> figures
T = TypeVar("T")

# Long-session: TTFT "at turn 10" and "at the last turn" are medians of a few turns around them, so that one
# noisy request (a GC pause, another process on the machine) does not decide the goal.
EARLY_TURNS = range(7, 12)  # turns 8..12, 1-based
LAST_N = 5


def compared_turns(per_turn: Sequence[T]) -> tuple[list[T], list[T]]:
    """The turns "at turn 10" and "at the last turn" stand for, from a list in turn order (used by the figures
    and by llama.cpp alone, so both compare the same turns)."""
    return [per_turn[i] for i in EARLY_TURNS if i < len(per_turn)], list(per_turn[-LAST_N:])


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile, q in [0, 1]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def turn_ttfts(samples: Samples) -> list[float | None]:
    """TTFT of each turn of a single-session workload, in turn order."""
    return [s["ttft"] for s in sorted(samples, key=lambda s: s["turn"])]


def figures(workload: str, samples: Samples, wall: float) -> dict[str, Any]:
    """The figures of one system on one workload."""
    ok = [s for s in samples if not s["error"]]
    ttfts = [s["ttft"] for s in ok if s["ttft"] is not None]
    out_tokens = sum(s["output_tokens"] for s in ok)
    known = [s for s in ok if s["cached_tokens"] is not None and s["prompt_tokens"]]
    f: dict[str, Any] = {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "wall_s": wall,
        "ttft_mean_s": mean(ttfts),
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "prompt_tokens": sum(s["prompt_tokens"] or 0 for s in ok),
        "cached_tokens": sum(s["cached_tokens"] for s in known) if known and len(known) == len(ok) else None,
        # Reuse is only known where the server reports cached tokens for every request.
        "reuse": (sum(s["cached_tokens"] for s in known) / sum(s["prompt_tokens"] for s in known))
        if known and len(known) == len(ok)
        else None,
    }
    if workload in ("agent-long", "long-session"):
        per_turn = turn_ttfts(ok)
        f["ttft_per_turn_s"] = per_turn
        last10 = [t for t in per_turn[-10:] if t is not None]
        f["ttft_p50_last10_s"] = quantile(last10, 0.5)
    if workload == "long-session":
        per_turn = f["ttft_per_turn_s"]
        early, late = ([t for t in ts if t is not None] for ts in compared_turns(per_turn))
        f["ttft_turn10_s"] = statistics.median(early) if early else None
        f["ttft_last_s"] = statistics.median(late) if late else None
        f["turns"] = len(per_turn)
        f["last_over_turn10"] = f["ttft_last_s"] / f["ttft_turn10_s"] if f["ttft_last_s"] and f["ttft_turn10_s"] else None
    return f


def oracle_figures(samples: Samples, oracle: Any) -> dict[str, Any]:
    """scale-out: the measured reuse against the offline oracle's (`bench.oracle.Oracle`) over the same requests,
    in all and split into the sessions' first turns (the shared prompt) and the later turns (their histories)."""
    ok = [s for s in samples if not s["error"]]
    if any(s["cached_tokens"] is None for s in ok):
        return {"oracle_reused_tokens": oracle.reused, "oracle_reuse": oracle.reused / oracle.prompt if oracle.prompt else None}
    cached = sum(s["cached_tokens"] for s in ok)
    first = sum(s["cached_tokens"] for s in ok if s["turn"] == 0)
    # the later turns' own histories: what they reuse beyond the D tokens every prompt shares (any worker has those)
    later = [s for s in ok if s["turn"] > 0 and s["prompt_tokens"]]
    history = sum(max(0, s["cached_tokens"] - oracle.shared) for s in later)
    history_len = sum(max(0, s["prompt_tokens"] - oracle.shared) for s in later)

    def share(mine: int, best: int) -> float | None:
        return mine / best if best else None

    return {
        "prefilled_tokens": sum(s["prompt_tokens"] or 0 for s in ok) - cached,
        "oracle_reused_tokens": oracle.reused,
        "oracle_prefilled_tokens": oracle.prompt - oracle.reused,
        "oracle_reuse": share(oracle.reused, oracle.prompt),
        "oracle_shared_tokens": oracle.shared,
        "oracle_workers": oracle.workers,
        "reuse_of_oracle": share(cached, oracle.reused),
        "reuse_of_oracle_first_turns": share(first, oracle.first_turns),
        "reuse_of_oracle_later_turns": share(cached - first, oracle.later_turns),
        "history_reuse": share(history, history_len),
    }


# The router's and workers' counters a kvroute system's /metrics gave over one workload (bench.client.metrics_delta)
ROUTER_FIGURES = {
    "router_reused_tokens": "kvroute_prefix_cache_hits_total",
    "router_predicted_tokens": "kvroute_reuse_predicted_tokens_total",
    "router_mispredictions": "kvroute_reuse_mispredictions_total",
    "worker_reused_tokens": "kvroute_worker_reused_tokens_total",
    "worker_prefilled_tokens": "kvroute_worker_prefill_tokens_total",
}


def router_figures(delta: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, Any]:
    """Figures from the change of kvroute's /metrics over a workload: what the router counted as reused (it must
    equal the usage's cached tokens: both are the worker's own count), what it predicted, how often it was wrong
    (a worker that restores more from host RAM than predicted is not wrong), where restored tokens came from, and
    how many jobs each worker ran."""

    def total(name: str, **labels: str) -> int:
        series = delta.get(name, {})
        return round(sum(v for k, v in series.items() if set(labels.items()) <= set(k)))

    out: dict[str, Any] = {key: total(name) for key, name in ROUTER_FIGURES.items()}
    out["restored_host_tokens"] = total("kvroute_worker_restored_tokens_total", source="host")
    out["restored_slot_tokens"] = total("kvroute_worker_restored_tokens_total", source="slot")
    jobs = delta.get("kvroute_worker_jobs_done_total", {})
    out["jobs_per_worker"] = [round(v) for _, v in sorted(jobs.items())]
    decisions = delta.get("kvroute_router_decisions_total", {})
    out["router_decisions"] = {dict(k).get("kind", "?"): round(v) for k, v in sorted(decisions.items()) if v}
    return out


def router_line(name: str, f: dict[str, Any]) -> str:
    """One sentence per kvroute system: the router's own account of the workload (medians over the repeats)."""
    decisions = ", ".join(f"{k} {v}" for k, v in (f.get("router_decisions") or {}).items())
    n = {k: fmt("x_tokens", f.get(k)) for k in (*ROUTER_FIGURES, "cached_tokens", "restored_host_tokens", "restored_slot_tokens")}
    return (
        f"`{name}`: the router counted {n['router_reused_tokens']} reused prompt tokens (the responses' usage "
        f"{n['cached_tokens']}, the workers {n['worker_reused_tokens']}), predicted {n['router_predicted_tokens']}, "
        f"{fmt('x_tokens', f.get('router_mispredictions'))} jobs mispredicted; restored from host RAM "
        f"{n['restored_host_tokens']}, from another slot {n['restored_slot_tokens']}; jobs per worker "
        f"{f.get('jobs_per_worker')}; decisions {decisions or 'n/a'}"
    )


def combine(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over repeats: each number's median (per-turn lists turn by turn), `spread` each
    number's (min, max), `runs` every repeat's own figures. Errors and requests add up: a request that failed in
    any repeat counts."""
    out: dict[str, Any] = {"runs": list(runs), "spread": {}}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        if key in ("errors", "requests"):
            out[key] = sum(v or 0 for v in values)
        elif all(isinstance(v, list) for v in values):
            columns = zip(*values, strict=False)
            out[key] = [_median([x for x in col if x is not None]) for col in columns]
        elif all(isinstance(v, int | float) or v is None for v in values):
            known = [v for v in values if v is not None]
            out[key] = _median(known)
            if known:
                out["spread"][key] = (min(known), max(known))
        else:
            out[key] = values[0]
    return out


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# --- tables ------------------------------------------------------------------------------------------------

# workload -> (headline figure, whether lower is better, the columns shown)
COLUMNS: dict[str, tuple[str, bool, list[tuple[str, str]]]] = {
    "agent-long": (
        "ttft_p50_last10_s",
        True,
        [("ttft_p50_last10_s", "p50 TTFT last 10 turns"), ("ttft_mean_s", "mean TTFT"), ("wall_s", "wall"), ("reuse", "reuse")],
    ),
    "multi-agent": (
        "ttft_mean_s",
        True,
        [("ttft_mean_s", "mean TTFT"), ("ttft_p90_s", "p90 TTFT"), ("wall_s", "wall"), ("reuse", "reuse")],
    ),
    "many-agents": (
        "ttft_mean_s",
        True,
        [("ttft_mean_s", "mean TTFT"), ("ttft_p90_s", "p90 TTFT"), ("wall_s", "wall"), ("reuse", "reuse")],
    ),
    "throughput": (
        "output_tokens_per_s",
        False,
        [
            ("output_tokens_per_s", "output tokens/s"),
            ("output_tokens", "output tokens"),
            ("wall_s", "wall"),
            ("ttft_mean_s", "mean TTFT"),
        ],
    ),
    "fanout": (
        "ttft_mean_s",
        True,
        [("ttft_mean_s", "mean TTFT"), ("ttft_p90_s", "p90 TTFT"), ("wall_s", "wall"), ("reuse", "reuse")],
    ),
    "scale-out": (
        "reuse",
        False,
        [
            ("reuse", "reuse"),
            ("reuse_of_oracle", "reuse / oracle's"),
            ("prefilled_tokens", "prompt tokens computed"),
            ("ttft_mean_s", "mean TTFT"),
            ("ttft_p90_s", "p90 TTFT"),
            ("wall_s", "wall"),
        ],
    ),
    "long-session": (
        "ttft_last_s",
        True,
        [
            ("ttft_turn10_s", "TTFT turn 10"),
            ("ttft_last_s", "TTFT last turn"),
            ("last_over_turn10", "last / turn 10"),
            ("ttft_mean_s", "mean TTFT"),
            ("wall_s", "wall"),
            ("reuse", "reuse"),
        ],
    ),
}


def fmt(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key in ("reuse", "oracle_reuse") or key.startswith("reuse_of_oracle"):
        return f"{100 * value:.1f}%"
    if key.endswith(("_tokens", "_workers", "_mismatches", "_mispredictions")) and isinstance(value, float):
        return f"{value:.0f}"  # a median of an even number of repeats
    if key == "output_tokens_per_s":
        return f"{value:.1f}"
    if key.endswith("_s"):
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if key == "last_over_turn10":
        return f"{value:.2f}x"
    return str(value)


def table(workload: str, per_system: dict[str, dict[str, Any]]) -> str:
    """One markdown table: a row per system, its figures (medians over the repeats, the headline with its
    min-max) and its headline figure's ratio to kvroute's."""
    headline, _, cols = COLUMNS[workload]
    base = per_system.get("kvroute", {}).get(headline)
    head = ["system", *(label for _, label in cols), f"{dict(cols)[headline]} / kvroute", "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, f in per_system.items():
        value = f.get(headline)
        ratio = f"{value / base:.2f}x" if value is not None and base else "n/a"
        cells = [name, *(_cell(k, f, k == headline) for k, _ in cols), ratio, str(f.get("errors", 0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(key: str, f: dict[str, Any], with_spread: bool) -> str:
    lo_hi = f.get("spread", {}).get(key)
    if not with_spread or lo_hi is None or len(f.get("runs", ())) < 2:
        return fmt(key, f.get(key))
    return f"{fmt(key, f.get(key))} ({fmt(key, lo_hi[0])} to {fmt(key, lo_hi[1])})"


# --- goals -------------------------------------------------------------------------------------------------


@dataclass
class Goal:
    workload: str
    text: str
    met: bool | None  # None: not evaluated (a system or workload was not run)
    detail: str
    baseline: str = ""  # what kvroute is compared with


def paired_ratios(mine: dict[str, Any], theirs: dict[str, Any], key: str) -> list[float]:
    """`key` of kvroute over the other system's, repeat by repeat (the repeats of one round are run side by side);
    one ratio, of the figures themselves, when there were no repeats."""
    pairs = zip(mine.get("runs") or [mine], theirs.get("runs") or [theirs], strict=False)
    return [m[key] / t[key] for m, t in pairs if m.get(key) is not None and t.get(key)]


def _ratio_goal(workload: str, text: str, results: Results, key: str, other: str, limit: float, at_most: bool) -> Goal:
    per = results.get(workload)
    if per is None:
        return Goal(workload, text, None, "workload not run", other)
    mine, theirs = per.get("kvroute", {}), per.get(other, {})
    ratios = paired_ratios(mine, theirs, key)
    if not ratios:
        return Goal(workload, text, None, f"needs kvroute and {other} figures", other)
    r = statistics.median(ratios)
    met = r <= limit if at_most else r >= limit
    bound = f"{'<=' if at_most else '>='} {limit}"
    spread = f", repeats {min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else ""
    detail = f"kvroute {fmt(key, mine.get(key))} vs {other} {fmt(key, theirs.get(key))}: ratio {r:.3f}{spread} (goal {bound})"
    failed = _failures(per, ("kvroute", other))
    return Goal(workload, text, met and not failed, detail + failed, other)


def _failures(per: dict[str, dict[str, Any]], systems: Sequence[str]) -> str:
    """'' when the systems served every request; else what failed: figures over part of a workload meet nothing."""
    bad = [f"{s} {per[s]['errors']} of {per[s]['requests']}" for s in systems if per.get(s, {}).get("errors")]
    return f"; NOT MET: failed requests ({', '.join(bad)})" if bad else ""


def goals(
    results: Results,
    floor: dict[str, Any] | None = None,
    long_turns_goal: int = 300,
    agent_floor: dict[str, Any] | None = None,
) -> list[Goal]:
    """The goals of issues 6 and 16, checked against this run's figures (`floor`: llama.cpp alone on the long
    session's turns, `agent_floor`: on agent-long's last 10)."""
    return _issue6_goals(results, floor, long_turns_goal) + _llama_server_goals(results, agent_floor) + _scale_out_goals(results)


def _scale_out_goals(results: Results) -> list[Goal]:
    """Issue 17: what routing buys across workers. Reuse against the offline oracle (bench/oracle.py) with the same
    slots and host RAM, against round-robin, and mean TTFT against least-loaded (which balances without prefixes)."""
    w = "scale-out"
    return [
        _oracle_goal(results),
        _history_detail(_ratio_goal(w, f"{w}: reuse >= 3 x round-robin's", results, "reuse", "kvroute-rr", 3.0, False), results),
        _ratio_goal(w, f"{w}: mean TTFT <= 1.0 x least-loaded's", results, "ttft_mean_s", "kvroute-ll", 1.0, True),
    ]


def _history_detail(goal: Goal, results: Results) -> Goal:
    """The round-robin goal's detail, with the same ratio on the later turns' own histories (the tokens after what
    every prompt shares): round-robin finds the shared prompt on every worker, so that is where routing shows."""
    per = results.get("scale-out") or {}
    ratios = paired_ratios(per.get("kvroute", {}), per.get("kvroute-rr", {}), "history_reuse")
    if not ratios:
        return goal
    mine, theirs = (per[s].get("history_reuse") for s in ("kvroute", "kvroute-rr"))
    spread = f", repeats {min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else ""
    extra = (
        f"; on the later turns' own histories (after the shared prompt) kvroute {fmt('reuse', mine)} vs"
        f" kvroute-rr {fmt('reuse', theirs)}: ratio {statistics.median(ratios):.3f}{spread}"
    )
    return replace(goal, detail=goal.detail + extra)


def _oracle_goal(results: Results) -> Goal:
    text = "scale-out: reuse >= 0.9 x the offline oracle's (same slots and host RAM)"
    per = results.get("scale-out")
    mine = (per or {}).get("kvroute", {})
    shares = [r["reuse_of_oracle"] for r in mine.get("runs") or [mine] if r.get("reuse_of_oracle") is not None]
    if per is None or not shares:
        return Goal("scale-out", text, None, "needs the scale-out workload on kvroute" if per else "workload not run", "oracle")
    r = statistics.median(shares)
    spread = f", repeats {min(shares):.3f}-{max(shares):.3f}" if len(shares) > 1 else ""
    parts = [
        f"{label} {fmt('reuse', mine.get(key))}"
        for label, key in (("first turns", "reuse_of_oracle_first_turns"), ("later turns", "reuse_of_oracle_later_turns"))
    ]
    detail = (
        f"kvroute reused {fmt('reuse', mine.get('reuse'))} of the prompt tokens, "
        f"the oracle {fmt('reuse', mine.get('oracle_reuse'))}: ratio {r:.3f}{spread} ({', '.join(parts)}; goal >= 0.9)"
    )
    failed = _failures(per, ("kvroute",))
    return Goal("scale-out", text, r >= 0.9 and not failed, detail + failed, "oracle")


def _issue6_goals(results: Results, floor: dict[str, Any] | None, long_turns_goal: int) -> list[Goal]:
    out = [
        _ratio_goal(
            "agent-long", "p50 TTFT over the last 10 turns: kvroute <= 0.15 x kvroute-cold", results,
            "ttft_p50_last10_s", "kvroute-cold", 0.15, True,
        ),
    ]  # fmt: skip
    per = results.get("long-session", {}).get("kvroute")
    text = f"long session: TTFT at turn {long_turns_goal} <= 1.5 x TTFT at turn 10 (kvroute)"
    if per is None or per.get("last_over_turn10") is None:
        out.append(Goal("long-session", text, None, "needs the long-session workload on kvroute (at least 12 turns)", "itself"))
    else:
        r = per["last_over_turn10"]
        short = f"; this run had {per['turns']} turns, not {long_turns_goal}" if per["turns"] < long_turns_goal else ""
        detail = (
            f"median of turns 8-12 {fmt('x_s', per['ttft_turn10_s'])}, median of the last {LAST_N} turns "
            f"{fmt('x_s', per['ttft_last_s'])}: ratio {r:.2f}{short}"
        )
        if floor and floor.get("last_over_turn10"):
            detail += f"; {floor_line(floor)}"
        failed = _failures(results["long-session"], ("kvroute",))
        out.append(Goal("long-session", text, r <= 1.5 and not failed, detail + failed, "itself"))
    for w in ("multi-agent", "fanout"):
        text = f"{w}: kvroute mean TTFT <= 0.5 x llama-cpp-python"
        out.append(_ratio_goal(w, text, results, "ttft_mean_s", "llama-cpp-python", 0.5, True))
    out.append(
        _ratio_goal(
            "throughput", "throughput: kvroute output tokens/s >= 1.5 x llama-cpp-python", results,
            "output_tokens_per_s", "llama-cpp-python", 1.5, False,
        )
    )  # fmt: skip
    return out


# Issue 16's goals against llama-server: (workload, figure, what it is, limit, whether the figure is at most it)
LLAMA_SERVER_GOALS = (
    ("agent-long", "ttft_p50_last10_s", "p50 TTFT of the last 10 turns", 0.85, True),
    ("multi-agent", "ttft_mean_s", "mean TTFT", 0.5, True),
    ("multi-agent", "ttft_p90_s", "p90 TTFT", 0.6, True),
    ("many-agents", "ttft_mean_s", "mean TTFT", 0.5, True),
    ("many-agents", "ttft_p90_s", "p90 TTFT", 0.6, True),
    ("throughput", "output_tokens_per_s", "output tokens/s", 1.0, False),
    ("fanout", "ttft_mean_s", "mean TTFT", 0.4, True),
)


def _llama_server_goals(results: Results, agent_floor: dict[str, Any] | None) -> list[Goal]:
    """Issue 16: the server users compare kvroute with, at its best settings, and llama.cpp alone."""
    out = []
    for w, key, what, limit, at_most in LLAMA_SERVER_GOALS:
        text = f"{w}: {what} {'<=' if at_most else '>='} {limit} x llama-server"
        out.append(_ratio_goal(w, text, results, key, "llama-server", limit, at_most))
        if w == "agent-long":
            out.append(_agent_floor_goal(results, agent_floor))
    return out


def _agent_floor_goal(results: Results, floor: dict[str, Any] | None) -> Goal:
    text = "agent-long: p50 TTFT of the last 10 turns <= 1.05 x llama.cpp alone (prefill of the same new tokens)"
    mine = results.get("agent-long", {}).get("kvroute", {}).get("ttft_p50_last10_s")
    if mine is None or not floor or not floor.get("p50_s"):
        why = floor["skipped"] if floor and "skipped" in floor else "needs agent-long on kvroute and llama.cpp alone"
        return Goal("agent-long", text, None, why, "llama.cpp alone")
    r = mine / floor["p50_s"]
    detail = f"kvroute {fmt('x_s', mine)} vs llama.cpp alone {fmt('x_s', floor['p50_s'])}: ratio {r:.3f} (goal <= 1.05)"
    failed = _failures(results["agent-long"], ("kvroute",))
    return Goal("agent-long", text, r <= 1.05 and not failed, detail + failed, "llama.cpp alone")


def floor_line(floor: dict[str, Any]) -> str:
    """One sentence on what llama.cpp alone needs for the compared turns (bench/floor.py)."""
    if "skipped" in floor:
        return f"llama.cpp alone not measured: {floor['skipped']}"
    if "p50_s" in floor:
        return (
            f"llama.cpp alone (bench/floor.py, no server) prefills the same new tokens after the same history in "
            f"{fmt('x_s', floor['p50_s'])} (median of the last {len(floor['points'])} turns)"
        )
    return (
        f"llama.cpp alone (bench/floor.py, no server) prefills the same new tokens after the same history in "
        f"{fmt('x_s', floor['turn10_s'])} at turn 10 and {fmt('x_s', floor['last_s'])} at the last turn: "
        f"ratio {floor['last_over_turn10']:.2f}, the least any server can have on this machine"
    )


def goal_line(g: Goal) -> str:
    mark = {True: "MET", False: "MISSED", None: "NOT EVALUATED"}[g.met]
    return f"{mark}: {g.text} — {g.detail}"


# --- plots -------------------------------------------------------------------------------------------------


def plot_turns(workload: str, per_system: dict[str, dict[str, Any]], path: Path, floor: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, f in per_system.items():
        ys = f.get("ttft_per_turn_s") or []
        ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys], marker=".", label=name)
    if floor and floor.get("turns"):
        label = "llama.cpp alone: prefill of the turn's new tokens"
        ax.scatter(floor["turns"], [t for *_, t in floor["points"]], marker="x", color="black", zorder=3, label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title(f"{workload}: TTFT per turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distribution(workload: str, samples: dict[str, Samples], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, ss in samples.items():
        xs = sorted(s["ttft"] for s in ss if s["ttft"] is not None and not s["error"])
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title(f"{workload}: TTFT distribution (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
