"""A tool call streamed in pieces on every API, and keep-alives while a stream is held, read by the official SDKs (no
model: a scripted router)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import msgspec
import openai
import pytest
from fake_router import ScriptedRouter, client_for, events, result

from gateway.app import Gateway, build_app
from gateway.keepalive import Clock, Tick, Ticking
from protocol import Delta, Result, Submit, ToolCall, ToolCallDelta

ARGS = ['{"path": "a.py", ', '"content": "print(1)\\n', 'print(2)"}']
WHOLE = "".join(ARGS)
TOOLS_OAI = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}]
TOOLS_RESP = [{"type": "function", "name": "write", "parameters": {"type": "object"}}]
TOOLS_ANT = [{"name": "write", "input_schema": {"type": "object"}}]


def call_script() -> list[Delta | Result]:
    """Reasoning, then one call whose arguments come in three pieces after its head."""
    pieces = [ToolCallDelta(index=0, id="call_1", name="write", arguments="")]
    pieces += [ToolCallDelta(index=0, arguments=a) for a in ARGS]
    return [
        Delta(id="", text="", tokens=b"", reasoning="think"),
        *(Delta(id="", text="", tokens=b"", tool_calls=[p]) for p in pieces),
        result(finish_reason="tool_calls", reasoning="think", tool_calls=[ToolCall(id="call_1", name="write", arguments=WHOLE)]),
    ]


@pytest.mark.anyio
async def test_chat_completions_streams_the_arguments_in_pieces() -> None:
    async with client_for(ScriptedRouter(*call_script())) as c:
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS_OAI, "stream": True}
        )
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    calls = [
        d["choices"][0]["delta"]["tool_calls"][0] for d in chunks if d["choices"] and "tool_calls" in d["choices"][0]["delta"]
    ]
    assert calls[0] == {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write", "arguments": ""}}
    assert calls[1:] == [{"index": 0, "function": {"arguments": a}} for a in ARGS]  # (as OpenAI sends the rest)
    assert chunks[1]["choices"][0]["delta"] == {"reasoning_content": "think"}


@pytest.mark.anyio
async def test_responses_streams_argument_deltas_and_the_whole_call_at_its_end() -> None:
    async with client_for(ScriptedRouter(*call_script())) as c:
        r = await c.post("/v1/responses", json={"input": "x", "tools": TOOLS_RESP, "stream": True})
    evs = events(r.text)
    deltas = [d["delta"] for k, d in evs if k == "response.function_call_arguments.delta"]
    assert deltas == ARGS
    (done,) = [d for k, d in evs if k == "response.function_call_arguments.done"]
    assert done["arguments"] == WHOLE and done["name"] == "write"
    added = [d["item"] for k, d in evs if k == "response.output_item.added" and d["item"]["type"] == "function_call"]
    assert added[0]["arguments"] == "" and added[0]["call_id"] == "call_1"
    final = evs[-1][1]["response"]["output"]
    assert [(i["type"], i.get("arguments")) for i in final] == [("reasoning", None), ("function_call", WHOLE)]


@pytest.mark.anyio
async def test_anthropic_streams_input_json_deltas() -> None:
    async with client_for(ScriptedRouter(*call_script())) as c:
        r = await c.post(
            "/v1/messages",
            json={"max_tokens": 99, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS_ANT, "stream": True},
        )
    evs = events(r.text)
    parts = [
        d["delta"]["partial_json"] for k, d in evs if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert parts == ARGS
    start = [d["content_block"] for k, d in evs if k == "content_block_start"]
    assert start[1] == {"type": "tool_use", "id": "call_1", "name": "write", "input": {}}


@pytest.mark.anyio
async def test_a_call_cut_off_keeps_what_was_written() -> None:
    """max_tokens in the middle of the arguments: Anthropic's `input` cannot be the half object (it is {})."""
    cut = result(finish_reason="length", tool_calls=[ToolCall(id="c", name="write", arguments='{"path": "a')])
    async with client_for(ScriptedRouter(cut)) as c:
        r = await c.post(
            "/v1/messages", json={"max_tokens": 9, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS_ANT}
        )
        body = r.json()
        assert (body["stop_reason"], body["content"][-1]["input"]) == ("max_tokens", {})
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS_OAI})
        msg = r.json()["choices"][0]
        assert (msg["finish_reason"], msg["message"]["tool_calls"][0]["function"]["arguments"]) == ("length", '{"path": "a')


