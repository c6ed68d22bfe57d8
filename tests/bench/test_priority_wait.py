"""bench.priority_wait without a model: the traffic's shape against a stand-in server that streams a word per
token, and the figures read from the streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from bench.priority_wait import Stream, Traffic, run


def test_the_interactive_requests_come_once_every_background_stream_has_begun_each_after_the_last() -> None:
    bodies: list[dict[str, Any]] = []

    def serve(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        events = [f"data: {json.dumps({'choices': [{'text': f'w{i} '}]})}\n\n" for i in range(body["max_tokens"])]
        return httpx.Response(200, content="".join(events) + "data: [DONE]\n\n")

    t = Traffic(background=3, bg_words=20, bg_tokens=5, interactive=2, fg_words=5, fg_tokens=3)
    f = asyncio.run(run("http://stand-in", "m", t, transport=httpx.MockTransport(serve)))
    assert [b.get("service_tier") for b in bodies] == [None, None, None, "priority", "priority"]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
    assert [b["max_tokens"] for b in bodies] == [5, 5, 5, 3, 3]
    assert len({b["prompt"] for b in bodies}) == 5, "a prompt of its own each"
    assert f["failed"] == 0 and f["texts"]["bg-0"] == "w0 w1 w2 w3 w4 " and f["texts"]["fg-1"] == "w0 w1 w2 "
    assert len(f["interactive_ttft_s"]) == 2 and f["background_longest_gap_s"] >= 0


def test_a_streams_figures() -> None:
    s = Stream("x", sent_at=10.0, first_at=10.5, times=[10.5, 10.6, 12.0, 12.1])
    assert s.ttft == 0.5 and abs(s.latency - 2.1) < 1e-9 and abs(s.longest_gap - 1.4) < 1e-9
    assert Stream("y", sent_at=1.0).ttft is None and Stream("y", sent_at=1.0).longest_gap == 0.0
