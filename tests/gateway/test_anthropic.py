"""Unit tests (no model) of Anthropic Messages (gateway/anthropic.py): request bodies -> protocol submits, and the
reply body, event stream and errors a client reads, via a stand-in router."""

from __future__ import annotations

from typing import Any

import anthropic as sdk
import httpx2
import pytest
from fake_router import FakeRouter, ScriptedRouter, client_for, events, result

from gateway import anthropic
from gateway.app import Gateway, build_app
from gateway.errors import RequestError
from gateway.fields import Policy
from kvroute.client import KvrouteError
from protocol import (
    ChatMessage,
    Delta,
    NamedTool,
    ResponseFormat,
    Result,
    Submit,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    {"type": "custom", "name": "Read", "input_schema": {"type": "object"}},
    {"type": "web_search_20250305", "name": "web_search"},  # a server tool: a hint, not offered to the model
]


def submit(**body: Any) -> Submit:
    return anthropic.messages_submit({"max_tokens": 16, "messages": USER, **body}, "r")[0]


# ---- requests ---------------------------------------------------------------------------------------------------


def test_system_as_a_string_or_text_blocks() -> None:
    assert (submit(system="be brief").messages or [])[0] == ChatMessage(role="system", content="be brief")
    blocks = [{"type": "text", "text": "A "}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}]
    assert (submit(system=blocks).messages or [])[0] == ChatMessage(role="system", content="A B")
    assert [m.role for m in submit().messages or []] == ["user"]


def test_turns_and_blocks_become_chat_messages() -> None:
    messages = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use ", "signature": "s"}, {"type": "thinking", "thinking": "Bash"},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls", "n": 1}},
            {"type": "tool_use", "id": "t2", "name": "Read", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "text", "text": "and?"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "file"}]},
        ]},
        {"role": "system", "content": "a reminder"},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    assert submit(messages=messages).messages == [
        ChatMessage(role="user", content=[TextPart(text="list files")]),
        ChatMessage(
            role="assistant",
            content=[TextPart(text="Listing.")],
            reasoning_content="use Bash",
            tool_calls=[
                ToolCall(id="t1", name="Bash", arguments='{"cmd": "ls", "n": 1}'),
                ToolCall(id="t2", name="Read", arguments="{}"),
            ],
        ),
        ChatMessage(role="tool", tool_call_id="t1", content="a.txt"),  # tool results first, after their calls
        ChatMessage(role="tool", tool_call_id="t2", content="Error: no file"),
        ChatMessage(role="user", content=[TextPart(text="and?")]),
        ChatMessage(role="system", content=[TextPart(text="a reminder")]),
        ChatMessage(role="assistant", content=[TextPart(text="ok")]),
    ]


def test_custom_tools_are_offered_and_server_tools_are_not() -> None:
    assert submit(tools=TOOLS).tools == [
        Tool(name="Bash", description="run", parameters={"type": "object", "properties": {"cmd": {"type": "string"}}}),
        Tool(name="Read", description="", parameters={"type": "object"}),
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, ("auto", True)),
        ({"type": "auto"}, ("auto", True)),
        ({"type": "any"}, ("required", True)),
        ({"type": "tool", "name": "Bash"}, (NamedTool(name="Bash"), True)),
        ({"type": "none"}, ("none", True)),
        ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", False)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
    ],
)
def test_tool_choice(choice: dict[str, Any] | None, expected: tuple[Any, bool]) -> None:
    sub = submit(tools=TOOLS, tool_choice=choice)
    assert (sub.tool_choice, sub.parallel_tool_calls) == expected


def test_sampling_stop_sequences_and_output_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sub = submit(max_tokens=99, temperature=0.3, top_k=20, top_p=0.8, stop_sequences=["\n\nHuman:", "", "END"],
                 deadline_ms=700, output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    s = sub.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.stop) == (99, 0.3, 20, 0.8, ["\n\nHuman:", "END"])
    assert sub.deadline_ms == 700 and sub.response_format == ResponseFormat(type="json_schema", schema=schema)
    s = submit().sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.stop) == (16, 1.0, 0, 1.0, [])


