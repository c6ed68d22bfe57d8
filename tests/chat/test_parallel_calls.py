"""Parallel tool calls on every family that writes calls (issue 63), with each vendored template (no model): the
template renders an assistant turn of two and of three calls (different tools; strings, numbers, nested objects and
arrays in their arguments); the streaming reader, fed that text a few characters at a time, gives the calls back in
order, each with its own index, id and name in its first piece, its arguments in pieces that add up to what was
written; the next turn (the calls as read, their results) extends this turn's prompt and the model's text where
TABLE.md says it does; and the family's grammar with parallel calls on takes the three calls as the template writes
them (with them off, one).

Parametrized over TABLE.md's rows (tests/chat/template_table.py writes it, test_template_table.py checks it is
current): a template added there, or a family, is covered here with no change.
"""

from __future__ import annotations

import functools
import json
import random
import re
from typing import Any

import llguidance
import pytest
import template_table as tt

from chat.output import OutputSpec
from chat.request import ChatFormat, calls_into_content, tool_json
from chat.template_probes import IDS, Probe, boundary, lcp, turn
from protocol import ChatMessage, Submit, Tool, ToolCall, ToolCallDelta

END = "the third call ends here"  # (the last value written: the grammar must take the text past it)
TOOLS = [
    Tool(name="write_file", description="Write a file", parameters={"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "lines": {"type": "integer"},
        "options": {"type": "object", "properties": {"mode": {"type": "string"}, "backup": {"type": "boolean"}}}}}),
    Tool(name="search", description="Search the code", parameters={"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"},
        "filters": {"type": "object", "properties": {"lang": {"type": "string"},
                                                     "tags": {"type": "array", "items": {"type": "string"}}}}}}),
    Tool(name="run_command", description="Run a shell command", parameters={"type": "object", "properties": {
        "cmd": {"type": "string"}, "timeout": {"type": "number"}, "env": {"type": "object"}, "note": {"type": "string"}}}),
]  # fmt: skip
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("write_file", {"path": "src/a.py", "content": "print('hi')\nprint(\"two\")", "lines": 2,
                    "options": {"mode": "w", "backup": True}}),
    ("search", {"query": "kv cache reuse", "limit": 5, "filters": {"lang": "py", "tags": ["router", "slots"]}}),
    ("run_command", {"cmd": "ls -la /tmp", "timeout": 2.5, "env": {"LANG": "C", "DEPTH": 3}, "note": END}),
]  # fmt: skip
FLAT = [(n, {k: v for k, v in a.items() if not isinstance(v, (dict, list))}) for n, a in CALLS]  # strings and numbers
# Templates whose rendering of these calls no grammar of kvroute writes today, and why; the grammar is checked on the
# flat calls there (and is checked not to take the nested ones: when it does, the entry goes).
GAPS: dict[str, str] = {}  # (Seed-OSS's Python-written objects and lists have their grammar now)


def table() -> dict[str, dict[str, str]]:
    """TABLE.md's rows: template -> column header -> cell."""
    rows = [line for line in tt.TABLE.read_text().splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in rows]
    head = split[0]
    return {cells[0]: dict(zip(head, cells, strict=True)) for cells in split[1:]}


ROWS = table()
CALLING = sorted(name for name, row in ROWS.items() if row["calls"] == "read")


@functools.cache
def prepared(name: str) -> tuple[ChatFormat, str, OutputSpec, Any]:
    """The template's format, the first turn's prompt with TOOLS (auto), how its reply is read, its constraint."""
    fmt = ChatFormat(tt.template(name))
    first = fmt.prepare(Submit(messages=[ChatMessage(role="user", content="userprobe")], tools=TOOLS))
    return fmt, first.text, first.output, first.constraint


def written(name: str, calls: list[tuple[str, dict[str, Any]]]) -> str | None:
    """What the model writes for an assistant turn of `calls` after the first prompt: the template's rendering of the
    turn past the prompt, without the turn's end (template_table.model_text, with these tools)."""
    fmt, prompt, spec, _ = prepared(name)
    probe = Probe(fmt.template)
    tools = [tool_json(t) for t in TOOLS] if probe.tools is not None else None
    message = turn(calls)
    if spec.family is not None and spec.family.in_content:  # (LFM2-8B-A1B: the calls are in the content)
        message = calls_into_content([message], spec.family)[0]
    try:
        full = fmt.template.render([*probe.user, message], tools, add_generation_prompt=False)[0]
    except Exception:
        return None
    if full.startswith(prompt):
        text = full[len(prompt) :]
    else:
        text = full[boundary(full, lcp(full, prompt)) :]
        close = spec.reasoning[1] if spec.reasoning else None
        if close and prompt.rstrip().endswith(close) and text.lstrip().startswith(close):
            text = text.lstrip()[len(close) :]  # (the prompt closed the thinking already)
    if probe.end and text.endswith(probe.end):
        text = text[: -len(probe.end)]
    if spec.in_reasoning and spec.reasoning and spec.reasoning[1] not in text:
        text = spec.reasoning[1] + "\n\n" + text  # (the template keeps no thinking: the model ends its own)
    return text


