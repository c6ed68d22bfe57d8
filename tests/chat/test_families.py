"""Tool-call families with their real templates: detection, the grammar (checked with llguidance over the default
model's vocabulary), parsing of recorded model outputs, and prefix stability over a 10-step tool loop (no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import chat_format
from hypothesis import given, settings
from hypothesis import strategies as st

from chat.families import Generic
from chat.family_detection import detect
from chat.grammar import ChatError, constraint
from chat.output import OutputSpec
from chat.section_parser import SectionParser
from chat.template import ChatTemplate
from common.slots import common_prefix
from common.vocab import Vocab
from protocol import ChatMessage, NamedTool, Submit, Tool, ToolCall
from worker.guide import Guide, GuideTokenizer

WEATHER = Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
)
SEARCH = Tool(name="search", description="Search the web", parameters={"type": "object", "properties": {"q": {"type": "string"}}})
TOOLS = [WEATHER, SEARCH]
ARGS = '{"city": "Paris", "days": 3}'

# one call to get_weather(ARGS), as each family's grammar writes it (and as its template renders it back)
ONE_CALL = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": ' + ARGS + "}",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + ', "id": "abcDEF123"}]',
    "mistral-args": "[TOOL_CALLS]get_weather[ARGS]" + ARGS,
    "mistral-args-ids": "[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]" + ARGS,
    "gemma": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": ' + ARGS + "}]}",
}

FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args",
    "unsloth-mistral-Devstral-Small-2507": "mistral-args",
    "google-gemma-4-31B-it": "gemma",
    "google-gemma-2-2b-it": "generic",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "derived",  # (DeepSeek R1's call syntax, derived from its template)
}
# Templates that render the history of a tool loop exactly as the model wrote it. The others change it by
# design: Mistral Nemo moves the system prompt to the last user turn, Gemma 4 drops the empty thought channel its
# generation prompt opens, DeepSeek R1 drops `<think>...</think>`, Hermes 2 Pro ends a tool result with a newline
# only when a message follows it; for them the token-LCP salvage reuses what matches.
STABLE = {
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "unsloth-mistral-Devstral-Small-2507",
    "google-gemma-2-2b-it",
    "builtin:gemma",
}


def fmt_for(name: str) -> Any:
    """A template's format, templates without tool syntax offered tools in the generic format (`--generic-tools`)."""
    if name.startswith("builtin:"):
        from chat.request import ChatFormat
        from chat.template import ChatTemplate

        return ChatFormat(ChatTemplate.choose(None, None, name.split(":")[1]), generic_tools=True)
    return chat_format(name, generic_tools=True)