@pytest.mark.parametrize(
    ("thinking", "kwargs"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
        ({"type": "disabled"}, {"enable_thinking": False}),
        ({"type": "adaptive"}, {}),
        (None, {}),
    ],
)
def test_thinking_sets_the_templates_enable_thinking(thinking: dict[str, Any] | None, kwargs: dict[str, Any]) -> None:
    assert submit(thinking=thinking).chat_template_kwargs == kwargs
    explicit = submit(thinking=thinking, chat_template_kwargs={"enable_thinking": "mine"})
    assert explicit.chat_template_kwargs == {"enable_thinking": "mine"}  # the explicit kwargs win


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
        ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{"type": "text_editor_20250124", "name": "str_replace_editor"}]}, "tools[0].type"),
        ({"temperature": 1.5}, "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        anthropic.messages_submit({"max_tokens": 16, "messages": USER, **body}, "r")
    assert (info.value.status, info.value.param) == (400, param)


# ---- replies ----------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_reply_body_and_usage_counts_uncached_input() -> None:
    async with client_for(FakeRouter()) as c:
        body = (await c.post("/v1/messages", json={"model": "claude-x", "max_tokens": 2, "messages": USER})).json()
    assert body.pop("id").startswith("msg_")
    assert body == {
        "type": "message",
        "role": "assistant",
        "model": "gemma",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 5, "output_tokens": 2},
    }


@pytest.mark.parametrize(
    ("res", "stop_reason", "stop_sequence"),
    [
        (result(text="a"), "end_turn", None),
        (result(text="a", finish_reason="length"), "max_tokens", None),
        (result(text="a", stop="END"), "stop_sequence", "END"),
        (result(finish_reason="tool_calls", tool_calls=[ToolCall(id="t1", name="Bash", arguments="{}")]), "tool_use", None),
    ],
)
def test_stop_reasons(res: Result, stop_reason: str, stop_sequence: str | None) -> None:
    body = anthropic.message_body(res, "m")
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)


def test_reply_content_blocks_in_order() -> None:
    call = ToolCall(id="t1", name="Bash", arguments='{"cmd": "ls"}')
    body = anthropic.message_body(result(finish_reason="tool_calls", reasoning="hm", tool_calls=[call]), "m")
    assert body["id"] == "msg_r" and body["content"] == [  # no empty text block beside the call
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}},
    ]
    body = anthropic.message_body(result(text="ok", tool_calls=[call]), "m")
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]


@pytest.mark.anyio
async def test_stream_event_order() -> None:
    call = ToolCallDelta(index=0, id="t1", name="Bash", arguments='{"cmd": "ls"}')
    fake = ScriptedRouter(
        Delta(id="", text="", tokens=b"", reasoning="hm", usage=Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=0)),
        Delta(id="", text="ok", tokens=b""),
        Delta(id="", text="", tokens=b"", tool_calls=[call]),
        result(
            finish_reason="tool_calls", text="ok", reasoning="hm", tool_calls=[ToolCall(id="t1", name="Bash", arguments="{}")]
        ),
    )
    async with client_for(fake) as c:
        r = await c.post("/v1/messages", json={"max_tokens": 16, "messages": USER, "tools": TOOLS, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert all(d["type"] == k for k, d in evs)
    start = evs[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["model"]) == ([], None, "gemma")
    assert start["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 0,
    }
    assert [(k, d.get("index"), d.get("content_block") or d.get("delta")) for k, d in evs[1:-2]] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "hm"}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "ok"}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '{"cmd": "ls"}'}),
        ("content_block_stop", 2, None),
    ]
    assert evs[-2] == ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                       "usage": {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4,
                                 "output_tokens": 3}})  # fmt: skip
    assert evs[-1] == ("message_stop", {"type": "message_stop"})


