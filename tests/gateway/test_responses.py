"""Unit tests (no model) of OpenAI Responses (gateway/responses.py): request bodies -> protocol submits, and the
reply body and event stream a client reads, via a stand-in router."""

from __future__ import annotations

from typing import Any

import pytest
from fake_router import FakeRouter, ScriptedRouter, client_for, events, result

from gateway import responses
from gateway.errors import RequestError
from kvroute.client import KvrouteError
from protocol import (
    ChatMessage,
    Delta,
    NamedTool,
    ResponseFormat,
    Submit,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

TOOLS = [
    {"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"}},
    {"type": "namespace", "name": "mcp__docs", "tools": [{"type": "function", "name": "search"}]},
    {"type": "web_search"},  # hosted: a hint, not offered to the model
]
CALLS = [ToolCall(id="c1", name="mcp__docs__search", arguments='{"q": "x"}'), ToolCall(id="c2", name="shell", arguments="{}")]


def submit(**body: Any) -> Submit:
    return responses.responses_submit(body, "r")[0]


# ---- requests ---------------------------------------------------------------------------------------------------


def test_string_input_with_instructions_and_defaults() -> None:
    sub, stream, _ = responses.responses_submit({"input": "hi", "instructions": "be brief"}, "r")
    assert sub.messages == [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    s = sub.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.logprobs) == (None, 1.0, 1.0, 0, 0.0, None)
    assert (sub.tools, sub.tool_choice, sub.parallel_tool_calls, sub.response_format) == (None, "auto", True, None)
    assert sub.chat_template_kwargs == {} and stream is False


def test_message_items_keep_their_roles_where_they_stand() -> None:
    sub = submit(
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": "q1"},  # no `type`: the API's easy input message
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
            {"role": "system", "content": "late"},
            {"role": "user", "content": [{"type": "input_text", "text": "q"}, {"type": "input_text", "text": "2"}]},
        ]
    )
    assert [(m.role, m.text()) for m in sub.messages or []] == [
        ("developer", "rules"),
        ("user", "q1"),
        ("assistant", "a1"),
        ("system", "late"),
        ("user", "q2"),
    ]


def test_reasoning_text_and_calls_are_one_assistant_turn_then_tool_messages() -> None:
    sub = submit(
        input=[
            {"role": "user", "content": "look"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "on it"}]},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call", "call_id": "c2", "name": "search", "namespace": "mcp__docs", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ]
    )  # fmt: skip
    assert sub.messages == [
        ChatMessage(role="user", content=[TextPart(text="look")]),
        ChatMessage(
            role="assistant",
            content=[TextPart(text="on it")],
            reasoning_content="think",
            tool_calls=[
                ToolCall(id="c1", name="shell", arguments='{"cmd": "ls"}'),
                ToolCall(id="c2", name="mcp__docs__search", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", tool_call_id="c1", content="a.txt"),
        ChatMessage(role="tool", tool_call_id="c2", content="xy"),
        ChatMessage(role="assistant", content=[TextPart(text="done")]),
    ]


def test_a_summary_only_reasoning_item_is_served() -> None:
    sub = submit(
        input=[
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}], "encrypted_content": "gAAA"},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
    )
    assert [m.role for m in sub.messages or []] == ["user", "assistant", "tool"]
    assert sub.messages[1].reasoning_content is None and sub.messages[1].tool_calls  # (Codex sends `content: null`)


def test_function_and_namespace_tools_are_offered_flat() -> None:
    sub = submit(input="hi", tools=TOOLS)
    assert sub.tools == [
        Tool(name="shell", description="run", parameters={"type": "object"}),
        Tool(name="mcp__docs__search", description="", parameters={}),
    ]
    assert responses.flat_name("ns_", "_f") == "ns__f"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "shell"}, NamedTool(name="shell")),
    ],
)
def test_tool_choice(choice: Any, expected: Any) -> None:
    sub = submit(input="hi", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert (sub.tool_choice, sub.parallel_tool_calls) == (expected, False)


def test_text_format_becomes_the_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    assert submit(input="hi", text={"format": fmt}).response_format == ResponseFormat(
        type="json_schema", schema=schema, name="answer"
    )
    assert submit(input="hi", text={"format": {"type": "json_object"}}).response_format == ResponseFormat(type="json_object")
    assert submit(input="hi", text={"format": {"type": "text"}}).response_format is None


def test_sampling_and_template_fields() -> None:
    sub = submit(input="hi", max_output_tokens=64, temperature=0.2, top_p=0.9, top_k=5, min_p=0.05, top_logprobs=3,
                 deadline_ms=500, reasoning={"effort": "low"})  # fmt: skip
    s = sub.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.logprobs) == (64, 0.2, 0.9, 5, 0.05, 3)
    assert (sub.deadline_ms, sub.chat_template_kwargs) == (500, {"reasoning_effort": "low", "enable_thinking": True})
    sub = submit(input="hi", reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True, "x": 1})
    assert sub.chat_template_kwargs == {"enable_thinking": True, "x": 1}  # the explicit kwargs win


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "tools": [{"name": "f"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": "hi", "temperature": 2.5}, "temperature"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.responses_submit(body, "r")
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.anyio
async def test_stored_state_is_a_400_with_param_before_any_submit() -> None:
    fake = FakeRouter()
    async with client_for(fake) as c:
        r = await c.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "previous_response_id", None)
    assert "previous_response_id" in err["message"] and fake.submits == []


# ---- replies ----------------------------------------------------------------------------------------------------

USAGE = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 5}, "output_tokens": 2,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}  # fmt: skip


