"""What one client's body can cost everyone else, and what a keyless caller learns (issue 61, items 2, 5, 6): bodies of
thousands of unknown fields are decoded in time linear in their size and off the event loop, on every route; their
names reach /metrics as a fixed set of labels and the log as a capped list; keys are tenants by default; /health asks
the router once however many call it, and tells a keyless caller no failure reasons."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest
from fake_router import FakeRouter, client_for
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

import gateway.app
from gateway import fields
from gateway.fields import LOGGED_FIELDS, Policy
from protocol import Embed, Embeddings, FailedWorker, Ranked, Rerank, StatusReply, Tokenize, Tokens, pack_tokens

UNKNOWN = {f"made_up_{i:05d}": 0 for i in range(30_000)}


class EveryRouter(FakeRouter):
    """Answers every kind of request the gateway sends (a submit, a tokenize, an embed, a rerank)."""

    async def tokens(self, msg: Tokenize) -> Tokens:
        return Tokens(tokens=pack_tokens([1, 2, 3]), text="x")

    async def embed(self, msg: Embed) -> Embeddings:
        return Embeddings(id=msg.id, vectors=[np.zeros(4, "<f4").tobytes()], dims=4, prompt_tokens=3, cached_tokens=2)

    async def rerank(self, msg: Rerank) -> Ranked:
        return Ranked(id=msg.id, scores=[0.5] * len(msg.documents), prompt_tokens=3, cached_tokens=2)


CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {**CHAT},
    "/v1/messages/count_tokens": {"messages": CHAT["messages"]},
    "/v1/embeddings": {"input": "hi"},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
    "/apply-template": {"messages": CHAT["messages"]},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


class CountedStr(str):
    """A field name that counts how often it is compared (a membership test in a list compares it with every entry)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedStr.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_hints_are_recorded_with_one_look_up_each() -> None:
    """Issue item 2: a list membership test per unknown field made 30,000 of them 450 million comparisons."""
    names = [CountedStr(f"made_up_{i}") for i in range(5_000)]
    CountedStr.compared = 0
    policy = Policy("chat")
    for name in names + names:  # (each twice: the second is a look-up that finds it)
        policy.hint(name)
    assert len(policy.ignored) == 5_000
    assert CountedStr.compared <= 2 * len(names), f"{CountedStr.compared} comparisons for {2 * len(names)} hints"


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(ROUTES))
async def test_a_body_of_30000_unknown_fields_is_decoded_off_the_loop_while_health_answers(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue item 2: such a body to /v1/embeddings froze the loop for 9.9 s (/health with it). Its parse and decode
    are held here, on their thread, until /health has been answered: were they on the loop, /health could not be."""
    decoding, answered = threading.Event(), threading.Event()
    parse = gateway.app.parse_body
    threads = []

    def held_parse(raw: bytes) -> dict[str, Any]:
        threads.append(threading.current_thread())
        decoding.set()
        assert answered.wait(10), "/health was not answered while the body was decoded"
        return parse(raw)

    monkeypatch.setattr(gateway.app, "parse_body", held_parse)
    async with client_for(EveryRouter(), status_fresh_s=0) as c:
        big = asyncio.ensure_future(c.post(path, json={**ROUTES[path], **UNKNOWN}))
        assert await asyncio.to_thread(decoding.wait, 10)
        health = await asyncio.wait_for(c.get("/health"), 10)
        answered.set()
        r = await big
    assert health.status_code == 200
    assert threads and threads[0] is not threading.main_thread()
    strict = path in ("/tokenize", "/detokenize")  # (llama-server's helpers refuse a field they do not know)
    assert r.status_code == (400 if strict else 200), r.text[:300]


def series(api: str) -> set[str]:
    """The `field` labels of kvroute_request_fields_ignored_total for `api`."""
    return {
        s.labels["field"]
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == "kvroute_request_fields_ignored_total" and s.labels["api"] == api
    }


@pytest.mark.anyio
async def test_made_up_fields_and_tool_types_add_no_metric_series() -> None:
    """Issue item 5: 3 Responses requests with 2,000 made-up tool types made 12,000 new series."""
    async with client_for(FakeRouter()) as c:
        for n in range(3):
            tools = [{"type": f"made_up_tool_{n}_{i}"} for i in range(2_000)]
            body = {"input": "hi", "tools": tools, **{f"made_up_{n}_{i}": 0 for i in range(500)}}
            assert (await c.post("/v1/responses", json=body)).status_code == 200
            server_tools = [{"type": f"web_search_made_up_{n}_{i}", "name": "w"} for i in range(500)]
            body = {**CHAT, "tools": server_tools, f"made_up_{n}": 0}
            assert (await c.post("/v1/messages", json=body, headers={"anthropic-beta": f"made-up-{n}"})).status_code == 200
    for api in ("responses", "messages"):
        assert series(api) <= fields.labels(api) | {fields.OTHER}, sorted(series(api) - fields.labels(api))[:5]
        assert fields.OTHER in series(api)
    assert "header:anthropic-beta" in series("messages")  # (the fixed names are still counted by name)


def test_hosted_tools_are_counted_by_kind_with_their_version_dropped() -> None:
    assert fields.label("messages", "tools[].type=web_search_20250305") == "tools[].type=web_search"
    assert fields.label("messages", "tools[].type=tool_search_tool_bm25_20251119") == "tools[].type=tool_search_tool_bm25"
    assert fields.label("responses", "tools[].type=web_search_preview_2025_03_11") == "tools[].type=web_search_preview"
    assert fields.label("responses", "tools[].type=made_up") == fields.OTHER
    assert fields.label("chat", "metadata") == "metadata" and fields.label("chat", "made_up") == fields.OTHER


@pytest.mark.anyio
async def test_the_log_line_names_the_first_fields_and_counts_the_rest() -> None:
    """Issue item 5: each such request logged a ~400 kB line, every field named."""
    long_name = "x" * 100_000
    with capture_logs() as logged:
        async with client_for(FakeRouter()) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, long_name: 0, **UNKNOWN})
    assert r.status_code == 200
    (line,) = [e for e in logged if e["event"] == "request_fields_ignored"]
    assert len(line["fields"]) == LOGGED_FIELDS and line["more"] == len(UNKNOWN) + 1 - LOGGED_FIELDS
    assert max(len(f) for f in line["fields"]) <= fields.LOGGED_NAME_CHARS
    assert len(json.dumps(line)) < 4_000


@pytest.mark.anyio
async def test_keys_are_tenants_whose_embeddings_say_nothing_of_others_inputs() -> None:
    """Issue item 6: an embedding context keeps the previous input's head, anyone's; its `cached_tokens` would say how
    much of it a tenant's input shares. Hidden where keys are tenants; shown with --shared-cache or without keys."""
    usage: dict[str, Any] = {}
    for name, kw in (("tenants", {"api_key": "k1,k2"}), ("shared", {"api_key": "k1,k2", "shared_cache": True}), ("keyless", {})):
        async with client_for(EveryRouter(), **kw) as c:
            headers = {"Authorization": "Bearer k2"}
            embedded = (await c.post("/v1/embeddings", json={"input": "hi"}, headers=headers)).json()["usage"]
            ranked = (await c.post("/v1/rerank", json=ROUTES["/v1/rerank"], headers=headers)).json()["usage"]
            usage[name] = ("prompt_tokens_details" in embedded, "prompt_tokens_details" in ranked)
    assert usage == {"tenants": (False, False), "shared": (True, True), "keyless": (True, True)}


class SlowStatusRouter(FakeRouter):
    """A router whose status takes a while, and whose one worker crashed at start."""

    def __init__(self) -> None:
        super().__init__()
        self.workers_ready = False

    async def status(self, cache_salt: str | None = None) -> StatusReply:
        reply = await super().status(cache_salt)
        await asyncio.sleep(0.05)
        reply.failed = [FailedWorker(worker="w1", reason="llama.cpp crashed loading /home/me/secret-model.gguf")]
        return reply


@pytest.mark.anyio
async def test_health_asks_the_router_once_however_many_call() -> None:
    """Issue item 6: every /health, with no key needed, was a full status request to the router."""
    fake = SlowStatusRouter()
    async with client_for(fake) as c:
        replies = await asyncio.gather(*(c.get("/health") for _ in range(20)))
        replies += [await c.get("/health") for _ in range(5)]  # (and again within the second: the same view)
    assert {r.status_code for r in replies} == {503}
    assert len(fake.status_salts) == 1


@pytest.mark.anyio
async def test_health_tells_failure_reasons_to_key_holders_only() -> None:
    async with client_for(SlowStatusRouter(), "k") as c:
        keyless = await c.get("/health")
        keyed = await c.get("/health", headers={"Authorization": "Bearer k"})
    assert keyless.status_code == keyed.status_code == 503
    assert keyless.json() == {"status": "failed", "workers": 0}
    assert "secret-model" in keyed.json()["reason"] and keyed.json()["failed"] == {"w1": keyed.json()["failed"]["w1"]}
    async with client_for(SlowStatusRouter()) as c:  # without keys: one user, who reads why
        assert "secret-model" in (await c.get("/health")).json()["reason"]
