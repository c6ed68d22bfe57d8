"""The thinking's tokens in each OpenAI API's usage, streamed and not (issue 63; no model: a scripted router whose
result carries the router's count): Responses `usage.output_tokens_details.reasoning_tokens` (on
`response.completed`), Chat Completions `usage.completion_tokens_details.reasoning_tokens` (on the usage chunk), as
OpenAI gives them; Completions the same as Chat."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_router import ScriptedRouter, client_for, events, result

from protocol import Delta, Result, Usage

USAGE = Usage(prompt_tokens=20, cached_tokens=8, completion_tokens=12, reasoning_tokens=9)
USER = [{"role": "user", "content": "why?"}]


def thought() -> list[Delta | Result]:
    return [
        Delta(id="", text="", tokens=b"", reasoning="Because "),
        Delta(id="", text="", tokens=b"", reasoning="it is."),
        Delta(id="", text="So.", tokens=b""),
        result(text="So.", reasoning="Because it is.", usage=USAGE),
    ]


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


@pytest.mark.anyio
async def test_responses_reports_the_thinkings_tokens_streamed_or_not() -> None:
    async with client_for(ScriptedRouter(*thought())) as c:
        whole = (await c.post("/v1/responses", json={"input": "why?"})).json()
        streamed = events((await c.post("/v1/responses", json={"input": "why?", "stream": True})).text)
    completed = streamed[-1][1]["response"]
    for body in (whole, completed):
        assert body["usage"]["output_tokens"] == 12 and body["usage"]["output_tokens_details"] == {"reasoning_tokens": 9}
        assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Because it is."}]


@pytest.mark.anyio
async def test_chat_completions_report_the_thinkings_tokens_streamed_or_not() -> None:
    async with client_for(ScriptedRouter(*thought())) as c:
        whole = (await c.post("/v1/chat/completions", json={"messages": USER})).json()
        body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
        streamed = chunks((await c.post("/v1/chat/completions", json=body)).text)
        completion = (await c.post("/v1/completions", json={"prompt": "why?"})).json()
    assert streamed[-1]["choices"] == []
    for usage in (whole["usage"], streamed[-1]["usage"], completion["usage"]):
        assert usage["completion_tokens"] == 12 and usage["completion_tokens_details"] == {"reasoning_tokens": 9}
    assert "".join(ch["choices"][0]["delta"].get("reasoning_content", "") for ch in streamed if ch["choices"]) == "Because it is."
