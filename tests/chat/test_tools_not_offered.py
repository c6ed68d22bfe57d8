"""A template without tool syntax (the default model's, Gemma's) is not shown a request's tools unless a call is
required, its history has calls, or the operator said `--generic-tools` (issue 63: llama-server's behaviour; the 270M
model shown them called one tool 380 times in a row under Codex CLI)."""

from __future__ import annotations

from conftest import chat_format

from chat.request import ChatFormat
from chat.template import ChatTemplate
from protocol import ChatMessage, NamedTool, Submit, Tool, ToolCall

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [Tool(name="get_weather", description="Weather", parameters=CITY)]
ASK = [ChatMessage(role="user", content="Weather in Paris?")]


def gemma(generic_tools: bool = False) -> ChatFormat:
    return ChatFormat(ChatTemplate.choose(None, None, "gemma"), generic_tools=generic_tools)


def test_auto_and_none_render_as_without_tools() -> None:
    fmt = gemma()
    plain = fmt.prepare(Submit(messages=ASK))
    for choice in ("auto", "none"):
        sub = Submit(messages=ASK, tools=TOOLS, tool_choice=choice)
        p = fmt.prepare(sub)
        assert not fmt.offers(sub) and p.text == plain.text and "get_weather" not in p.text
        assert p.constraint is None  # (the model's text as it writes it, not a JSON document)
        assert p.output.family is None and not p.output.tool_names
    assert fmt.tool_format == "generic, only where a call is required (--generic-tools: always)"


def test_a_required_call_is_written_in_the_generic_format() -> None:
    fmt = gemma()
    for choice in ("required", NamedTool(name="get_weather")):
        sub = Submit(messages=ASK, tools=TOOLS, tool_choice=choice)
        p = fmt.prepare(sub)
        assert fmt.offers(sub) and "get_weather" in p.text and '{"tool_calls": [' in p.text
        assert p.constraint is not None and p.output.tool_names == frozenset({"get_weather"})


def test_a_history_with_calls_keeps_the_tools_in_view() -> None:
    """The turn after a forced call shows the tools as that turn did: its prompt extends the last one's."""
    fmt = gemma()
    forced = fmt.prepare(Submit(messages=ASK, tools=TOOLS, tool_choice="required"))
    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    answer = ChatMessage(role="tool", tool_call_id="c1", content="21 C")
    history = [*ASK, ChatMessage(role="assistant", tool_calls=[call]), answer]
    after = fmt.prepare(Submit(messages=history, tools=TOOLS))
    assert after.text.startswith(forced.text) and after.output.tool_names == frozenset({"get_weather"})


def test_the_decision_made_for_the_whole_request_holds_for_a_shifted_attempt() -> None:
    """--context-shift renders attempts that drop old turns: one without the turns holding calls still shows the tools
    the whole request was shown (the router decides once: router/prepare.py `_chat`)."""
    fmt = gemma()
    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    answer = ChatMessage(role="tool", tool_call_id="c1", content="21 C")
    whole = Submit(messages=[*ASK, ChatMessage(role="assistant", tool_calls=[call]), answer, *ASK], tools=TOOLS)
    shifted = Submit(messages=ASK, tools=TOOLS)  # (the turns with the call dropped)
    assert fmt.offers(whole) and not fmt.offers(shifted)
    assert "get_weather" in fmt.prepare(shifted, fmt.offers(whole)).text
    assert "get_weather" not in fmt.prepare(shifted).text


def test_generic_tools_offers_them_to_every_request() -> None:
    fmt = gemma(generic_tools=True)
    p = fmt.prepare(Submit(messages=ASK, tools=TOOLS))
    assert "get_weather" in p.text and p.constraint is not None
    assert fmt.tool_format == "generic"


def test_a_template_with_tool_syntax_is_always_offered_them() -> None:
    fmt = chat_format("Qwen-Qwen3-0.6B")
    p = fmt.prepare(Submit(messages=ASK, tools=TOOLS))
    assert "get_weather" in p.text and p.output.tool_names == frozenset({"get_weather"})
    assert fmt.tool_format == "hermes"
