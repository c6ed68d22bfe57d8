"""bench.run's interleaved repeats: the systems take turns in a rotating order, each repeat's figures are kept, and
a system that fails once is reported as failed rather than measured on the repeats it survived."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import run as bench_run
from bench.workloads import Sizes


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def test_repeats_rotate_the_systems_and_pair_up(monkeypatch, tmp_path: Path) -> None:
    order: list[str] = []
    tps = {"kvroute": iter([10.0, 30.0, 20.0]), "llama-server": iter([20.0, 20.0, 20.0]), "broken": iter([5.0])}

    def fake(wname, workload, name, setup, args, tokenize, log_path):
        order.append(name)
        value = next(tps[name], None)
        if value is None:
            return "failed: it exited"
        figures = {"output_tokens_per_s": value, "errors": 0, "requests": 1}
        return {"samples": [], "figures": figures, "load_average": [0.1, 0.2]}

    monkeypatch.setattr(bench_run, "measure_once", fake)
    args = argparse.Namespace(repeats=3, ctx_per_slot=2048, model="m", threads=2, workers=1, slots=4, kvroute_flags="", gpu=None)
    args.cold_long_session = False
    sizes = Sizes(requests=2, prompt_tokens=20)
    run: dict = {"workloads": {}}
    bench_run.run_one("throughput", run, args, sizes, ["kvroute", "llama-server", "broken"], words, tmp_path, "t")

    assert order == ["kvroute", "llama-server", "broken", "llama-server", "broken", "kvroute", "kvroute", "llama-server"]
    entry = run["workloads"]["throughput"]
    assert entry["skipped"] == {"broken": "failed: it exited"} and "broken" not in entry["systems"]
    kv = entry["systems"]["kvroute"]["figures"]
    assert kv["output_tokens_per_s"] == 20.0 and kv["spread"]["output_tokens_per_s"] == (10.0, 30.0)
    assert len(entry["systems"]["llama-server"]["repeats"]) == 3
    assert (tmp_path / "t.json").exists()
