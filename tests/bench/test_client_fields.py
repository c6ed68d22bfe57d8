"""bench/client.py's request body, without a server: what a sampled request carries with and without request seeds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from bench.client import CompletionClient


def sent_body(**client: Any) -> dict[str, Any]:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text='data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n')

    async def run() -> None:
        c = CompletionClient("http://bench.test", **client)
        c._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        sample = await c.complete("Hello", 4, session="s", turn=2, t0=0.0)
        await c.aclose()
        assert sample.error is None and sample.text == "hi"

    asyncio.run(run())
    return bodies[0]


def test_a_sampled_request_carries_the_whole_distribution_and_a_seed_unless_seeds_are_off() -> None:
    seeded = sent_body(temperature=0.8)
    assert seeded["temperature"] == 0.8 and (seeded["top_k"], seeded["top_p"], seeded["min_p"]) == (0, 1.0, 0.0)
    assert isinstance(seeded["seed"], int) and seeded["seed"] == sent_body(temperature=0.8)["seed"]  # same per turn
    unseeded = sent_body(temperature=0.8, seeds=False)
    assert "seed" not in unseeded and unseeded["top_k"] == 0
    greedy = sent_body()
    assert greedy["temperature"] == 0.0 and "seed" not in greedy and "top_k" not in greedy


def test_the_throughput_workload_asks_every_reply_to_its_full_length() -> None:
    from bench.workloads import Sizes, build

    assert sent_body(full_length=True)["ignore_eos"] is True and "ignore_eos" not in sent_body()
    tokenize = lambda text: text.split()  # noqa: E731  (the builders only count tokens)
    assert build("throughput", Sizes(), tokenize).full_length and not build("fanout", Sizes(), tokenize).full_length