@pytest.mark.anyio
async def test_count_tokens_tokenizes_the_same_rendering() -> None:
    fake = ScriptedRouter()
    body = {"model": "claude-x", "system": "s", "messages": USER, "tools": TOOLS[:1], "thinking": {"type": "disabled"}}
    async with client_for(fake) as c:
        r = await c.post("/v1/messages/count_tokens", json=body)
    assert (r.status_code, r.json()) == (200, {"input_tokens": 5})
    (tok,) = fake.tokenized
    assert [(m.role, m.text()) for m in tok.messages or []] == [("system", "s"), ("user", "hi")]
    assert [t.name for t in tok.tools or []] == ["Bash"] and tok.chat_template_kwargs == {"enable_thinking": False}
    assert fake.submits == []


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_missing_max_tokens_is_a_400_in_anthropics_shape() -> None:
    fake = FakeRouter()
    async with client_for(fake) as c:
        r = await c.post("/v1/messages", json={"messages": USER})
    assert r.status_code == 400 and fake.submits == []
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "invalid request: Object missing required field `max_tokens`"},
    }


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("no_workers", 529, "overloaded_error"),
        ("worker_lost", 529, "overloaded_error"),
        ("queue_full", 429, "rate_limit_error"),
        ("deadline_exceeded", 504, "timeout_error"),
        ("bad_request", 400, "invalid_request_error"),
        ("internal", 500, "api_error"),
    ],
)
async def test_router_errors_in_anthropics_shape(code: str, status: int, type_: str) -> None:
    fake = FakeRouter()
    fake.error = KvrouteError("it failed", code=code, retry_after_ms=3000)
    async with client_for(fake) as c:
        r = await c.post("/v1/messages", json={"max_tokens": 4, "messages": USER, "stream": True})
    assert r.status_code == status
    assert r.json() == {"type": "error", "error": {"type": type_, "message": "it failed"}}
    assert r.headers.get("retry-after") == ("3" if code == "queue_full" else None)


@pytest.mark.anyio
async def test_the_key_as_x_api_key_and_an_error_mid_stream() -> None:
    fake = ScriptedRouter(Delta(id="", text="Hel", tokens=b""), fail=KvrouteError("worker lost", code="worker_lost"))
    body = {"max_tokens": 4, "messages": USER, "stream": True}
    async with client_for(fake, api_key="k") as c:
        r = await c.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error", "message": "missing or wrong API key"}}
        r = await c.post("/v1/messages", json=body, headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    evs = events(r.text)
    assert [k for k, _ in evs] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert evs[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "worker lost"}}


# ---- thinking.display "omitted" -------------------------------------------------------------------------------------

OMITTED = {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}


def thought_script() -> list[Delta | Result]:
    return [
        Delta(id="", text="", tokens=b"", reasoning="The user wants "),
        Delta(id="", text="", tokens=b"", reasoning="a file listed."),
        Delta(id="", text="Listing.", tokens=b""),
        result(text="Listing.", reasoning="The user wants a file listed."),
    ]


def test_display_omitted_is_honoured_not_a_hint_and_the_model_still_thinks() -> None:
    def asked(thinking: dict[str, Any], policy: Policy | None = None) -> tuple[Submit, anthropic.Asked]:
        return anthropic.messages_request({"max_tokens": 16, "messages": USER, "thinking": thinking}, "r", policy)

    policy = Policy("messages", strict=True)
    sub, omitted = asked(OMITTED, policy)
    assert omitted.omit_thinking and sub.chat_template_kwargs == {"enable_thinking": True}
    assert set(policy.ignored) == {"thinking.budget_tokens"}
    assert not asked({**OMITTED, "display": "summarized"})[1].omit_thinking
    assert not asked({**OMITTED, "display": None})[1].omit_thinking
    assert asked({"type": "adaptive", "display": "omitted"})[1].omit_thinking  # (Claude Code's)
    with pytest.raises(RequestError) as info:
        asked({**OMITTED, "display": "full"})
    assert info.value.param == "thinking.display"


