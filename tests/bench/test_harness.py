"""The benchmark harness end to end at tiny sizes: the real `kvroute serve` started as the benchmark starts it,
driven by its streaming client, its figures computed from what came back."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

import pytest

from bench import report
from bench.run import measure
from bench.systems import Server, Setup
from bench.workloads import Sizes, build, model_tokenizer
from common.model import resolve_model

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    setup = Setup(model=str(resolve_model(None)), threads=2, workers=1, slots=2, ctx_per_slot=1024)
    with Server("kvroute", setup, tmp_path_factory.mktemp("bench") / "kvroute.log") as server:
        yield server


def test_agent_session_through_the_real_server_reports_reuse(server) -> None:
    sizes = dataclasses.replace(Sizes(), turns=3, preamble_tokens=80, user_tokens=12, max_tokens=4)
    workload = build("agent-long", sizes, model_tokenizer(str(resolve_model(None))))
    samples, wall = asyncio.run(measure(server, workload, 120.0))
    rows = [s.to_json() for s in samples]
    assert [r["turn"] for r in rows] == [0, 1, 2] and not any(r["error"] for r in rows)
    assert all(r["ttft"] is not None and 0 < r["ttft"] <= r["total"] for r in rows)
    assert all(r["output_tokens"] == 4 and r["text"] for r in rows)
    assert rows[0]["cached_tokens"] == 0
    for prev, cur in itertools.pairwise(rows):  # each turn reuses the whole previous turn's prompt
        assert cur["cached_tokens"] >= prev["prompt_tokens"]
    figures = report.figures("agent-long", rows, wall)
    assert figures["errors"] == 0 and 0.5 < figures["reuse"] < 1 and len(figures["ttft_per_turn_s"]) == 3


def test_a_sampled_workload_is_served_with_its_sampling_fields(server) -> None:
    sizes = dataclasses.replace(Sizes(), requests=2, concurrency=2, prompt_tokens=30, throughput_max_tokens=8)
    tokenize = model_tokenizer(str(resolve_model(None)))
    sampled = build("throughput", dataclasses.replace(sizes, temperature=1.5), tokenize)
    assert sampled.temperature == 1.5
    rows = [s.to_json() for s in asyncio.run(measure(server, sampled, 120.0))[0]]
    assert not any(r["error"] for r in rows) and all(r["output_tokens"] == 8 for r in rows)  # the fields accepted
    greedy = [s.text for s in asyncio.run(measure(server, build("throughput", sizes, tokenize), 120.0))[0]]
    assert [r["text"] for r in rows] != greedy
