"""Unit tests (no model) of the field policy (gateway/fields.py) in each dialect: hints are served and counted,
refusals name the field, unknown fields are hints unless --strict-api."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_router import FakeRouter, client_for
from prometheus_client import REGISTRY

from gateway import anthropic, responses
from gateway.errors import RequestError
from gateway.fields import HINTS, REFUSED, Policy, pattern
from gateway.openai_chat import chat_submit, completion_submit
from kvroute.client import KvrouteError
from protocol import Overflow

USER = [{"role": "user", "content": "hi"}]


def counted(api: str, field: str) -> float:
    return REGISTRY.get_sample_value("kvroute_request_fields_ignored_total", {"api": api, "field": field}) or 0.0


def test_pattern_drops_indices() -> None:
    assert pattern("tools[3].tools[12].strict") == "tools[].tools[].strict"
    assert pattern("metadata") == "metadata"


def test_every_api_has_a_policy() -> None:
    assert set(HINTS) == set(REFUSED) == {"chat", "completions", "responses", "messages", "embeddings", "rerank"}


def test_embeddings_fields_are_honoured_hinted_or_refused() -> None:
    from gateway.embeddings import embed_message
    from gateway.errors import RequestError

    policy = Policy("embeddings")
    msg, body = embed_message({"input": ["a", "b"], "user": "u1", "x_new_field": 1, "encoding_format": "base64"}, policy, "last")
    assert msg.input == ["a", "b"] and msg.pooling == "last" and body.encoding_format == "base64"
    assert policy.ignored == ["user", "x_new_field"]  # served, and counted as hints
    msg, _ = embed_message({"input": [2, 10, 11]}, Policy("embeddings"), "mean")
    assert msg.tokens is not None and len(msg.tokens) == 1  # one input as token ids
    with pytest.raises(RequestError, match="x_new_field"):
        embed_message({"input": "a", "x_new_field": 1}, Policy("embeddings", strict=True), "mean")
    for bad in ({"input": [["a"]]}, {"input": [[]]}, {"input": ""}, {"input": "a", "encoding_format": "int8"}):
        with pytest.raises(RequestError) as err:
            embed_message(bad, Policy("embeddings"), "mean")
        assert err.value.param in ("input", "encoding_format"), bad


def test_embeddings_pooling_auto_leaves_it_to_the_router() -> None:
    from gateway.embeddings import embed_message

    msg, _ = embed_message({"input": "a"}, Policy("embeddings"), "auto")
    assert msg.pooling is None  # the router picks the model's own (router/server.py)


def test_rerank_fields_are_honoured_hinted_or_refused() -> None:
    from gateway.rerank import rerank_message, rerank_reply
    from protocol import Ranked

    policy = Policy("rerank")
    documents = ["a", {"text": "b", "title": "B"}]
    raw = {"query": "q", "documents": documents, "top_n": 1, "return_documents": True, "raw_scores": False, "x": 1}
    msg, body = rerank_message(raw, policy)
    assert msg.query == "q" and msg.documents == ["a", "b"] and msg.model is None
    assert policy.ignored == ["raw_scores", "documents[].title", "x"]  # served, and counted as hints
    got = Ranked(id="r", scores=[0.1, 0.9], prompt_tokens=12, cached_tokens=4)
    assert rerank_reply(got, msg, body, "m") == {  # Jina's shape (Cohere's clients read it too), best first, top_n
        "model": "m",
        "object": "list",
        "usage": {"prompt_tokens": 12, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 4}},
        "results": [{"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}],
    }
    msg, body = rerank_message({"query": "q", "texts": ["a", "b"], "return_text": True}, Policy("rerank"))
    assert rerank_reply(got, msg, body, "m") == [  # TEI's shape: a bare list
        {"index": 1, "score": 0.9, "text": "b"},
        {"index": 0, "score": 0.1, "text": "a"},
    ]
    for bad, param in (
        ({"documents": ["a"]}, "query"),
        ({"query": 1, "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": [1, 2]}, "documents[0]"),
        ({"query": "q", "documents": [{"image": "x"}]}, "documents[0]"),
        ({"query": "q", "texts": []}, "texts"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ):
        with pytest.raises(RequestError) as err:
            rerank_message(bad, Policy("rerank"))
        assert err.value.param == param, (bad, err.value.param, err.value)
    with pytest.raises(RequestError, match="x_new"):
        rerank_message({"query": "q", "documents": ["a"], "x_new": 1}, Policy("rerank", strict=True))


@pytest.mark.parametrize(
    ("api", "submit", "body"),
    [
        ("chat", chat_submit, {"messages": USER}),
        ("completions", completion_submit, {"prompt": "hi"}),
        ("responses", responses.responses_submit, {"input": "hi"}),
        ("messages", anthropic.messages_submit, {"messages": USER, "max_tokens": 5}),
    ],
)
def test_an_unknown_field_is_a_hint_and_counted_unless_strict(api: str, submit: Any, body: dict[str, Any]) -> None:
    before = counted(api, "other")
    policy = Policy(api)
    submit({**body, "x_new_client_field": {"a": 1}}, "r", policy)
    assert policy.ignored == ["x_new_client_field"]  # (named in the log line)
    policy.report("r")
    assert counted(api, "other") == before + 1  # (counted as a name no client of ours sends)
    with pytest.raises(RequestError, match="strict-api") as info:
        submit({**body, "x_new_client_field": 1}, "r", Policy(api, strict=True))
    assert info.value.param == "x_new_client_field"


def test_known_hints_pass_even_strict() -> None:
    policy = Policy("chat", strict=True)
    body = {"messages": USER, "user": "u", "metadata": {"k": "v"}, "prompt_cache_key": "p", "reasoning_effort": "low"}
    sub, _, _ = chat_submit(body, "r", policy)
    assert policy.ignored == ["metadata"]
    assert sub.session == "p"  # (honoured: the request's session, gateway/sessions.py)
    assert sub.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}  # (honoured: it reaches the template)


def test_nested_unknown_fields_are_named_by_pattern() -> None:
    policy = Policy("chat")
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}, "x_extra": i}} for i in range(3)]
    sub, _, _ = chat_submit({"messages": USER, "tools": tools}, "r", policy)
    assert [t.name for t in sub.tools or []] == ["f0", "f1", "f2"]
    assert policy.ignored == ["tools[].function.x_extra"]
    tools = [{"type": "function", "function": {"name": "f", "x_extra": 1}}]  # (a decode strips hints in place)
    with pytest.raises(RequestError) as info:
        chat_submit({"messages": USER, "tools": tools}, "r", Policy("chat", strict=True))
    assert info.value.param == "tools[0].function.x_extra"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "audio": {"voice": "alloy"}}, "audio"),
        ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
        ({"messages": USER, "mirostat": 2}, "mirostat"),
        ({"messages": USER, "typical_p": 0.5}, "typical_p"),
    ],
)
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        chat_submit(body, "r")
    assert info.value.param == param


def test_a_llama_sampler_at_its_neutral_value_is_served() -> None:
    chat_submit({"messages": USER, "mirostat": 0, "typical_p": 1.0, "modalities": ["text"]}, "r")


# ---- Responses (Codex CLI's request shape) ----------------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"}, "strict": False},
    {
        "type": "namespace",
        "name": "mcp__docs",
        "description": "an MCP server",
        "tools": [{"type": "function", "name": "search", "parameters": {"type": "object"}, "strict": False}],
    },
    {"type": "web_search", "external_web_access": False},
]


def codex_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5.1-codex",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-thread",
        "client_metadata": {"x": "y"},
        "text": {"verbosity": "low"},
        **extra,
    }


def test_codex_request_is_served_with_its_hints_named() -> None:
    policy = Policy("responses", strict=True)
    sub, stream, asked = responses.responses_submit(codex_body(), "r", policy)
    assert stream and [t.name for t in sub.tools or []] == ["shell", "mcp__docs__search"]
    assert [m.role for m in sub.messages or []] == ["system", "developer", "user"]
    assert sub.chat_template_kwargs == {"reasoning_effort": "medium", "enable_thinking": True}
    assert sub.session == "019a-thread"  # (Codex's conversation, as its prompt_cache_key: honoured)
    assert set(policy.ignored) >= {
        "store",
        "include",
        "client_metadata",
        "reasoning.summary",
        "text.verbosity",
        "tools[].strict",
        "tools[].tools[].strict",
        "tools[].type=web_search",
        "tools[].external_web_access",
    } - {"tools[].external_web_access"}
    assert asked.call_names("mcp__docs__search") == {"name": "search", "namespace": "mcp__docs"}
    assert asked.call_names("shell") == {"name": "shell"}


def test_a_namespaced_call_in_the_history_renders_as_offered() -> None:
    body = codex_body()
    body["input"] += [
        {"type": "function_call", "call_id": "c1", "name": "search", "namespace": "mcp__docs", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "found"},
    ]
    sub, _, _ = responses.responses_submit(body, "r")
    (call,) = (sub.messages or [])[-2].tool_calls or []
    assert call.name == "mcp__docs__search"


def test_reasoning_effort_none_turns_thinking_off() -> None:
    sub, _, _ = responses.responses_submit(codex_body(reasoning={"effort": "none"}), "r")
    assert sub.chat_template_kwargs == {"enable_thinking": False}
    sub, _, _ = responses.responses_submit(codex_body(reasoning={"effort": "high"}), "r")
    assert sub.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}
    sub, _, _ = chat_submit({"messages": USER, "reasoning_effort": "none", "chat_template_kwargs": {"x": 1}}, "r")
    assert sub.chat_template_kwargs == {"x": 1, "enable_thinking": False}


@pytest.mark.parametrize("field", ["previous_response_id", "conversation", "background"])
def test_responses_refuses_what_needs_stored_state(field: str) -> None:
    with pytest.raises(RequestError, match=field) as info:
        responses.responses_submit(codex_body(**{field: "resp_1" if field != "background" else True}), "r")
    assert info.value.param == field


def test_a_function_call_reply_gives_the_namespace_back() -> None:
    from protocol import Result, Timings, ToolCall, Usage

    _, _, asked = responses.responses_submit(codex_body(), "r")
    call = ToolCall(id="c9", name="mcp__docs__search", arguments='{"q": "x"}')
    result = Result(
        id="r",
        text="",
        tokens=b"",
        finish_reason="tool_calls",
        tool_calls=[call],
        usage=Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=2),
        timings=Timings(),
        worker="w0",
        slot=0,
    )
    body = responses.response_body(result, "r", "m", asked, 0.0, False)
    (item,) = body["output"]
    assert (item["type"], item["name"], item["namespace"], item["call_id"]) == ("function_call", "search", "mcp__docs", "c9")


# ---- Anthropic Messages (Claude Code's request shape) -----------------------------------------------------------


def claude_code_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b3;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "A reminder from the harness."},
        ],
        "tools": [
            {"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
            {"name": "Later", "description": "deferred", "input_schema": {"type": "object"}, "defer_loading": True},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "metadata": {"user_id": "user_abc_session_123"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        **extra,
    }


def test_claude_code_request_is_served_with_its_hints_named() -> None:
    policy = Policy("messages", strict=True)
    sub, stream = anthropic.messages_submit(claude_code_body(), "r", policy)
    assert stream and [t.name for t in sub.tools or []] == ["Bash", "Later"]
    roles = [m.role for m in sub.messages or []]
    assert roles == ["system", "user", "system"]
    assert (sub.messages or [])[0].text().startswith("x-anthropic-billing-header: cc_version=2.1; cch=fffff;")
    assert sub.session == "123"  # (honoured: metadata.user_id names the session)
    assert set(policy.ignored) == {
        "context_management",
        "output_config.effort",
        "system[].cache_control",
        "messages[].content[].cache_control",
        "tools[].defer_loading",
        "tools[].type=web_search",
    }
    assert "enable_thinking" not in sub.chat_template_kwargs  # adaptive: the template's default


def test_claude_code_sessions_share_their_system_prompt() -> None:
    """The billing header's session fingerprint (cc_version's fourth part, from the session's first message) and its
    request stamp (cch) are written as f's: two sessions' prompts are the same up to their first message."""

    def system_of(header: str, first: str) -> str:
        body = claude_code_body(messages=[{"role": "user", "content": first}])
        body["system"][0]["text"] = header
        sub, _ = anthropic.messages_submit(body, "r", Policy("messages"))
        return (sub.messages or [])[0].text()

    a = system_of("x-anthropic-billing-header: cc_version=2.1.328.2c2; cc_entrypoint=sdk-cli;", "hello")
    b = system_of("x-anthropic-billing-header: cc_version=2.1.328.3ba; cc_entrypoint=sdk-cli;", "write an essay")
    assert a == b and a.startswith("x-anthropic-billing-header: cc_version=2.1.328.fff; cc_entrypoint=sdk-cli;")
    c = system_of("x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli; cch=0a1b2;", "hi")
    assert c.startswith("x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli; cch=fffff;")
    plain = anthropic.messages_submit(claude_code_body(system="You are helpful. cc_version=1.2.3.abc;"), "r", Policy("messages"))
    assert (plain[0].messages or [])[0].text() == "You are helpful. cc_version=1.2.3.abc;"  # (not a billing header)


def test_anthropic_schema_client_tools_are_refused() -> None:
    body = claude_code_body(tools=[{"type": "bash_20250124", "name": "bash"}])
    with pytest.raises(RequestError, match="bash_20250124") as info:
        anthropic.messages_submit(body, "r")
    assert info.value.param == "tools[0].type"


def test_anthropic_unknown_field_strict() -> None:
    with pytest.raises(RequestError) as info:
        anthropic.messages_submit(claude_code_body(brand_new=1), "r", Policy("messages", strict=True))
    assert info.value.param == "brand_new"


def test_count_tokens_takes_the_same_body() -> None:
    body = claude_code_body()
    for key in ("max_tokens", "stream", "metadata"):
        body.pop(key)
    tok = anthropic.count_tokens_request(body)
    assert [m.role for m in tok.messages or []] == ["system", "user", "system"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "words",
    [
        "prompt of 32729 tokens + max_tokens 64 does not fit a slot of 32768 tokens",  # the router's
        "prompt of 32729 tokens + max_tokens 64 = 32793 is over a slot's context of 32768 tokens",  # a worker's
    ],
)
async def test_a_context_overflow_reads_in_each_api_s_own_words(words: str) -> None:
    # Claude Code compacts its conversation on Anthropic's wording, and stops on any other; the wording is made from
    # the error's numbers, whoever refused the prompt and in whatever words
    fake = FakeRouter()
    numbers = Overflow(prompt_tokens=32729, max_tokens=64, context=32768)
    fake.error = KvrouteError(words, code="context_overflow", overflow=numbers)
    async with client_for(fake) as c:
        r = await c.post("/v1/messages", json={"max_tokens": 64, "messages": USER})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt is too long: 32793 tokens > 32768 maximum"
        # OpenAI's code and words (Codex compacts on the code; many clients match "maximum context length"), then ours
        r = await c.post("/v1/chat/completions", json={"messages": USER})
        error = r.json()["error"]
        assert (r.status_code, error["code"]) == (400, "context_length_exceeded")
        assert error["message"] == (
            "This model's maximum context length is 32768 tokens. However, you requested 32793 tokens (32729 in the "
            f"messages, 64 in the completion). Please reduce the length of the messages or completion. ({words})"
        )
        # a Responses stream says it in its own events (Codex reads `response.failed` with OpenAI's code, and
        # compacts; an HTTP 400 it takes for a request never to send again), a Responses body as an HTTP 400
        r = await c.post("/v1/responses", json={"input": "hi", "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and [e["type"] for e in events] == ["response.created", "response.failed"]
        failed = events[1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
        assert failed["error"]["message"] == error["message"]
        r = await c.post("/v1/responses", json={"input": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