# ---- keep-alive -------------------------------------------------------------------------------------------------


class SlowRouter(ScriptedRouter):
    """The script with a pause before the result: the output is held (deltas carrying no text) for `pause` s."""

    def __init__(self, *replies: Delta | Result, pause: float) -> None:
        super().__init__(*replies)
        self.pause = pause

    async def stream_submit(self, sub: Submit) -> AsyncIterator[Delta | Result]:
        for reply in self.replies:
            if isinstance(reply, Result):
                for _ in range(int(self.pause / 0.05)):  # tokens with nothing to show (a marker being decided)
                    await asyncio.sleep(0.05)
                    yield Delta(id=sub.id or "", text="", tokens=b"")
            yield msgspec.structs.replace(reply, id=sub.id or "")


def held_script() -> list[Delta | Result]:
    return [Delta(id="", text="Hi", tokens=b""), result(finish_reason="stop", text="Hi")]


@pytest.mark.anyio
async def test_held_output_gets_each_apis_keep_alive_and_the_sdks_read_through_it() -> None:
    router = SlowRouter(*held_script(), pause=0.6)
    async with client_for(router, keep_alive_s=0.12) as c:
        chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})).text
        resp = (await c.post("/v1/responses", json={"input": "x", "stream": True})).text
        msgs = (
            await c.post("/v1/messages", json={"max_tokens": 9, "messages": [{"role": "user", "content": "x"}], "stream": True})
        ).text
    assert chat.count(": keep-alive\n\n") >= 3
    keep = [d for k, d in events(resp) if k == "keepalive"]
    assert len(keep) >= 3 and all(set(d) == {"type", "sequence_number"} for d in keep)
    seqs = [d["sequence_number"] for _, d in events(resp)]
    assert seqs == list(range(len(seqs)))  # (keep-alives take their place in the sequence)
    assert sum(k == "ping" for k, _ in events(msgs)) >= 3

    async with client_for(router, keep_alive_s=0.12) as http:
        oai = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="-", http_client=http)
        stream = await oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "Hi"
        async with oai.responses.stream(model="m", input="x") as rs:
            kinds = [e.type async for e in rs]
            final = await rs.get_final_response()
        assert "keepalive" in kinds and final.output_text == "Hi"
    app = build_app(Gateway(router, "gemma", keep_alive_s=0.12))  # type: ignore[arg-type]
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost") as http2:
        ant = anthropic.AsyncAnthropic(base_url="http://localhost", api_key="-", http_client=http2)  # (its SDK speaks httpx2)
        async with ant.messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "x"}]) as ms:
            text = "".join([t async for t in ms.text_stream])
        assert text == "Hi"


@pytest.mark.anyio
async def test_a_stream_that_writes_gets_no_keep_alive() -> None:
    script = [Delta(id="", text=str(i), tokens=b"") for i in range(5)] + [result(finish_reason="stop", text="01234")]
    async with client_for(ScriptedRouter(*script), keep_alive_s=0.2) as c:
        chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})).text
    assert "keep-alive" not in chat


@pytest.mark.anyio
async def test_ticking_reads_the_source_whole_and_ticks_when_idle() -> None:
    async def slow() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.25)
            yield i

    clock = Clock(idle_s=0.1)
    got: list[Any] = []
    async for item in Ticking(slow(), clock):
        got.append(item)
        if not isinstance(item, Tick):
            clock.wrote()
    assert [g for g in got if not isinstance(g, Tick)] == [0, 1, 2]
    assert 3 <= sum(isinstance(g, Tick) for g in got) <= 9


@pytest.mark.anyio
async def test_ticking_reads_at_most_its_bound_ahead_of_the_writer() -> None:
    """A writer that takes nothing leaves the source waiting once AHEAD items are buffered (the source's own bound
    then applies), and every item still comes, in order, once it takes them."""
    read: list[int] = []

    async def fast() -> AsyncIterator[int]:
        for i in range(3 * Ticking.AHEAD):
            read.append(i)
            yield i

    ticks = Ticking(fast(), Clock(idle_s=60))
    assert await anext(ticks) == 0
    await asyncio.sleep(0.05)  # (the reader runs while the writer takes nothing)
    assert len(read) <= Ticking.AHEAD + 2
    got = [item async for item in ticks]
    assert got == list(range(1, 3 * Ticking.AHEAD))
    await ticks.aclose()
