"""bench.warm_restart and bench.long_context without a server: figures in, verdicts and tables out; the chunked
llama.cpp-alone measurement on a stand-in context."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import long_context, warm_restart


def turn(ttft: float | None, prompt: int = 500, cached: int = 0, error: str | None = None, session: int = 0) -> dict[str, Any]:
    return {
        "session": session,
        "turn": 2,
        "ttft": ttft,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": 8,
        "error": error,
    }


def run(ttfts: list[float | None], cached: int, *, restarted: bool = True, failed_before: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "replay": [turn(t, cached=cached, session=i) for i, t in enumerate(ttfts)],
        "before": [turn(0.5, error="HTTP 500" if i < failed_before else None) for i in range(len(ttfts))],
        "replay_counters": {"prefill": 100.0, "restored_host": 400.0},
        "load_average": [1.0, 1.2],
    }
    if restarted:
        out.update(stop_s=0.4, saved_files=20, saved_bytes=200 << 20, restart_s=3.0)
    return out


def repeat(
    warm: list[float | None], cold: list[float | None], live: list[float | None] | None = None, **kw: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"order": ["warm", "cold"], "warm": run(warm, 450, **kw), "cold": run(cold, 0)}
    if live is not None:
        out["order"].append("live")
        out["live"] = run(live, 450, restarted=False)
    return out


def test_the_ratio_is_the_median_of_the_repeats_ratios_of_medians() -> None:
    repeats = [repeat([0.1, 0.1, 0.3], [1.0, 2.0, 3.0], [0.05, 0.05, 0.05]), repeat([0.2, 0.2, 0.2], [1.0, 1.0, 1.0], [0.1] * 3)]
    s = warm_restart.summarize(repeats)
    assert s["variants"] == ["warm", "cold", "live"]
    assert s["warm/cold"]["per_repeat"] == pytest.approx([0.05, 0.2])
    assert s["warm/cold"]["median"] == pytest.approx(0.125)
    assert (s["warm/cold"]["min"], s["warm/cold"]["max"]) == pytest.approx((0.05, 0.2))
    assert s["warm/live"]["per_repeat"] == pytest.approx([2.0, 2.0])
    assert s["warm"]["cached_share"] == pytest.approx(0.9) and s["cold"]["turns_with_nothing_cached"] == 6
    assert s["met"] is False  # 0.125 > 0.1
    assert "0.125" in warm_restart.goal_line(s) and warm_restart.goal_line(s).endswith("MISSED")


def test_the_goal_is_met_below_a_tenth_and_not_with_a_failed_request() -> None:
    s = warm_restart.summarize([repeat([0.05] * 3, [1.0] * 3)])
    assert s["met"] is True and "live/cold" not in s and s["variants"] == ["warm", "cold"]
    assert warm_restart.goal_line(s).endswith("MET")
    failed = warm_restart.summarize([repeat([0.05] * 3, [1.0] * 3, failed_before=1)])
    assert failed["failed_requests"] == 1 and failed["met"] is False
    assert "1 failed requests" in warm_restart.goal_line(failed)


def test_failed_replays_are_left_out_of_the_medians_and_a_repeat_without_any_is_unknown() -> None:
    r = repeat([0.1, None, 0.1], [1.0, 1.0, 1.0])
    r["warm"]["replay"][1]["error"] = "HTTP 503"
    dead = repeat([None] * 3, [1.0] * 3)
    for t in dead["warm"]["replay"]:
        t["error"] = "HTTP 503"
    s = warm_restart.summarize([r, dead])
    assert s["warm/cold"]["per_repeat"][0] == pytest.approx(0.1) and s["warm/cold"]["per_repeat"][1] is None
    assert s["warm/cold"]["median"] == pytest.approx(0.1) and s["met"] is False  # one repeat is unknown
    assert warm_restart.goal_line(warm_restart.summarize([dead])).endswith("NOT EVALUATED")


def test_the_markdown_has_a_line_per_variant_and_repeat_and_per_session() -> None:
    repeats = [repeat([0.1, 0.2], [1.0, 2.0], [0.1, 0.1])]
    result = {"summary": warm_restart.summarize(repeats), "repeats": repeats}
    text = warm_restart.markdown(result)
    assert "| warm/cold | **0.100** |" in text
    assert "| 1 | warm | 150 ms | 90.0% | 0.4 s | 20 (200 MiB) | 3.0 s | 100 / 400 / 0 | 1.0-1.2 |" in text
    assert "| 1 | live | 100 ms | 90.0% | - | - | - |" in text
    assert "| 2 | 500 | 200 ms | 450 | 2000 ms | 0 | 100 ms | 450 | 0.100 |" in text


def test_llama_cpp_alone_is_measured_on_each_repeat_s_median_warm_turn_and_gives_the_floor_of_the_ratio(
    monkeypatch: Any,
) -> None:
    repeats = [repeat([0.1, 0.2, 0.3], [2.0, 2.0, 2.0]), repeat([0.3, 0.3, 0.3], [2.0, 2.0, 2.0])]
    repeats[0]["warm"]["ctx_per_slot"] = 4096
    seen: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> SimpleNamespace:
        seen.append(argv)
        return SimpleNamespace(returncode=0, stdout=json.dumps({"points": [[450, 50, 0.16]]}) + "\n", stderr="")

    monkeypatch.setattr(warm_restart.subprocess, "run", fake_run)
    a = SimpleNamespace(threads=2, slots=4, ctx_per_slot=0)
    repeats[0]["floor"] = warm_restart.measure_floor("m.gguf", a, repeats[0]["warm"])  # type: ignore[arg-type]
    repeats[1]["floor"] = warm_restart.measure_floor("m.gguf", a, repeats[1]["warm"])  # type: ignore[arg-type]
    assert "--point=450:50" in seen[0] and seen[0][seen[0].index("--ctx-per-slot") + 1] == "4096"
    assert "skipped" in repeats[1]["floor"]  # its worker's context is unknown
    f = warm_restart.floor_figures(repeats)
    assert f is not None and f["warm/floor"]["per_repeat"] == pytest.approx([0.2 / 0.16])
    assert f["floor/cold"]["median"] == pytest.approx(0.08)
    text = warm_restart.markdown({"summary": warm_restart.summarize(repeats), "repeats": repeats})
    assert "| warm / llama.cpp alone | **1.250** | 1.250 - 1.250 |" in text
    assert "| llama.cpp alone / cold (the lowest warm / cold can be here) | **0.080** |" in text
    assert warm_restart.floor_figures([repeat([0.1], [1.0])]) is None  # not measured (--no-floor)


def test_sessions_have_their_own_texts_of_the_asked_sizes() -> None:
    def words(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    sessions = warm_restart.make_sessions("s", 3, 2, 120, 20, words)
    assert len(sessions) == 3 and all(len(s["users"]) == 3 for s in sessions)
    assert len({s["system"] for s in sessions}) == 3
    assert all(120 <= len(s["system"].split()) <= 122 for s in sessions)
    assert all(20 <= len(u.split()) <= 22 for s in sessions for u in s["users"])
    assert warm_restart.make_sessions("s", 3, 2, 120, 20, words) == sessions  # deterministic


def test_endpoints_are_read_from_the_command_line_and_log_events_from_json_lines(tmp_path: Path) -> None:
    argvs = [["kvroute", "serve", "--zmq", "tcp://a:1", "--worker-endpoint", "tcp://a:2", "--zmq", "tcp://a:3"]]
    assert warm_restart.endpoint_of(argvs, "--zmq") == "tcp://a:3"  # the last one wins, as argparse reads it
    assert warm_restart.endpoint_of(argvs, "--worker-endpoint") == "tcp://a:2"
    log = tmp_path / "w.log"
    lines = ["load: something", json.dumps({"event": "persisted", "states": 3, "process": "w", "level": "info"}), "{bad"]
    log.write_text("\n".join(lines) + "\n")
    assert warm_restart.log_events(log, 0, ("persisted",)) == [{"event": "persisted", "states": 3}]
    assert warm_restart.log_events(log, log.stat().st_size, ("persisted",)) == []


def test_variants_are_checked() -> None:
    assert warm_restart.parse_args(["--variants", "cold,warm"]).variants == ["cold", "warm"]
    for bad in ("warm,warm", "hot", ""):
        with pytest.raises(SystemExit):
            warm_restart.parse_args(["--variants", bad])


# --- long_context ----------------------------------------------------------------------------------------


def lc_turn(
    k: int, ttft: float | None, prompt: int, cached: int, alone: float | None, error: str | None = None
) -> dict[str, Any]:
    return {
        "turn": k,
        "ttft": ttft,
        "total": 1.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": 8,
        "alone": alone,
        "error": error,
    }


def test_long_context_compares_every_turn_with_llama_cpp_alone() -> None:
    turns = [lc_turn(1, 2.0, 1500, 0, 2.0), lc_turn(2, 2.1, 3000, 1500, 2.0), lc_turn(3, 2.4, 4500, 3000, 2.0)]
    turns += [lc_turn(4, 2.6, 6000, 4500, 2.0), lc_turn(5, 2.2, 7500, 6000, None)]  # (the last one not compared)
    s = long_context.summarize(turns)
    assert s["ratios"] == pytest.approx({1: 1.0, 2: 1.05, 3: 1.2, 4: 1.3})
    assert s["median_ratio"] == pytest.approx(1.125) and s["max_ratio"] == pytest.approx(1.3)
    assert s["turns_over_goal"] == 2 and s["max_prompt_tokens"] == 7500 and s["failed_requests"] == 0
    assert s["met"] is True and long_context.goal_line(s).endswith("MET")
    table = long_context.markdown(turns, s)
    assert "| 4 | 6000 | 4500 | 1500 | 2600 ms | 2000 ms | 1.300 |" in table
    assert "| 5 | 7500 | 6000 | 1500 | 2200 ms |  |  |" in table
    slow = long_context.summarize([lc_turn(1, 3.0, 1500, 0, 2.0)])
    assert slow["met"] is False and long_context.goal_line(slow).endswith("MISSED")


def test_long_context_fails_on_an_overflow() -> None:
    turns = [lc_turn(1, 1.0, 1500, 0, 1.0), lc_turn(2, 1.0, 3000, 1500, 1.0)]
    turns.append(lc_turn(3, None, 0, 0, None, "RuntimeError: HTTP 400: context_overflow"))
    s = long_context.summarize(turns)
    assert s["context_overflow"] is True and s["failed_requests"] == 1 and s["met"] is False
    assert "failed: RuntimeError" in long_context.markdown(turns, s)
    assert long_context.summarize(turns[:2])["met"] is True
    assert long_context.goal_line(long_context.summarize(turns[2:])).endswith("NOT EVALUATED")


class FakeBatch:
    def __init__(self) -> None:
        self.runs: list[tuple[int, int, bool]] = []

    def clear(self) -> None:
        pass

    def add_run(self, tokens: list[int], pos: int, seq: int, logits: bool) -> int:
        self.runs.append((pos, len(tokens), logits))
        return len(tokens)


class FakeLlama:
    """What bench.floor's _decode and the Floor touch; records every batch and trim."""

    def __init__(self) -> None:
        self.vocab = SimpleNamespace(n_vocab=5000)
        self.ctx_per_slot = 4096
        self.batch = FakeBatch()
        self.trims: list[int] = []

    def decode(self) -> int:
        return 0

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        self.trims.append(p0)
        return True


def test_the_floor_computes_new_tokens_in_chunks_and_keeps_its_history_from_turn_to_turn() -> None:
    llama = FakeLlama()
    floor = long_context.Floor(llama, 512)
    floor.prefill(600, 100, repeat=2)
    # the history in full chunks, untimed; then twice its 100 new tokens, trimmed back in between
    assert llama.batch.runs == [(0, 512, False), (512, 88, False), (600, 100, True), (600, 100, True)]
    assert llama.trims == [600] and floor.held == 700
    llama.batch.runs.clear()
    floor.prefill(710, 1200, repeat=1)  # the next turn: the history grows by the reply, no recomputing
    assert llama.batch.runs == [(700, 10, False), (710, 512, False), (1222, 512, False), (1734, 176, True)]
    assert floor.held == 1910
    llama.batch.runs.clear()
    floor.prefill(1000, 50, repeat=1)  # a shorter history than held: trimmed
    assert llama.trims[-1] == 1000 and llama.batch.runs == [(1000, 50, True)]
    with pytest.raises(ValueError):
        floor.prefill(4000, 200, repeat=1)
