"""The families added for llama.cpp's LFM2 / LFM2.5, MiniMax-M3, Muse Glimmer, MiniCPM 5 and GigaChat 3 templates
(issue 63), with their real templates and no model: one, two and three calls (one where the template takes one)
read back from the text the template writes, fed a character at a time, the arguments streamed; the thinking where
the template writes it; and the next turn's prompt extending this one and the model's text."""

from __future__ import annotations

import json
from typing import Any

import pytest
import template_table as tt
from conftest import chat_format

from chat.template_probes import NAMES, REASONING, Probe, turn
from protocol import ChatMessage, Submit, ToolCall

USER = [ChatMessage(role="user", content="userprobe")]
CALLS: list[tuple[str, dict[str, Any]]] = [
    (NAMES[0], {"path": "src/it's.py", "content": "print('hi')\nif a < b & c:\n    x = 'q', y", "lines": 3}),
    (NAMES[1], {"query": "kv cache"}),
    (NAMES[0], {"path": "b.txt", "content": "", "lines": 0}),
]
MANY = ["LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct", "MiniMax-M3", "muse-glimmer", "openbmb-MiniCPM5-1B"]
THINKING = ["LFM2.5-8B-A1B", "LFM2.5-Instruct", "MiniMax-M3", "muse-glimmer", "openbmb-MiniCPM5-1B"]  # (past thinking kept)
FAMILY = {"LFM2-8B-A1B": "pythonic", "LFM2.5-8B-A1B": "pythonic", "LFM2.5-Instruct": "pythonic", "MiniMax-M3": "minimax-m3",
          "muse-glimmer": "muse", "openbmb-MiniCPM5-1B": "derived", "GigaChat3-10B-A1.8B": "derived"}  # fmt: skip


def model_turn(name: str, calls: list[tuple[str, dict[str, Any]]], reasoning: str | None = None) -> tuple[Any, Any, str]:
    """(format, first turn prepared, what the model writes for a turn of `calls`), thinking switched on or not."""
    fmt = chat_format(name)
    kwargs = tt.THINKING if reasoning else {}
    first = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS, chat_template_kwargs=kwargs))
    message = turn(calls)
    if reasoning:
        message["reasoning_content"] = reasoning
        if fmt.thinking_field:
            message["thinking"] = reasoning
    text = tt.model_text(Probe(fmt.template), first.text, message, first.output, kwargs or None)
    assert text is not None
    return fmt, first, text


def read_by_characters(spec: Any, text: str) -> tuple[Any, list[Any], list[int]]:
    """The parser after `text` fed a character at a time, the call deltas, and at which character each came."""
    parser = spec.parser()
    deltas, at = [], []
    for i, ch in enumerate(text):
        for d in parser.feed(ch).calls:
            deltas.append(d)
            at.append(i)
    for d in parser.finish().calls:
        deltas.append(d)
        at.append(len(text))
    return parser, deltas, at


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_family_is_detected(name: str) -> None:
    assert chat_format(name).family.name == FAMILY[name]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("name", [*MANY, "GigaChat3-10B-A1.8B"])
def test_calls_stream_back_character_by_character(name: str, n: int) -> None:
    if name.startswith("GigaChat3") and n > 1:
        pytest.skip("GigaChat 3's template writes a turn's first call only (llama.cpp reads one too)")
    calls = CALLS[:n]
    fmt, first, text = model_turn(name, calls)
    parser, deltas, at = read_by_characters(first.output, text)
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == calls, text
    assert parser.text == "" and parser.reasoning_text is None
    for k, call in enumerate(parser.tool_calls):
        own = [(i, d) for i, d in zip(at, deltas, strict=True) if d.index == k]
        assert own[0][1].name == call.name and own[0][1].id == call.id
        assert "".join(d.arguments for _, d in own) == call.arguments
        written = text.index("x = 'q'") if k == 0 else len(text)  # (the head went out before its arguments ended)
        assert own[0][0] < written
        assert len({i for i, d in own if d.arguments}) > 3  # (and the arguments as they came)
    history = [*USER, ChatMessage(role="assistant", content=None, tool_calls=[
        ToolCall(id=c.id or f"id{k}", name=c.name, arguments=c.arguments) for k, c in enumerate(parser.tool_calls)])]  # fmt: skip
    history += [ChatMessage(role="tool", tool_call_id=c.id, content="ok") for c in history[-1].tool_calls or []]
    following = fmt.prepare(Submit(messages=history, tools=tt.TOOLS)).text
    assert following.startswith(first.text + text.rstrip()), following[len(first.text) :][:300]