def message_item(rid: str, text: str, index: int = 0) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": f"msg_{rid}_{index}", "role": "assistant", "status": "completed", "content": [part]}


@pytest.mark.anyio
async def test_reply_body() -> None:
    async with client_for(FakeRouter()) as c:
        body = (await c.post("/v1/responses", json={"input": "hi", "instructions": "be brief", "top_p": 0.5})).json()
    rid = body["id"].removeprefix("resp_")
    assert body["id"].startswith("resp_") and isinstance(body["created_at"], float)
    fixed = {"object": "response", "model": "gemma", "status": "completed", "incomplete_details": None, "error": None,
             "store": False, "previous_response_id": None}  # fmt: skip
    assert {k: body[k] for k in fixed} == fixed
    assert (body["instructions"], body["top_p"], body["temperature"], body["tool_choice"]) == ("be brief", 0.5, 1.0, "auto")
    assert body["text"] == {"format": {"type": "text"}} and body["tools"] == []
    assert body["output"] == [message_item(rid, "Hello")]
    assert body["usage"] == USAGE


def test_reply_items_in_order_with_namespaced_calls_apart() -> None:
    _, _, asked = responses.responses_submit({"input": "hi", "tools": TOOLS, "tool_choice": "required"}, "r")
    usage = Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=3, reasoning_tokens=2)
    res = result(finish_reason="tool_calls", text="ok", reasoning="hm", tool_calls=CALLS, usage=usage)
    body = responses.response_body(res, "r", "m", asked, 0.0, False)
    assert body["output"] == [
        {"type": "reasoning", "id": "rs_r_0", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
         "status": "completed"},
        message_item("r", "ok", 1),
        {"type": "function_call", "id": "fc_r_2", "call_id": "c1", "name": "search", "namespace": "mcp__docs",
         "arguments": '{"q": "x"}', "status": "completed"},
        {"type": "function_call", "id": "fc_r_3", "call_id": "c2", "name": "shell", "arguments": "{}", "status": "completed"},
    ]  # fmt: skip
    assert (body["status"], body["tool_choice"]) == ("completed", "required")
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 4} and body["usage"]["total_tokens"] == 13
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}  # (the router's count of the thinking)