def one_call(fmt: Any, args: str = ARGS, call_id: str = "abcDEF123") -> str:
    family = fmt.family
    if family.name == "derived":  # (the syntax writes what the template would)
        return family.syntax.write([("get_weather", json.loads(args), call_id)])
    key = "mistral-args-ids" if family.name == "mistral-args" and family.call_ids else family.name
    text = ONE_CALL[key].replace(ARGS, args).replace("abcDEF123", call_id)
    if family.name == "gemma":  # Gemma writes the arguments in its own syntax
        a = json.loads(args)
        body = ",".join(f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{v}" for k, v in sorted(a.items()))
        text = f"<|tool_call>call:get_weather{{{body}}}<tool_call|>"
    return text


def parse(spec: OutputSpec, text: str, chunks: list[int] | None = None) -> tuple[str, str | None, list[tuple[str, str, str]]]:
    """(content, reasoning, [(id, name, arguments)]) after feeding `text` whole or in chunks of the given sizes."""
    p = SectionParser(spec)
    i = 0
    for n in chunks or []:
        p.feed(text[i : i + n])
        i += n
    p.feed(text[i:])
    p.finish()
    return p.text, p.reasoning_text, [(c.id or "", c.name, c.arguments) for c in p.tool_calls]


def accepts(tokenizer: GuideTokenizer, vocab: Vocab, lark: Any, text: str) -> bool:
    """Whether the grammar takes `text` (as the model would write it) to a complete, accepting state."""
    guide = Guide(lark, tokenizer)
    for tok in vocab.tokenize(text, add_special=False, parse_special=False):
        if guide.done:
            return False  # the grammar was complete: the worker would have ended the reply here
        guide.follow(tok)
        if guide.failed:
            return False
    return guide.matcher is not None and guide.matcher.is_accepting()


def spec_for(fmt: Any, tools: list[Tool] = TOOLS) -> OutputSpec:
    return OutputSpec(family=fmt.family, tool_names=frozenset(t.name for t in tools), reasoning=fmt.reasoning)


@pytest.mark.parametrize(("name", "family"), sorted(FAMILIES.items()))
def test_the_family_is_detected_from_the_template(name: str, family: str) -> None:
    assert chat_format(name).family.name == family


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_required_call_grammar_parser_and_rendering_agree(name: str, vocab: Vocab, guide_tokenizer: GuideTokenizer) -> None:
    """The grammar for tool_choice=required accepts the family's call text, the parser takes the call out of it,
    and (for prefix-stable templates) the next turn's prompt starts with this prompt and that text."""
    fmt = chat_format(name)
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather in Paris?")]
    sub = Submit(messages=msgs, tools=TOOLS, tool_choice="required")
    prepared = fmt.prepare(sub)
    reply = one_call(fmt)
    assert prepared.constraint is not None and not prepared.constraint.triggers
    if "▁" not in reply:  # (DeepSeek's markers hold `▁`, which the default model's vocabulary writes as a space)
        assert accepts(guide_tokenizer, vocab, prepared.constraint, reply), reply
    content, _, calls = parse(prepared.output, reply)
    assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", json.loads(ARGS))]
    call_id = calls[0][0]
    msgs += [
        ChatMessage(role="assistant", content=None, tool_calls=[ToolCall(id=call_id, name="get_weather", arguments=calls[0][2])]),
        ChatMessage(role="tool", tool_call_id=call_id, content='{"temp_c": 21}'),
    ]
    following = fmt.prepare(Submit(messages=msgs, tools=TOOLS)).text
    if name in STABLE:
        assert following.startswith(prepared.text + reply)
    else:
        assert following[:50] == prepared.text[:50]  # (the salvage reuses what matches)


@pytest.mark.parametrize("name", sorted(STABLE))
def test_a_ten_step_tool_loop_keeps_its_whole_history_cached(name: str, vocab: Vocab) -> None:
    """Each step: the model calls a tool, the tool answers (a few hundred characters), the next turn is sent. Every
    prompt's tokens start with the previous prompt's, followed by the reply's (what the slot holds)."""
    fmt = fmt_for(name)
    msgs = [ChatMessage(role="user", content="Plan a trip through ten cities; check the weather in each.")]
    prev_tokens: list[int] | None = None
    prev_reply: list[int] = []
    for step in range(10):
        prepared = fmt.prepare(Submit(messages=msgs, tools=TOOLS))
        tokens = vocab.tokenize(prepared.text, add_special=prepared.add_bos)
        if prev_tokens is not None:
            expected = prev_tokens + prev_reply
            reused = common_prefix(tokens, expected)
            # At most the prompt's last token is lost: these templates' markers ([/INST], <|im_start|>...) are text
            # to the default model's vocabulary, which may merge the prompt's last character with the reply's first.
            assert reused >= len(prev_tokens) - 1, (step, reused, len(prev_tokens))
            assert reused >= 0.9 * len(expected)
        reply = one_call(fmt, args=json.dumps({"city": f"City{step}", "days": step + 1}), call_id=f"call{step:05d}")
        _, _, calls = parse(prepared.output, reply)
        assert len(calls) == 1, reply
        call_id, fn, args = calls[0]
        if fmt.family.id_alphabet and call_id != f"call{step:05d}":
            call_id = f"call{step:05d}"  # (ours are random; the history keeps what the model wrote)
        msgs += [
            ChatMessage(role="assistant", content=None, tool_calls=[ToolCall(id=call_id, name=fn, arguments=args)]),
            ChatMessage(
                role="tool", tool_call_id=call_id, content=json.dumps({"city": f"City{step}", "forecast": ["sunny"] * 40})
            ),
        ]
        prev_tokens, prev_reply = tokens, vocab.tokenize(reply, add_special=False)


# ---- recorded outputs -------------------------------------------------------------------------------------------


def hermes() -> OutputSpec:
    return spec_for(chat_format("Qwen-Qwen2.5-7B-Instruct"))


def test_hermes_text_before_calls_and_parallel_calls() -> None:
    two = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "fjords"}}\n</tool_call>'
    )
    content, _, calls = parse(hermes(), "Let me check.\n" + two)
    assert content == "Let me check." and [(n, a) for _, n, a in calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("search", '{"q": "fjords"}'),
    ]
    assert all(cid.startswith("call_") and len(cid) == 29 for cid, _, _ in calls) and calls[0][0] != calls[1][0]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json at all\n</tool_call>",  # looks like a call, is not one
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not one of the tools
        "I would use <tool_call but no.",
    ],
)
def test_hermes_text_that_only_looks_like_a_call_stays_content(text: str) -> None:
    assert parse(hermes(), text) == (text, None, [])