@pytest.mark.parametrize("name", THINKING)
def test_the_thinking_before_the_calls_is_read(name: str) -> None:
    _, first, text = model_turn(name, CALLS[:2], reasoning=REASONING + " (two lines\nof it)")
    parser, _, _ = read_by_characters(first.output, text)
    assert (parser.reasoning_text or "").strip() == REASONING + " (two lines\nof it)"
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == CALLS[:2] and parser.text == ""


# ---- pythonic (LFM2, LFM2.5) ----------------------------------------------------------------------------------------


def pythonic_spec() -> Any:
    return chat_format("LFM2.5-8B-A1B").prepare(Submit(messages=USER, tools=tt.TOOLS)).output


def test_pythonic_values_are_read_as_python_or_json_writes_them() -> None:
    text = (
        "Let me look. <|tool_call_start|>[fnprobetwo(query=\"it's\", n=None, on=True, off=false, f=-2.5, l=[1, 'a\\'b', "
        "{'k': None}], o={\"a\": [true, null]}), fnprobeone()]<|tool_call_end|>"
    )
    parser, _, _ = read_by_characters(pythonic_spec(), text)
    assert parser.text == "Let me look."
    (one, two) = [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]
    assert one == ("fnprobetwo", {"query": "it's", "n": None, "on": True, "off": False, "f": -2.5,
                                  "l": [1, "a'b", {"k": None}], "o": {"a": [True, None]}})  # fmt: skip
    assert two == ("fnprobeone", {})


@pytest.mark.parametrize(
    ("value", "closes_at"),
    [
        ("'a', b=1)", "'a'"),  # the quote before `, key=` closes it
        ("'x = f('y') + g('z')', b=1)", "'x = f('y') + g('z')'"),  # not before `) +`: no `]` or `,` after the `)`
        ("'it's')]", "'it's'"),
    ],
)
def test_a_pythonic_string_ends_at_the_quote_before_what_may_follow_a_value(value: str, closes_at: str) -> None:
    parser, _, _ = read_by_characters(pythonic_spec(), f"<|tool_call_start|>[fnprobetwo(query={value}]<|tool_call_end|>")
    assert json.loads(parser.tool_calls[0].arguments)["query"] == closes_at[1:-1]


def test_pythonic_grammar_writes_what_the_template_renders_and_no_string_the_reader_would_cut() -> None:
    from test_parallel_calls import admits

    fmt = chat_format("LFM2.5-8B-A1B")
    lark = "start: calls\n" + fmt.family.calls_rules(tt.TOOLS, True)
    _, _, text = model_turn("LFM2.5-8B-A1B", CALLS)
    assert admits(lark, text, len(text))
    bad = "<|tool_call_start|>[fnprobeone(path='a', lines=2', content='b')]<|tool_call_end|>"  # (read as path='a')
    assert not admits(lark, bad, len(bad))
    single = "start: calls\n" + fmt.family.calls_rules(tt.TOOLS, False)
    assert not admits(single, text, len(text)) and admits(single, model_turn("LFM2.5-8B-A1B", CALLS[:1])[2], 10)


def test_a_template_that_renders_no_calls_gets_them_in_the_content() -> None:
    """LFM2-8B-A1B's template writes an assistant message's content only: the calls go there, as the model wrote them."""
    fmt = chat_format("LFM2-8B-A1B")
    call = ToolCall(id="c1", name=NAMES[1], arguments='{"query": "a \'b\'"}')
    history = [*USER, ChatMessage(role="assistant", content="Looking.", tool_calls=[call]),
               ChatMessage(role="tool", tool_call_id="c1", content="found")]  # fmt: skip
    text = fmt.prepare(Submit(messages=history, tools=tt.TOOLS)).text
    assert "Looking.<|tool_call_start|>[fnprobetwo(query='a 'b'')]<|tool_call_end|><|im_end|>" in text
    history[1] = ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content="Plan.")
    text = chat_format("LFM2.5-Instruct").prepare(Submit(messages=history, tools=tt.TOOLS)).text
    assert "<think>Plan.</think><|tool_call_start|>[fnprobetwo(query='a 'b'')]<|tool_call_end|><|im_end|>" in text


# ---- MiniMax-M3 -----------------------------------------------------------------------------------------------------


