"""The table over every vendored chat template (tests/chat/template_table.py, no model): it is current, every template
renders, and the families people run for agents read their calls, stream them, and read their thinking."""

from __future__ import annotations

import template_table as tt

MUST = {  # the families issue 47 names, and what they must do
    "Qwen3.5-4B": ("read", "read"),
    "Qwen3-Coder": ("read", "-"),
    "GLM-4.7-Flash": ("read", "read"),
    "GLM-4.6": ("read", "read"),
    "deepseek-ai-DeepSeek-V3.1": ("read", "-"),
    "deepseek-ai-DeepSeek-V3.2": ("read", "read"),
    "Kimi-K2-Thinking": ("read", "read"),
    "moonshotai-Kimi-K2": ("read", "-"),
    "MiniMax-M2": ("read", "read"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("read", "read"),
    "unsloth-mistral-Devstral-Small-2507": ("read", "-"),
    "ByteDance-Seed-OSS": ("read", "read"),
    "openai-gpt-oss-120b": ("read", "read"),
}


def test_the_table_is_current_and_every_template_renders() -> None:
    rows = tt.table()
    assert tt.TABLE.read_text() == tt.HEADER + tt.markdown(rows) + "\n", "run: .venv/bin/python tests/chat/template_table.py"
    assert len(rows) == 70 and all(r.renders for r in rows), [r.name for r in rows if not r.renders]
    by_name = {r.name: r for r in rows}
    for name, (calls, reasoning) in MUST.items():
        r = by_name[name]
        assert (r.calls, r.reasoning, r.streamed) == (calls, reasoning, "yes"), r


def test_auto_waits_for_each_familys_trigger() -> None:
    """tool_choice auto leaves the reply free until the family's trigger (a grammar from the first token would force a
    call on every reply); the generic family's document is the one reply shape constrained from the start."""
    from protocol import ChatMessage, Submit

    for name in tt.names():
        fmt = tt.ChatFormat(tt.template(name))
        if fmt.family.name == "generic":
            continue
        sub = Submit(messages=[ChatMessage(role="user", content="hi")], tools=tt.TOOLS)
        limit = fmt.prepare(sub).constraint
        assert limit is not None and limit.triggers and all(limit.triggers), (name, fmt.family.key[:80])