@pytest.mark.parametrize(
    ("family", "cut"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'),
        ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Os'),
    ],
)
def test_a_call_cut_off_stays_a_call_with_the_arguments_written(family: str, cut: str) -> None:
    """Streamed calls are given out from their head on; one cut off (max_tokens) ends as written, as OpenAI's do, and
    none of its text comes again as reply text (a streaming client had the call already: Claude Code got both, ran the
    cut call, and the model wrote it again, 76 times)."""
    spec = hermes() if family == "hermes" else OutputSpec(family=Generic(), tool_names=frozenset({"get_weather"}))
    content, _, calls = parse(spec, cut)
    assert [c[1:] for c in calls] == [("get_weather", '{"city": "Os')]
    assert content == ""


def test_hermes_arguments_given_as_a_json_string_are_read() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
    assert parse(hermes(), text)[2][0][1:] == ("search", '{"q": "x"}')


def test_llama3_calls_only_open_the_reply() -> None:
    spec = spec_for(chat_format("meta-llama-Llama-3.2-3B-Instruct"))
    assert parse(spec, ' {"name": "search", "parameters": {"q": "x"}}')[2][0][1:] == ("search", '{"q": "x"}')
    assert parse(spec, '{"answer": 42}') == ('{"answer": 42}', None, [])
    prose = 'Call it like {"name": "search", "parameters": {}}'
    assert parse(spec, prose) == (prose, None, [])


def test_mistral_lists_and_args_syntax_keep_the_models_ids() -> None:
    nemo = spec_for(chat_format("mistralai-Mistral-Nemo-Instruct-2407"))
    text = (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "a"}, "id": "AAAAAAAA1"}, '
        '{"name": "search", "arguments": {"q": "b"}, "id": "BBBBBBBB2"}]'
    )
    assert parse(nemo, text)[2] == [("AAAAAAAA1", "search", '{"q": "a"}'), ("BBBBBBBB2", "search", '{"q": "b"}')]
    small = spec_for(chat_format("Mistral-Small-3.2-24B-Instruct-2506"))
    text = '[TOOL_CALLS]search[CALL_ID]XYZ123abc[ARGS]{"q": "a"}[TOOL_CALLS]get_weather[CALL_ID]QQQ111www[ARGS]{"city": "Rome"}'
    assert parse(small, text)[2] == [("XYZ123abc", "search", '{"q": "a"}'), ("QQQ111www", "get_weather", '{"city": "Rome"}')]
    devstral = spec_for(chat_format("unsloth-mistral-Devstral-Small-2507"))
    _, _, calls = parse(devstral, '[TOOL_CALLS]search[ARGS]{"q": "a"}')
    assert calls[0][1:] == ("search", '{"q": "a"}') and len(calls[0][0]) == 9 and calls[0][0].isalnum()