def test_minimax_m3_reads_nested_elements_and_drops_the_bare_thinking_close() -> None:
    fmt = chat_format("MiniMax-M3")
    spec = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS)).output
    ns = "]<]minimax[>["
    text = (
        f'</mm:think>Checking.{ns}<tool_call>\n{ns}<invoke name="fnprobetwo">{ns}<query> a ]b [ {ns}</query>'
        f"{ns}<opts>{ns}<deep>{ns}<item>1{ns}</item>{ns}<item>x{ns}</item>{ns}</deep>{ns}<on>true{ns}</on>{ns}</opts>"
        f"{ns}</invoke>\n{ns}</tool_call>"
    )
    parser, _, _ = read_by_characters(spec, text)
    assert parser.text == "Checking." and parser.reasoning_text is None
    assert json.loads(parser.tool_calls[0].arguments) == {"query": " a ]b [ ", "opts": {"deep": [1, "x"], "on": True}}


def test_minimax_m3_forced_call_may_write_the_empty_thinking_first() -> None:
    from test_parallel_calls import admits

    fmt = chat_format("MiniMax-M3")
    forced = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS, tool_choice="required")).constraint
    _, _, text = model_turn("MiniMax-M3", CALLS[:1])
    assert forced is not None and text.startswith("</mm:think>") and admits(forced.grammar, text, len(text))
    assert admits(forced.grammar, "<mm:think>plan</mm:think>" + text[len("</mm:think>") :], len(text))


# ---- Muse Glimmer ---------------------------------------------------------------------------------------------------


def test_muse_messages_to_self_and_to_user_are_thinking_and_text() -> None:
    fmt = chat_format("muse-glimmer")
    spec = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS)).output
    parser, _, _ = read_by_characters(spec, " to=self<|message|>Think.<|eom|><|start|>assistant to=user<|message|>Hi!")
    assert (parser.reasoning_text, parser.text, parser.tool_calls) == ("Think.", "Hi!", [])
    plain = fmt.prepare(Submit(messages=USER)).output
    assert read_by_characters(plain, "<|message|>Just text")[0].text == "Just text"


def test_muse_grammar_waits_for_a_message_to_a_tool() -> None:
    from test_parallel_calls import admits

    fmt = chat_format("muse-glimmer")
    auto = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS)).constraint
    assert auto is not None and auto.triggers == [f" to={t.name}<|message|>" for t in tt.TOOLS]
    _, _, text = model_turn("muse-glimmer", CALLS[:2])
    assert text.startswith(auto.triggers[0]) and admits(auto.grammar, text, len(text))
    forced = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS, tool_choice="required")).constraint
    assert forced is not None and admits(forced.grammar, " to=self<|message|>plan<|eom|><|start|>assistant" + text, 10)


# ---- derived: MiniCPM 5 (CDATA), GigaChat 3 (its call a message of its own) -------------------------------------------


def test_minicpm5_strings_are_wrapped_in_cdata_exactly_where_the_template_wraps_them() -> None:
    from test_parallel_calls import admits

    fmt = chat_format("openbmb-MiniCPM5-1B")
    syntax = fmt.family.syntax
    assert syntax.string_wrap == ("<![CDATA[", "]]>", "<&\n")
    assert syntax.value_text("a<b") == "<![CDATA[a<b]]>" and syntax.value_text("a>b") == "a>b"
    lark = "start: calls\n" + fmt.family.calls_rules(tt.TOOLS, True)
    head = '<function name="fnprobetwo"><param name="query">'
    for value, ok in [("plain", True), ("<![CDATA[a\nb]]>", True), ("a\nb", False), ("<![CDATA[plain]]>", False)]:
        text = head + value + "</param></function>"
        assert admits(lark, text, len(text)) is ok, value


def test_gigachat3_calls_open_with_the_messages_end_and_only_a_call_opens_the_grammar() -> None:
    fmt = chat_format("GigaChat3-10B-A1.8B")
    auto = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS)).constraint
    assert auto is not None and auto.triggers == ["<|message_sep|>\n\nfunction call<|role_sep|>"]
    spec = fmt.prepare(Submit(messages=USER, tools=tt.TOOLS)).output
    text = 'Sure.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "fnprobetwo", "arguments": {"query": "x"}}'
    parser, _, _ = read_by_characters(spec, text)
    assert parser.text == "Sure." and [(c.name, c.arguments) for c in parser.tool_calls] == [("fnprobetwo", '{"query": "x"}')]


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_a_client_reading_direct_replies_reads_them_the_same(name: str) -> None:
    """(the reply format on the wire, `placed`, makes the same reader again)"""
    from chat.output import OutputSpec

    spec = chat_format(name).prepare(Submit(messages=USER, tools=tt.TOOLS)).output
    again = OutputSpec.from_wire(spec.wire())
    _, _, text = model_turn(name, CALLS[:1])
    here, there = ([(c.name, c.arguments) for c in read_by_characters(s, text)[0].tool_calls] for s in (spec, again))
    assert here == there and len(there) == 1
