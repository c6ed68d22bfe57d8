"""A chat request prepared for the model: the tool history checked, the generic polyfill (no model)."""

from __future__ import annotations

import json

import pytest
from conftest import chat_format

from chat.grammar import ChatError
from chat.request import ChatFormat
from chat.template import ChatTemplate
from protocol import ChatMessage, Submit, Tool, ToolCall

TOOL = Tool(name="lookup", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
CALL = ToolCall(id="call_1", name="lookup", arguments='{"q": "x"}')


def prepare(messages: list[ChatMessage], fmt: ChatFormat | None = None, **kw: object) -> str:
    fmt = fmt or chat_format("Qwen-Qwen2.5-7B-Instruct")
    return fmt.prepare(Submit(messages=messages, tools=[TOOL], **kw)).text  # type: ignore[arg-type]


def user(text: str = "hi") -> ChatMessage:
    return ChatMessage(role="user", content=text)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([user(), ChatMessage(role="tool", tool_call_id="call_1", content="r")], "messages[1].tool_call_id"),
        (
            [
                user(),
                ChatMessage(role="assistant", tool_calls=[CALL]),
                ChatMessage(role="tool", tool_call_id="call_9", content="r"),
            ],
            "messages[2].tool_call_id",
        ),
    ],
)
def test_malformed_tool_history_names_the_field(messages: list[ChatMessage], param: str) -> None:
    with pytest.raises(ChatError) as info:
        prepare(messages)
    assert info.value.param == param


def test_calls_left_unanswered_render_as_they_are_and_the_conversation_goes_on() -> None:
    """Codex, after a reply cut off in its calls, sends them back unrun: OpenAI refuses that history, llama-server
    renders it, and so does kvroute (a refusal would end the session: every later turn sends the same history)."""
    second = ToolCall(id="call_2", name="lookup", arguments='{"q": "y"}')
    history = [
        user("find x"),
        ChatMessage(role="assistant", tool_calls=[CALL, second]),
        ChatMessage(role="tool", tool_call_id="call_1", content="found"),
        user("go on"),
    ]
    text = prepare(history)
    assert '{"name": "lookup", "arguments": {"q": "y"}}' in text  # the unanswered call, as the model wrote it
    assert "<tool_response>\nfound\n</tool_response>" in text
    assert text.index("found") < text.index("go on")
    # and a tool message after them answers no call: still refused, naming it
    with pytest.raises(ChatError) as info:
        prepare([*history, ChatMessage(role="tool", tool_call_id="call_2", content="late")])
    assert info.value.param == "messages[4].tool_call_id"


def test_a_well_formed_tool_history_renders_with_the_model_s_own_text() -> None:
    answered = [
        user("find x"),
        ChatMessage(role="assistant", content=None, tool_calls=[CALL]),
        ChatMessage(role="tool", tool_call_id="call_1", content="found"),
    ]
    text = prepare(answered)
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>' in text
    assert "<tool_response>\nfound\n</tool_response>" in text
    # a call the template has not been answered yet is fine at the end (the agent is about to run it)
    assert prepare(answered[:2]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct", "gemma"])
def test_a_call_cut_off_is_sent_back_and_rendered_as_the_model_wrote_it(template: str) -> None:
    """A call cut at max_tokens was streamed as a call; agents send it back with its result (Codex as the text, which
    is not JSON). It renders as written, so the prompt holds what the model wrote and the slot's KV is reused."""
    cut = '{"q": "lon'
    history = [
        user("find x"),
        ChatMessage(role="assistant", content=None, tool_calls=[ToolCall(id="c", name="lookup", arguments=cut)]),
        ChatMessage(role="tool", tool_call_id="c", content="InputValidationError"),
    ]
    fmt = ChatFormat(ChatTemplate.choose(None, None, "gemma")) if template == "gemma" else None
    text = prepare(history, fmt)
    assert '{"name": "lookup", "arguments": ' + cut in text
    assert "InputValidationError" in text


def test_developer_is_system_and_a_tool_result_gets_the_call_s_function_name() -> None:
    call = "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    calls = "{% for c in m.tool_calls or [] %}<tool_call>\n" + call + "\n</tool_call>{% endfor %}"  # (Hermes calls)
    src = "{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.content }}]" + calls + "{% endfor %}"
    fmt = ChatFormat(ChatTemplate(src, "probe"))
    text = fmt.prepare(
        Submit(
            messages=[
                ChatMessage(role="developer", content="d"),
                user(),
                ChatMessage(role="assistant", tool_calls=[CALL]),
                ChatMessage(role="tool", tool_call_id="call_1", content="r"),
            ],
            tools=[TOOL],
        )
    ).text
    assert text.startswith("[system||d]") and "[tool|lookup|r]" in text


def test_generic_polyfill_describes_tools_and_renders_calls_and_results_as_json() -> None:
    fmt = ChatFormat(ChatTemplate.choose(None, None, "gemma"))
    messages = [
        ChatMessage(role="system", content="Be brief."),
        user("find x"),
        ChatMessage(role="assistant", content=None, tool_calls=[CALL]),
        ChatMessage(role="tool", tool_call_id="call_1", content="found"),
        ChatMessage(role="assistant", content='Done: "found".'),
        user("thanks"),
    ]
    text = fmt.prepare(Submit(messages=messages, tools=[TOOL])).text
    assert text.startswith("<start_of_turn>user\nBe brief.\n\nYou can call these tools:\n")
    assert json.dumps({"name": "lookup", "description": "", "parameters": TOOL.parameters}) in text
    assert '<start_of_turn>model\n{"tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}<end_of_turn>' in text
    assert '<start_of_turn>user\n{"tool_response": {"name": "lookup", "content": "found"}}<end_of_turn>' in text
    assert '<start_of_turn>model\n{"response": "Done: \\"found\\"."}<end_of_turn>' in text
    plain = fmt.prepare(Submit(messages=[user("hi")])).text
    assert plain == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"  # no tools: nothing changes


def test_thinking_prompt_that_opens_the_tag_starts_the_reply_in_reasoning() -> None:
    r1 = chat_format("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    out = r1.prepare(Submit(messages=[user()], chat_template_kwargs={"enable_thinking": True})).output
    assert out.reasoning == ("<think>", "</think>") and out.in_reasoning
    qwen3 = chat_format("Qwen-Qwen3-0.6B")
    assert not qwen3.prepare(Submit(messages=[user()])).output.in_reasoning