def test_gemma_arguments_are_read_into_json() -> None:
    spec = spec_for(chat_format("google-gemma-4-31B-it"))
    text = '<|tool_call>call:get_weather{city:<|"|>a <b> & c<|"|>,days:-2,opts:{deep:[1,2.5,true,null]}}<tool_call|>'
    assert json.loads(parse(spec, text)[2][0][2]) == {"city": "a <b> & c", "days": -2, "opts": {"deep": [1, 2.5, True, None]}}
    from chat.families import Gemma

    fg = OutputSpec(
        family=Gemma("functiongemma", "<start_function_call>", "<end_function_call>", "<escape>"),
        tool_names=frozenset({"get_weather"}),
    )
    text = "<start_function_call>call:get_weather{city:<escape>London<escape>,units:<escape>c<escape>}<end_function_call>"
    assert json.loads(parse(fg, text)[2][0][2]) == {"city": "London", "units": "c"}


def test_generic_response_is_streamed_as_decoded_text() -> None:
    spec = OutputSpec(family=Generic(), tool_names=frozenset({"search"}))
    reply = 'Line one\n"quoted" \\ tab\t é ✓'
    text = json.dumps({"response": reply}, ensure_ascii=False)
    assert parse(spec, text) == (reply, None, [])
    assert parse(spec, text, [1] * len(text)) == (reply, None, [])
    calls = '{"tool_calls": [{"name": "search", "arguments": {"q": "x"}}, {"name": "search", "arguments": {}}]}'
    assert [c[1:] for c in parse(spec, calls)[2]] == [("search", '{"q": "x"}'), ("search", "{}")]
    other = '{"city": "Paris"}'  # a response_format's JSON, not the generic document
    assert parse(spec, other) == (other, None, [])


def test_thinking_is_split_from_the_reply() -> None:
    qwen3 = spec_for(chat_format("Qwen-Qwen3-0.6B"))
    text = "<think>\nThe user wants weather.\n</think>\n\n" + ONE_CALL["hermes"]
    content, reasoning, calls = parse(qwen3, text)
    assert reasoning == "\nThe user wants weather.\n" and content == "" and calls[0][1] == "get_weather"
    assert parse(qwen3, "Plain answer.") == ("Plain answer.", None, [])
    opened = OutputSpec(reasoning=("<think>", "</think>"), in_reasoning=True)  # the prompt opened the tag (DeepSeek R1)
    assert parse(opened, "hmm</think>Answer") == ("Answer", "hmm", [])
    assert parse(opened, "still thinking") == ("", "still thinking", [])


def test_the_tokens_of_the_thinking_are_counted_with_its_tags() -> None:
    """(the Responses API's `output_tokens_details.reasoning_tokens`)"""
    qwen3 = spec_for(chat_format("Qwen-Qwen3-0.6B"))
    p = qwen3.parser()
    for token in ["<think>", "\nThe", " user", " asks.\n", "</think>", "\n\n", "Hello", "."]:
        p.feed(token)
    assert p.reasoning_tokens == 5 and p.text == "Hello." and p.reasoning_text == "\nThe user asks.\n"
    p = qwen3.parser()
    p.feed("<think>plan</think>", tokens=3)  # a delta of several tokens (speculation): all of them
    p.feed("Answer", tokens=2)
    assert p.reasoning_tokens == 3
    p = qwen3.parser()
    for token in ["Plain", " answer", "."]:
        p.feed(token)
    assert p.reasoning_tokens == 0
    opened = OutputSpec(reasoning=("<think>", "</think>"), in_reasoning=True).parser()  # the prompt opened the tag
    for token in ["hmm", "</think>", "Answer"]:
        opened.feed(token)
    assert opened.reasoning_tokens == 2
    harmony = spec_for(chat_format("openai-gpt-oss-120b")).parser()
    tokens = ["<|channel|>", "analysis", "<|message|>", "Think", " more", "<|end|>", "<|start|>", "assistant", "<|channel|>",
              "final", "<|message|>", "Hi"]  # fmt: skip
    for token in tokens:
        harmony.feed(token)
    harmony.finish()
    assert (harmony.reasoning_tokens, harmony.reasoning_text, harmony.text) == (6, "Think more", "Hi")  # (its header too)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=12), max_size=40))
