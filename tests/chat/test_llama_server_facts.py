"""What llama-server reads out of model text, as llama.cpp's tests/test-chat.cpp expects it (the inputs and the parse,
carried here as facts; the code is ours): each case is the text a model writes after the prompt (thinking switched on
or off as the case says) and the reply text, thinking and calls kvroute must read from it (no model)."""

# ruff: noqa: RUF001 (DeepSeek's markers are written with fullwidth bars)
from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import chat_format

from protocol import ChatMessage, Submit, Tool

SPECIAL = Tool(name="special_function", parameters={"type": "object", "properties": {"arg1": {"type": "integer"}}})
GET_TIME = Tool(name="get_time", parameters={"type": "object", "properties": {"city": {"type": "string"}}})
EMPTY = Tool(name="empty_args", parameters={"type": "object", "properties": {}})
HELLO = "Hello, world!\nWhat's up?"
CALL = [("special_function", {"arg1": 1})]

# (template, thinking on, model text, reply text, thinking, calls)
CASES: list[tuple[str, bool, str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("Qwen3.5-4B", True, "I'm\nthinking\n</think>\n\n" + HELLO, HELLO, "I'm\nthinking", []),
    ("Qwen3.5-4B", False, "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
     "</tool_call>", "", None, CALL),
    ("Qwen3.5-4B", True, "I'm\nthinking\n</think>\n\n<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>", "", "I'm\nthinking", CALL),
    ("Qwen3-Coder", False, HELLO, HELLO, None, []),
    ("Qwen3-Coder", False, "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
     "</tool_call>", "", None, CALL),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True, "I'm\nthinking\n</think>\n" + HELLO, HELLO, "I'm\nthinking", []),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", False, "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>\n", "", None, CALL),
    ("ByteDance-Seed-OSS", False, "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!", "Hello, world!",
     "I'm thinking about the answer", []),
    ("ByteDance-Seed-OSS", False, "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
     "</function>\n</seed:tool_call>", "", None, CALL),
    ("GLM-4.6", False, "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "",
     None, CALL),
    ("GLM-4.7-Flash", False, HELLO, HELLO, None, []),
    ("GLM-4.7-Flash", True, "I'm\nthinking</think>" + HELLO, HELLO, "I'm\nthinking", []),
    ("GLM-4.7-Flash", True, "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key><arg_value>1"
     "</arg_value></tool_call>", "", "I'm\nthinking", CALL),
    ("MiniMax-M2", True, "I'm\nthinking\n</think>\n\n" + HELLO, HELLO, "I'm\nthinking", []),
    ("MiniMax-M2", True, "Let's call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name=\"empty_args\">\n</invoke>\n"
     "</minimax:tool_call>", "", "Let's call a tool:", [("empty_args", {})]),
    ("MiniMax-M2", True, "\n</think>\n\n<minimax:tool_call>\n<invoke name=\"special_function\">\n<parameter "
     "name=\"arg1\">1</parameter>\n</invoke>\n</minimax:tool_call>", "", None, CALL),
    ("deepseek-ai-DeepSeek-V3.1", False, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     "{\"city\": \"XYZCITY\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", None, [("get_time", {"city": "XYZCITY"})]),
    ("deepseek-ai-DeepSeek-V3.2", False, HELLO, HELLO, None, []),
    ("deepseek-ai-DeepSeek-V3.2", True, "I'm\nthinking</think>" + HELLO, HELLO, "I'm\nthinking", []),
    ("deepseek-ai-DeepSeek-V3.2", True, "Let me check the time</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke "
     "name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n"
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>", "", "Let me check the time", [("get_time", {"city": "Tokyo"})]),
    ("moonshotai-Kimi-K2", False, "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
     "<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|><|tool_calls_section_end|>", "", None, CALL),
    ("Kimi-K2-Thinking", True, "<think>I'm thinking about this</think><|tool_calls_section_begin|><|tool_call_begin|>"
     "functions.special_function:0<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|><|tool_calls_section_end|>",
     "", "I'm thinking about this", CALL),
    ("openai-gpt-oss-120b", False, "<|channel|>final<|message|>" + HELLO, HELLO, None, []),
    ("openai-gpt-oss-120b", False, "<|channel|>commentary<|message|>" + HELLO, HELLO, None, []),
    ("openai-gpt-oss-120b", False, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final"
     "<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
    ("openai-gpt-oss-120b", False, " to=functions.special_function<|channel|>analysis<|message|>{\"arg1\": 1}", "", None, CALL),
    ("openai-gpt-oss-120b", False, "<|channel|>analysis to=functions.special_function<|message|>{\"arg1\": 1}", "", None, CALL),
    ("openai-gpt-oss-120b", False, " to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>"
     "{\"arg1\": 1}", "", None, CALL),
    ("openai-gpt-oss-120b", False, "<|channel|>commentary to=functions.special_function<|message|>{\"arg1\": 1}", "", None, CALL),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", False, "<tool_call>\n{\"name\": \"special_function\", "
     "\"arguments\": {\"arg1\": 1}}\n</tool_call>", "", None, CALL),
    ("unsloth-mistral-Devstral-Small-2507", False, "[TOOL_CALLS]special_function[ARGS]{\"arg1\": 1}", "", None, CALL),
]  # fmt: skip


@pytest.mark.parametrize(("name", "thinking", "text", "content", "reasoning", "calls"), CASES)
def test_kvroute_reads_what_llama_server_reads(
    name: str, thinking: bool, text: str, content: str, reasoning: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    fmt = chat_format(name)
    kwargs = {"enable_thinking": thinking, "thinking": thinking}
    sub = Submit(messages=[ChatMessage(role="user", content="hi")], tools=[SPECIAL, GET_TIME, EMPTY], chat_template_kwargs=kwargs)
    parser = fmt.prepare(sub).output.parser()
    for ch in text:  # (as it streams)
        parser.feed(ch)
    parser.finish()
    assert parser.text.strip() == content
    assert ((parser.reasoning_text or "").strip() or None) == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == calls
