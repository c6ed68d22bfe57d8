"""Several tool calls in one reply on every API (issue 63; no model: a scripted router): each call streams with its
own index (Chat Completions' `tool_calls[].index`), its own output item (Responses, `output_index` and `call_id`) or
its own content block (Anthropic `tool_use`, `index`), in order, its arguments in the pieces they came in; the
bodies that do not stream hold the three calls whole. The router's deltas are shaped as the reader gives them out: a
piece can hold the end of one call's arguments and the head of the next."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from fake_router import ScriptedRouter, client_for, events, result

from gateway.app import Gateway, build_app
from protocol import Delta, Result, ToolCall, ToolCallDelta

CALLS = [
    ("call_a", "write_file", ['{"path": "a.py", ', '"content": "print(1)\\n", ', '"options": {"mode": "w"}}']),
    ("call_b", "search", ['{"query": "kv", ', '"limit": 5, "filters": {"tags": ["x", "y"]}}']),
    ("call_c", "run", ['{"cmd": "ls", ', '"timeout": 2.5}']),
]
WHOLE = {cid: "".join(pieces) for cid, _, pieces in CALLS}
NAMES = [name for _, name, _ in CALLS]
SCHEMA = {"type": "object"}
TOOLS_OAI = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in NAMES]
TOOLS_RESP = [{"type": "function", "name": n, "parameters": SCHEMA} for n in NAMES]
TOOLS_ANT = [{"name": n, "input_schema": SCHEMA} for n in NAMES]
USER = [{"role": "user", "content": "do three things"}]


def three_calls() -> list[Delta | Result]:
    """Text, then three calls: each head in a delta of its own or with the previous call's last piece."""

    def d(*pieces: ToolCallDelta, text: str = "") -> Delta:
        return Delta(id="", text=text, tokens=b"", tool_calls=list(pieces))

    (a, fa, pa), (b, fb, pb), (c, fc, pc) = CALLS
    return [
        d(text="On it."),
        d(ToolCallDelta(index=0, id=a, name=fa, arguments="")),
        d(ToolCallDelta(index=0, arguments=pa[0])),
        d(ToolCallDelta(index=0, arguments=pa[1])),
        d(ToolCallDelta(index=0, arguments=pa[2]), ToolCallDelta(index=1, id=b, name=fb, arguments=pb[0])),
        d(ToolCallDelta(index=1, arguments=pb[1]), ToolCallDelta(index=2, id=c, name=fc, arguments="")),
        d(ToolCallDelta(index=2, arguments=pc[0])),
        d(ToolCallDelta(index=2, arguments=pc[1])),
        result(
            finish_reason="tool_calls",
            text="On it.",
            tool_calls=[ToolCall(id=cid, name=name, arguments=WHOLE[cid]) for cid, name, _ in CALLS],
        ),
    ]


def sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


# ---- Chat Completions --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_chat_completions_streams_each_call_under_its_own_index() -> None:
    async with client_for(ScriptedRouter(*three_calls())) as c:
        body = {"messages": USER, "tools": TOOLS_OAI, "stream": True}
        r = await c.post("/v1/chat/completions", json=body)
    pieces = [p for ch in sse_data(r.text) if ch["choices"] for p in ch["choices"][0]["delta"].get("tool_calls", [])]
    heads = [p for p in pieces if "id" in p]
    assert [(p["index"], p["id"], p["type"], p["function"]["name"]) for p in heads] == [
        (k, cid, "function", name) for k, (cid, name, _) in enumerate(CALLS)
    ]
    assert [p["index"] for p in pieces] == sorted(p["index"] for p in pieces)
    for k, (cid, _, expected) in enumerate(CALLS):
        own = [p["function"]["arguments"] for p in pieces if p["index"] == k]
        assert "".join(own) == WHOLE[cid] and [a for a in own if a] == expected
    finish = [ch["choices"][0]["finish_reason"] for ch in sse_data(r.text) if ch["choices"]]
    assert finish[-1] == "tool_calls"