def test_any_chunking_reads_the_same(cuts: list[int]) -> None:
    text = "<think>plan</think>\n\nSure thing.\n" + ONE_CALL["hermes"] + "\n" + ONE_CALL["hermes"].replace("Paris", "Rome")
    spec = spec_for(chat_format("Qwen-Qwen3-0.6B"))
    whole = parse(spec, text)
    chunked = parse(spec, text, cuts)
    assert (whole[0], whole[1], [c[1:] for c in whole[2]]) == (chunked[0], chunked[1], [c[1:] for c in chunked[2]])
    assert whole[0] == "Sure thing." and len(whole[2]) == 2


# ---- grammars ---------------------------------------------------------------------------------------------------


def test_auto_is_lazy_at_the_trigger_and_named_choice_is_one_call(vocab: Vocab, guide_tokenizer: GuideTokenizer) -> None:
    fmt = chat_format("Qwen-Qwen2.5-7B-Instruct")
    msgs = [ChatMessage(role="user", content="x")]
    auto = fmt.prepare(Submit(messages=msgs, tools=TOOLS)).constraint
    assert auto is not None and auto.triggers == ["<tool_call>"]
    named = fmt.prepare(Submit(messages=msgs, tools=TOOLS, tool_choice=NamedTool(name="search"))).constraint
    assert not accepts(guide_tokenizer, vocab, named, ONE_CALL["hermes"])  # another function
    one = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    assert accepts(guide_tokenizer, vocab, named, one)
    assert not accepts(guide_tokenizer, vocab, named, one + "\n" + one)
    single = fmt.prepare(Submit(messages=msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).constraint
    assert not accepts(guide_tokenizer, vocab, single, one + "\n" + one)
    assert accepts(
        guide_tokenizer,
        vocab,
        fmt.prepare(Submit(messages=msgs, tools=TOOLS, tool_choice="required")).constraint,
        one + "\n" + one,
    )
    # arguments must follow the schema: no invented keys, the enum held
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x", "color": "red"}}\n</tool_call>'
    required = fmt.prepare(Submit(messages=msgs, tools=TOOLS, tool_choice="required")).constraint
    assert not accepts(guide_tokenizer, vocab, required, bad)
    assert not accepts(guide_tokenizer, vocab, required, bad.replace('"color": "red"', '"units": "k"'))


def test_lazy_constraint_engages_at_the_trigger(vocab: Vocab, guide_tokenizer: GuideTokenizer) -> None:
    fmt = chat_format("Qwen-Qwen2.5-7B-Instruct")
    auto = fmt.prepare(Submit(messages=[ChatMessage(role="user", content="x")], tools=TOOLS)).constraint
    assert auto is not None
    guide = Guide(auto, guide_tokenizer)
    for tok in vocab.tokenize("Free text, anything {at all}.\n", add_special=False):
        guide.follow(tok)
    assert guide.matcher is None and not guide.failed
    for tok in vocab.tokenize(ONE_CALL["hermes"], add_special=False):
        guide.follow(tok)
    assert guide.matcher is not None and not guide.failed and guide.matcher.is_accepting()


def test_generic_family_auto_means_calls_or_a_response(vocab: Vocab, guide_tokenizer: GuideTokenizer) -> None:
    fmt = fmt_for("builtin:gemma")
    auto = fmt.prepare(Submit(messages=[ChatMessage(role="user", content="x")], tools=TOOLS)).constraint
    assert auto is not None and not auto.triggers
    assert accepts(guide_tokenizer, vocab, auto, ONE_CALL["generic"])
    assert accepts(guide_tokenizer, vocab, auto, '{"response": "Hi!\\nBye."}')
    assert not accepts(guide_tokenizer, vocab, auto, "Hi!")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [Tool(name="f", parameters={"type": "wat"})], "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [Tool(name="f", parameters={"type": "array"})], "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": NamedTool(name="get_time")}, "tool_choice"),
    ],
)
def test_tool_problems_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatError) as info:
        chat_format("Qwen-Qwen2.5-7B-Instruct").prepare(Submit(messages=[ChatMessage(role="user", content="x")], **kwargs))
    assert info.value.param == param