@pytest.mark.anyio
async def test_stream_event_order_and_sequence_numbers() -> None:
    async with client_for(FakeRouter()) as c:
        r = await c.post("/v1/responses", json={"input": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert [k for k, _ in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert all(d["type"] == k for k, d in evs)
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    created, done = evs[0][1]["response"], evs[-1][1]["response"]
    rid = created["id"].removeprefix("resp_")
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    assert [d["delta"] for k, d in evs if k == "response.output_text.delta"] == ["Hel", "lo"]
    assert {k: v for k, v in evs[4][1].items() if k != "delta"} == {
        "type": "response.output_text.delta", "sequence_number": 4, "item_id": f"msg_{rid}_0", "output_index": 0,
        "content_index": 0, "logprobs": []}  # fmt: skip
    assert evs[6][1]["text"] == "Hello" and evs[8][1]["item"] == message_item(rid, "Hello")
    assert (done["status"], done["output"], done["usage"]) == ("completed", [message_item(rid, "Hello")], USAGE)


@pytest.mark.anyio
async def test_streamed_reasoning_and_a_namespaced_call() -> None:
    call = ToolCallDelta(index=0, id="c1", name="mcp__docs__search", arguments='{"q": "x"}')
    fake = ScriptedRouter(
        Delta(id="", text="", tokens=b"", reasoning="hm"),
        Delta(id="", text="", tokens=b"", tool_calls=[call]),
        result(finish_reason="tool_calls", reasoning="hm", tool_calls=CALLS[:1]),
    )
    async with client_for(fake) as c:
        evs = events((await c.post("/v1/responses", json={"input": "hi", "tools": TOOLS, "stream": True})).text)
    assert [k for k, _ in evs][2:] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert (evs[8][1]["name"], evs[8][1]["arguments"], evs[8][1]["output_index"]) == ("search", '{"q": "x"}', 1)
    final = evs[-1][1]["response"]["output"]
    assert [(i["type"], i.get("name"), i.get("namespace")) for i in final] == [
        ("reasoning", None, None),
        ("function_call", "search", "mcp__docs"),
    ]


@pytest.mark.anyio
async def test_router_errors_before_and_during_the_stream() -> None:
    fake = FakeRouter()
    fake.error = KvrouteError("no worker is up", code="no_workers")
    async with client_for(fake) as c:
        r = await c.post("/v1/responses", json={"input": "hi", "stream": True})
    assert r.status_code == 503
    assert r.json() == {
        "error": {"message": "no worker is up", "type": "service_unavailable", "param": None, "code": "no_workers"}
    }
    fake = ScriptedRouter(Delta(id="", text="Hel", tokens=b""), fail=KvrouteError("worker died", code="worker_lost"))
    async with client_for(fake) as c:
        evs = events((await c.post("/v1/responses", json={"input": "hi", "stream": True})).text)
    assert evs[-1] == ("error", {"type": "error", "code": "worker_lost", "message": "worker died", "param": None})


def test_an_output_of_no_call_is_read_as_context_not_refused() -> None:
    """Codex 0.x writes its goal's objective as a `function_call_output` with a `name` and `namespace` and no `call_id`
    (seen in a real run, bench/reports/2026-12-02/codex-runs-issue63.json: it was a 400 on every later turn)."""
    from gateway.fields import Policy

    policy = Policy("responses")
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
         "output": "Describe a goal"},
    ]  # fmt: skip
    messages = responses.to_messages(None, items, policy)
    assert [(m.role, m.text()) for m in messages] == [("user", "hi"), ("user", "Describe a goal")]
    assert "input[].function_call_output without call_id" in policy.ignored


def test_text_after_a_turn_s_calls_joins_their_message_so_their_outputs_still_answer_them() -> None:
    """A reply cut off in its calls ends in text (the call it was writing); Codex sends the calls, that message, then
    the outputs (a real run: 196 calls, then `, {"name": "...`, then 196 outputs, a 400 on every later turn)."""
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ', {"name": "'}]},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
    ]
    messages = responses.to_messages(None, items)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in messages[1].tool_calls or []] == ["c1", "c2"] and messages[1].text() == ', {"name": "'