@pytest.mark.anyio
async def test_the_openai_sdk_assembles_the_three_calls() -> None:
    async with client_for(ScriptedRouter(*three_calls())) as http:
        client = openai.AsyncOpenAI(api_key="-", base_url="http://localhost/v1", http_client=http)
        calls: dict[int, dict[str, str]] = {}
        stream = await client.chat.completions.create(model="m", messages=USER, tools=TOOLS_OAI, stream=True)  # type: ignore[arg-type]
        async for chunk in stream:
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += tc.id or ""
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
        whole = await client.chat.completions.create(model="m", messages=USER, tools=TOOLS_OAI)  # type: ignore[arg-type]
    assert [calls[k] for k in sorted(calls)] == [{"id": cid, "name": n, "arguments": WHOLE[cid]} for cid, n, _ in CALLS]
    got = [(t.id, t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
    assert got == [(cid, n, WHOLE[cid]) for cid, n, _ in CALLS]


# ---- Responses ---------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_responses_streams_each_call_as_its_own_function_call_item() -> None:
    async with client_for(ScriptedRouter(*three_calls())) as c:
        r = await c.post("/v1/responses", json={"input": "x", "tools": TOOLS_RESP, "stream": True})
    evs = events(r.text)
    added = [d for k, d in evs if k == "response.output_item.added" and d["item"]["type"] == "function_call"]
    got = [(d["output_index"], d["item"]["call_id"], d["item"]["name"], d["item"]["arguments"]) for d in added]
    assert got == [(k + 1, cid, name, "") for k, (cid, name, _) in enumerate(CALLS)]  # (the message is item 0)
    ids = [d["item"]["id"] for d in added]
    assert len(set(ids)) == 3
    for item_id, (cid, name, expected) in zip(ids, CALLS, strict=True):
        deltas = [d["delta"] for k, d in evs if k == "response.function_call_arguments.delta" and d["item_id"] == item_id]
        assert deltas == expected
        (done,) = [d for k, d in evs if k == "response.function_call_arguments.done" and d["item_id"] == item_id]
        assert (done["name"], done["arguments"]) == (name, WHOLE[cid])
    # each call's item is done before the next one is added
    order = [(k, d["output_index"]) for k, d in evs if k in ("response.output_item.added", "response.output_item.done")]
    assert order == [(k, i) for i in range(4) for k in ("response.output_item.added", "response.output_item.done")]
    final = evs[-1][1]["response"]["output"]
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in final] == [("message", None, None)] + [
        ("function_call", cid, WHOLE[cid]) for cid, _, _ in CALLS
    ]


@pytest.mark.anyio
async def test_a_responses_body_holds_the_three_calls_in_order() -> None:
    async with client_for(ScriptedRouter(*three_calls())) as c:
        body = (await c.post("/v1/responses", json={"input": "x", "tools": TOOLS_RESP})).json()
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in calls] == [(cid, n, WHOLE[cid]) for cid, n, _ in CALLS]
    assert len({i["id"] for i in calls}) == 3


# ---- Anthropic Messages ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_anthropic_streams_each_call_as_its_own_tool_use_block() -> None:
    async with client_for(ScriptedRouter(*three_calls())) as c:
        body = {"max_tokens": 99, "messages": USER, "tools": TOOLS_ANT, "stream": True}
        r = await c.post("/v1/messages", json=body)
    evs = events(r.text)
    starts = [(d["index"], d["content_block"]) for k, d in evs if k == "content_block_start"]
    assert starts == [(0, {"type": "text", "text": ""})] + [
        (k + 1, {"type": "tool_use", "id": cid, "name": name, "input": {}}) for k, (cid, name, _) in enumerate(CALLS)
    ]
    for k, (_, _, expected) in enumerate(CALLS, 1):
        parts = [d["delta"]["partial_json"] for kind, d in evs if kind == "content_block_delta" and d["index"] == k]
        assert parts == expected
    # blocks one after the other: each stops before the next starts
    order = [(k, d["index"]) for k, d in evs if k in ("content_block_start", "content_block_stop")]
    assert order == [(k, i) for i in range(4) for k in ("content_block_start", "content_block_stop")]
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.anyio
async def test_the_anthropic_sdk_assembles_the_three_tool_use_blocks() -> None:
    app = build_app(Gateway(ScriptedRouter(*three_calls()), "gemma", None))  # type: ignore[arg-type]
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost") as http:
        client = anthropic.AsyncAnthropic(api_key="-", base_url="http://localhost", http_client=http)  # (httpx2: its SDK's)
        async with client.messages.stream(model="m", max_tokens=99, messages=USER, tools=TOOLS_ANT) as stream:  # type: ignore[arg-type]
            message = await stream.get_final_message()
        whole = await client.messages.create(model="m", max_tokens=99, messages=USER, tools=TOOLS_ANT)  # type: ignore[arg-type]
    expected = [(cid, n, json.loads(WHOLE[cid])) for cid, n, _ in CALLS]
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == expected
    assert [(b.id, b.name, b.input) for b in whole.content if b.type == "tool_use"] == expected