def test_response_format_and_grammar_compile_or_name_the_field(vocab: Vocab, guide_tokenizer: GuideTokenizer) -> None:
    from protocol import ResponseFormat

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    c = constraint(None, None, "auto", True, ResponseFormat(type="json_schema", schema=schema), None)
    assert c is not None and accepts(guide_tokenizer, vocab, c, '{"city": "Oslo"}')
    assert not accepts(guide_tokenizer, vocab, c, '{"town": "Oslo"}')
    with pytest.raises(ChatError) as info:
        constraint(None, None, "auto", True, ResponseFormat(type="json_schema", schema={"type": "wat"}), None)
    assert info.value.param == "response_format" and "wat" in str(info.value)
    gbnf = constraint(None, None, "auto", True, None, 'root ::= ("yes" | "no") "!"')
    assert (
        gbnf is not None and accepts(guide_tokenizer, vocab, gbnf, "yes!") and not accepts(guide_tokenizer, vocab, gbnf, "maybe")
    )
    lark = constraint(None, None, "auto", True, None, 'start: "a"+')
    assert lark is not None and accepts(guide_tokenizer, vocab, lark, "aaa")
    with pytest.raises(ChatError) as info:
        constraint(None, None, "auto", True, None, "root ::= undefined_rule")
    assert info.value.param == "grammar"


def test_detect_falls_back_to_generic() -> None:
    """A template that writes no calls, or whose markers the probe calls do not bear out, gets the generic family."""
    assert detect(ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "x")).name == "generic"
    fake = "{# <tool_call> #}{% for m in messages %}{{ m.content }}{% endfor %}"  # (a marker, but no calls written)
    assert detect(ChatTemplate(fake, "x")).name == "generic"


# ---- streaming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_call_streams_its_arguments_while_they_are_written(name: str) -> None:
    """Fed one character at a time: the call's id and name come in its first piece, before its arguments end; the
    pieces of its arguments add up to the arguments the reply ends with (Mistral Nemo writes the id after the
    arguments: its call comes whole)."""
    fmt = chat_format(name)
    long_city = "Paris " * 30
    reply = one_call(fmt, args=json.dumps({"city": long_city, "days": 3}))
    p = SectionParser(spec_for(fmt))
    pieces, first_at = [], None
    for i, ch in enumerate(reply):
        for d in p.feed(ch).calls:
            pieces.append(d)
            if first_at is None:
                first_at = i
    for d in p.finish().calls:
        pieces.append(d)
    assert pieces and pieces[0].index == 0 and pieces[0].name == "get_weather" and pieces[0].id
    assert all(d.index == 0 and d.name is None and d.id is None for d in pieces[1:])
    (call,) = p.tool_calls
    assert "".join(d.arguments for d in pieces) == call.arguments
    assert json.loads(call.arguments) == {"city": long_city, "days": 3}
    if fmt.family.name != "mistral":
        assert first_at is not None and first_at < reply.index("Paris")  # the head went out before the arguments
        assert len(pieces) > 100  # and they went out as they came


def test_gemma_arguments_stream_as_the_json_they_mean() -> None:
    spec = spec_for(chat_format("google-gemma-4-31B-it"))
    text = '<|tool_call>call:get_weather{city:<|"|>a "b" \\ c<|"|>,days:-2.50,opts:{deep:[1,true,None],e:{}},f:[]}<tool_call|>'
    p = SectionParser(spec)
    got = "".join(d.arguments for ch in text for d in p.feed(ch).calls) + "".join(d.arguments for d in p.finish().calls)
    assert json.loads(got) == {"city": 'a "b" \\ c', "days": -2.5, "opts": {"deep": [1, True, None], "e": {}}, "f": []}
    assert got == p.tool_calls[0].arguments == json.dumps(json.loads(got), ensure_ascii=False)
