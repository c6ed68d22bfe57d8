"""The families people run for agents, end to end: one real `kvroute serve` with a tiny random-weight GGUF per family
(bench/tiny_chat.py: the family's vendored template and marker tokens). A forced tool call comes back as a call on
every API, its arguments streamed in pieces; turn 2 (the call and its result sent back) reuses the whole of turn 1,
prompt and reply. What llama-server does with the same files: `python -m bench.families` (tests/fixtures/templates
has no model of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import Served

from bench.tiny_chat import FAMILIES, chat_model

pytestmark = pytest.mark.model

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
          "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}  # fmt: skip
USER = [{"role": "user", "content": "weather in paris?"}]
# thinking off: the models say noise, and a template that opens the thinking anyway gets it closed at once (budget 0)
KWARGS = {"enable_thinking": False, "thinking": False, "thinking_budget": 0}
# MiniMax M2's template writes no thinking block for a turn whose thinking was empty, though its prompt opened one:
# turn 2 differs from turn 1 from that block on (with thinking, the block is written back and all of it is reused)
DROPS_EMPTY_THINKING = {"minimax-m2"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("families"))
    flags = [f for name, stem in FAMILIES.items() for f in ("--model", f"{name}={chat_model(tmp / f'{name}.gguf', stem)}")]
    s = Served(*flags, "--ctx-per-slot", "8192", "--slots", "2", "--threads", "1", log=tmp / "serve.log")
    yield s
    s.stop()


def sse(r: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in r.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: {"):
            yield kind, json.loads(line[6:])


def checked(name: str, args: str) -> dict[str, Any]:
    assert name == "get_weather", name
    value = json.loads(args)
    assert value["city"] in ("paris", "rome", "oslo") and 1 <= value["days"] <= 7, value
    return value


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forced_call_streams_on_every_api_and_turn_2_reuses_turn_1(served: Served, family: str) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    body = {"model": family, "messages": USER, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 200, "temperature": 0,
            "chat_template_kwargs": KWARGS}  # fmt: skip
    pieces: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=300) as r:
        for _, d in sse(r):
            usage = d.get("usage") or usage
            for c in d["choices"]:
                pieces += c["delta"].get("tool_calls") or []
    head, rest = pieces[0], pieces[1:]
    args = "".join(p["function"]["arguments"] for p in pieces)
    checked(head["function"]["name"], args)
    assert len([p for p in rest if p["function"]["arguments"]]) >= 2, pieces  # the arguments came as written

    call = {"id": head["id"], "type": "function", "function": {"name": "get_weather", "arguments": args}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": head["id"], "content": "sunny, 21 C"}]  # fmt: skip
    r2 = httpx.post(f"{served.url}/v1/chat/completions", json={"model": family, "messages": history, "tools": tools,
                    "max_tokens": 2, "temperature": 0, "chat_template_kwargs": KWARGS}, timeout=300).json()  # fmt: skip
    turn1 = usage["prompt_tokens"] + usage["completion_tokens"]
    reused = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    if family in DROPS_EMPTY_THINKING:
        assert reused >= usage["prompt_tokens"] - 2, (reused, usage)
    else:  # all of it but the reply's last token, which the slot never computed (its logits made it)
        assert reused >= turn1 - 1, (reused, usage)

    rtools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    body = {"model": family, "input": USER, "tools": rtools, "tool_choice": "required", "parallel_tool_calls": False,
            "stream": True, "max_output_tokens": 200, "temperature": 0, "chat_template_kwargs": KWARGS}  # fmt: skip
    with httpx.stream("POST", f"{served.url}/v1/responses", json=body, timeout=300) as r:
        events = list(sse(r))
    deltas = [d["delta"] for k, d in events if k == "response.function_call_arguments.delta"]
    (done,) = [d for k, d in events if k == "response.function_call_arguments.done"]
    assert len(deltas) >= 2 and "".join(deltas) == done["arguments"]
    checked(done["name"], done["arguments"])

    atools = [{"name": "get_weather", "input_schema": PARAMS}]
    body = {"model": family, "messages": USER, "tools": atools, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stream": True, "max_tokens": 200, "temperature": 0, "chat_template_kwargs": KWARGS}  # fmt: skip
    with httpx.stream(
        "POST", f"{served.url}/v1/messages", json=body, timeout=300, headers={"anthropic-version": "2023-06-01"}
    ) as r:
        events = list(sse(r))
    start = next(d["content_block"] for k, d in events if k == "content_block_start" and d["content_block"]["type"] == "tool_use")
    parts = [
        d["delta"]["partial_json"] for k, d in events if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert len(parts) >= 2
    checked(start["name"], "".join(parts))