@pytest.mark.anyio
async def test_omitted_thinking_comes_with_no_text_and_its_signature_streamed_or_not() -> None:
    body = {"max_tokens": 16, "messages": USER, "thinking": OMITTED}
    async with client_for(ScriptedRouter(*thought_script())) as c:
        whole = (await c.post("/v1/messages", json=body)).json()
        streamed = events((await c.post("/v1/messages", json={**body, "stream": True})).text)
        shown = events((await c.post("/v1/messages", json={**body, "thinking": {"type": "enabled"}, "stream": True})).text)
    thought, text = whole["content"]
    assert thought["type"] == "thinking" and thought["thinking"] == "" and text == {"type": "text", "text": "Listing."}
    assert anthropic.signed_thinking(thought["signature"]) == "The user wants a file listed."
    assert [(k, d.get("index"), d.get("content_block") or d.get("delta")) for k, d in streamed[1:-2]] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "signature_delta", "signature": thought["signature"]}),  # (no thinking_delta)
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "Listing."}),
        ("content_block_stop", 1, None),
    ]
    assert streamed[-2][1]["usage"]["output_tokens"] == 3  # (the thinking's tokens were spent all the same)
    deltas = [d["delta"] for k, d in shown if k == "content_block_delta" and d["index"] == 0]
    assert deltas == [{"type": "thinking_delta", "thinking": "The user wants "},
                      {"type": "thinking_delta", "thinking": "a file listed."}]  # fmt: skip


def test_a_thinking_block_sent_back_with_its_signature_renders_the_thinking() -> None:
    """What Claude Code sends back: the blocks as it got them (empty text, the signature). The turn renders the
    thinking the model wrote, so that the next prompt extends this one and its reply."""
    sig = anthropic.signature("I should list the files.\nThen answer.")
    turns = [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": sig},
                                          {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]},
    ]  # fmt: skip
    msgs = submit(messages=turns, tools=TOOLS).messages or []
    assert msgs[1].reasoning_content == "I should list the files.\nThen answer."
    others = {"Anthropic's own": "EqQBCgIYAhIM", "corrupt": anthropic.SIGNED + "%%%", "not UTF-8": anthropic.SIGNED + "/w=="}
    for sig in others.values():
        turns[1]["content"][0]["signature"] = sig  # type: ignore[index]
        assert (submit(messages=turns, tools=TOOLS).messages or [])[1].reasoning_content == ""
    turns[1]["content"][0] = {"type": "thinking", "thinking": "mine", "signature": anthropic.signature("other")}  # type: ignore[index]
    assert (submit(messages=turns, tools=TOOLS).messages or [])[1].reasoning_content == "mine"  # (its text first)
    turns[1]["content"][0] = {"type": "thinking", "thinking": "", "signature": anthropic.signature("counted")}  # type: ignore[index]
    tokenize = anthropic.count_tokens_request({"messages": turns, "tools": TOOLS})  # (count_tokens renders it the same)
    assert (tokenize.messages or [])[1].reasoning_content == "counted"


@pytest.mark.anyio
async def test_the_anthropic_sdk_reads_an_omitted_thinking_stream() -> None:
    app = build_app(Gateway(ScriptedRouter(*thought_script()), "gemma", None))  # type: ignore[arg-type]
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://localhost") as http:
        client = sdk.AsyncAnthropic(api_key="-", base_url="http://localhost", http_client=http)  # (its SDK speaks httpx2)
        async with client.messages.stream(model="m", max_tokens=16, messages=USER, thinking=OMITTED) as stream:  # type: ignore[arg-type]
            message = await stream.get_final_message()
    thought, text = message.content
    assert thought.type == "thinking" and thought.thinking == "" and text.type == "text" and text.text == "Listing."
    assert anthropic.signed_thinking(thought.signature) == "The user wants a file listed."