def parallel_text(name: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The turn's text; skips the template where it takes or writes one call per turn (Llama 3 raises on more,
    gpt-oss and GigaChat 3.1 write the first)."""
    text = written(name, calls)
    if text is None or not all(n in text for n, _ in calls[1:]):
        one = written(name, calls[:1])
        assert one is not None and calls[0][0] in one, f"{name} renders no call: {one!r}"
        pytest.skip("the template writes one call per turn")
    return text


def loads(text: str) -> Any:
    return json.loads(text)


# ---- reading ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", CALLING)
def test_parallel_calls_stream_back_in_order_with_their_own_index(name: str, n: int) -> None:
    calls = CALLS[:n]
    text = parallel_text(name, calls)
    fmt, prompt, spec, _ = prepared(name)
    parser = spec.parser()
    fed: list[tuple[int, ToolCallDelta]] = []  # (which feed gave it, the delta)
    chunks = random.Random(f"{name}/{n}")
    i = feed = 0
    while i < len(text):
        step = chunks.randint(1, 4)
        fed += [(feed, d) for d in parser.feed(text[i : i + step]).calls]
        i, feed = i + step, feed + 1
    fed += [(feed, d) for d in parser.finish().calls]
    got = parser.tool_calls
    deltas = [d for _, d in fed]

    assert [(c.name, loads(c.arguments)) for c in got] == calls, text
    assert not any(fn in parser.text for fn, _ in calls), parser.text  # (no call leaked into the reply text)
    heads = [d for d in deltas if d.name is not None]
    assert [(d.index, d.name) for d in heads] == [(k, fn) for k, (fn, _) in enumerate(calls)]
    assert [d.id for d in heads] == [c.id for c in got] and all(c.id for c in got) and len({c.id for c in got}) == n
    for k, c in enumerate(got):
        if IDS[k] in text:  # the template wrote the call's id: the model's id is the call's
            assert c.id == IDS[k]
    indexes = [d.index for d in deltas]
    assert indexes == sorted(indexes), indexes  # one call after the other, never interleaved
    for k, c in enumerate(got):
        own = [(at, d) for at, d in fed if d.index == k]
        assert own[0][1].name == c.name and all(d.name is None and d.id is None for _, d in own[1:])
        assert "".join(d.arguments for _, d in own) == c.arguments
        if ROWS[name]["args streamed"] == "yes":  # its arguments went out over the feeds that wrote them
            feeds = {at for at, d in own if d.arguments}
            assert len(feeds) >= 5, (k, len(feeds))

    if ROWS[name]["turn 2 extends turn 1"] == "yes":
        answered = [ToolCall(id=c.id or IDS[k], name=c.name, arguments=c.arguments) for k, c in enumerate(got)]
        history = [
            ChatMessage(role="user", content="userprobe"),
            ChatMessage(role="assistant", content=parser.text or None, tool_calls=answered,
                        reasoning_content=parser.reasoning_text),
            *[ChatMessage(role="tool", tool_call_id=c.id, content=f"result {k}") for k, c in enumerate(answered)],
        ]  # fmt: skip
        following = fmt.prepare(Submit(messages=history, tools=TOOLS)).text
        assert following.startswith(prompt + text) or following.startswith(prompt + text.rstrip()), (
            following[len(prompt) : len(prompt) + len(text) + 40],
            text,
        )


# ---- the grammar -----------------------------------------------------------------------------------------------------

BYTES = llguidance.LLTokenizer("byte")  # (a token per byte: the text as written, whatever a vocabulary makes of it)


def admits(lark: str, text: str, end: int) -> bool:
    """Whether the grammar takes `text` up to a point at or past text[end] where it is complete (what follows is the
    turn's end, which the model writes after the section), or takes all of it and a newline."""
    matcher = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not matcher.is_error(), matcher.get_error()
    data, upto = list(text.encode()), len(text[:end].encode())
    taken = matcher.validate_tokens(data)
    for i in range(taken):
        if i >= upto and matcher.is_accepting():
            return True
        assert matcher.consume_token(data[i])
    if matcher.is_accepting() and taken >= upto:
        return True
    if taken < len(data) or matcher.validate_tokens([ord("\n")]) != 1:
        return False
    return bool(matcher.consume_token(ord("\n"))) and matcher.is_accepting()


def section(name: str, text: str) -> tuple[int, str]:
    """Where the call section begins in the model's text (its first trigger), and the whitespace before it."""
    _, _, _, auto = prepared(name)
    assert auto is not None and auto.triggers
    at = min(text.find(t) for t in auto.triggers if t in text)
    before = text[:at]
    return at, before[len(before.rstrip()) :]


@pytest.mark.parametrize("name", CALLING)
def test_the_grammar_with_parallel_calls_takes_three_calls_as_the_template_writes_them(name: str) -> None:
    calls = FLAT if name in GAPS else CALLS
    text = parallel_text(name, calls)
    fmt, _, _, auto = prepared(name)
    at, lead = section(name, text)
    end = text.rindex(END) + len(END)
    # tool_choice auto (parallel_tool_calls is on by default): the lazy grammar, from the trigger on
    assert admits(auto.grammar, text[at:], end - at), (auto.grammar[:400], text[at:])
    # required: the section rule itself (its opening may take the whitespace the template writes before the trigger)
    for parallel, many in ((True, True), (False, False)):
        rules = "start: calls\n" + fmt.family.calls_rules(TOOLS, parallel)
        took = any(admits(rules, lead[k:] + text[at:], end - at + len(lead) - k) for k in range(len(lead) + 1))
        assert took is many, (parallel, rules[:400], text[at:])
    if name in GAPS:
        nested = parallel_text(name, CALLS)
        at, _ = section(name, nested)
        assert not admits(auto.grammar, nested[at:], nested.rindex(END) + len(END) - at), f"fixed? drop GAPS[{name!r}]"
