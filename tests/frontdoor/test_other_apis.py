"""The other API shapes agents speak, through their official clients, against the real `kvroute serve`:
Anthropic Messages (the `anthropic` SDK), OpenAI Responses (the `openai` package and the Agents SDK's default
model), and llama-server's helpers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from served import Served

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}


RED_PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"  # a 1x1 PNG, base64
RED_URL = "data:image/png;base64," + RED_PIXEL
RED_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": RED_PIXEL}}
GREEDY = {"temperature": 0}  # (this anthropic SDK has no `temperature` argument: Claude's newest models take none)


def claude(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=served.api_key, max_retries=0, timeout=120)


def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=120)


# ---- Anthropic Messages ----------------------------------------------------------------------------------------


def test_anthropic_message_and_stream(served: Served) -> None:
    client = claude(served)
    ask = [{"role": "user", "content": "Name three rivers."}]
    msg = client.messages.create(model="default", max_tokens=12, messages=ask, extra_body=GREEDY, system="Be brief.")
    assert msg.role == "assistant" and msg.type == "message" and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens > 0
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 3
    with client.messages.stream(model="default", max_tokens=12, messages=ask, extra_body=GREEDY, system="Be brief.") as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == msg.content[0].text  # greedy: the same reply
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens >= msg.usage.input_tokens - 1
    stopped = client.messages.create(model="default", max_tokens=30, messages=ask, extra_body=GREEDY, stop_sequences=["."])
    assert stopped.stop_reason in ("stop_sequence", "end_turn", "max_tokens")
    if stopped.stop_reason == "stop_sequence":
        assert stopped.stop_sequence == "."


def test_anthropic_forced_tool_use_and_its_result_round_trip(served: Served) -> None:
    client = claude(served)
    tools: Any = [{"name": "get_weather", "description": "The forecast for a city", "input_schema": WEATHER}]
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    first = client.messages.create(
        model="default",
        max_tokens=60,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]},
    ]
    previous_input = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    with client.messages.stream(model="default", max_tokens=16, messages=history, tools=tools, extra_body=GREEDY) as stream:
        second = stream.get_final_message()
    assert second.usage.cache_read_input_tokens >= 0.9 * previous_input, (second.usage, previous_input)
    streamed_use = client.messages.create(
        model="default",
        max_tokens=60,
        messages=ask,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
        stream=True,
    )
    events = list(streamed_use)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert starts and starts[0].content_block.name == "get_weather"
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    jsonschema.validate(json.loads(partial), WEATHER)
    assert events[-2].delta.stop_reason == "tool_use"


def test_anthropic_count_tokens_and_errors_in_anthropic_shape(served: Served) -> None:
    client = claude(served)
    ask: Any = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model="default", messages=ask)
    sent = client.messages.create(model="default", max_tokens=2, messages=ask, extra_body=GREEDY)
    assert counted.input_tokens == sent.usage.input_tokens + (sent.usage.cache_read_input_tokens or 0)
    with httpx.Client(base_url=served.url, timeout=60) as http:
        headers = {"x-api-key": served.api_key or "", "anthropic-version": "2023-06-01"}
        cases = [
            ({"messages": ask}, "max_tokens"),
            (
                {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video", "data": "x"}]}]},
                "messages[0].content[0]",
            ),
            (
                {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                "messages[0].content[0].source",
            ),
            # an image, read by no projector: the router refuses it, naming the flag that serves one
            ({"max_tokens": 5, "messages": [{"role": "user", "content": [RED_BLOCK]}]}, "--mmproj FILE"),
            ({"max_tokens": 5, "messages": ask, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ]
        for body, field in cases:
            r = http.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and field in err["error"]["message"]
        r = http.post("/v1/messages", json={"max_tokens": 5, "messages": ask}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ---- OpenAI Responses ------------------------------------------------------------------------------------------


def test_responses_create_with_and_without_streaming(served: Served) -> None:
    client = oai(served)
    out = client.responses.create(
        model="default", input="Name a colour.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert out.status in ("completed", "incomplete") and out.output_text
    assert out.usage.input_tokens > 3 and out.usage.output_tokens > 0
    events = list(
        client.responses.create(
            model="default", input="Name a colour.", instructions="Be brief.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert (
        "response.output_text.delta" in kinds and "response.output_item.added" in kinds and "response.output_item.done" in kinds
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text  # greedy: the same reply
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens >= out.usage.input_tokens - 1  # the same prompt, from cache
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_calls_and_their_outputs(served: Served) -> None:
    client = oai(served)
    tools: Any = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
    first = client.responses.create(
        model="default",
        input="Weather in Rome for 2 days?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
        parallel_tool_calls=False,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow: Any = [
        {"role": "user", "content": "Weather in Rome for 2 days?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
    ]
    second = client.responses.create(model="default", input=follow, tools=tools, max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * first.usage.input_tokens
    events = list(
        client.responses.create(
            model="default",
            input="Weather in Oslo for 1 day?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == args


def test_responses_refuses_what_it_cannot_serve(served: Served) -> None:
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        for body, param in [
            ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
            ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
            ({"input": "x", "background": True}, "background"),
            (
                {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
                "input[0].content[0].image_url",
            ),
            # an image, read by no projector: the router's refusal names it (as the router's messages number it)
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": RED_URL}]}]}, "messages[0].content[0]"),
        ]:
            r = http.post("/v1/responses", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.json()
        ok = http.post("/v1/responses", json={"input": "hi", "store": True, "max_output_tokens": 2, "metadata": {"a": "b"}})
        assert ok.status_code == 200 and ok.json()["store"] is False  # accepted; nothing is stored


def test_openai_agents_sdk_default_responses_model(served: Served) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Answer with the get_weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="default", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )

    async def run() -> Any:
        # Closed on its own loop: an SDK client left open closes itself when collected, on whatever loop runs then
        async with client:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=2)

    result = asyncio.run(run())
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"


# ---- across shapes, and helpers --------------------------------------------------------------------------------


def test_one_conversation_is_one_prompt_in_every_shape(served: Served) -> None:
    """Chat Completions, then Messages, then Responses: the same conversation renders to the same tokens."""
    system, user = "You answer in one word.", "Capital of France?"
    chat = oai(served).chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4,
        temperature=0,
    )
    prompt = chat.usage.prompt_tokens
    msg = claude(served).messages.create(
        model="default", system=system, messages=[{"role": "user", "content": user}], max_tokens=4, extra_body=GREEDY
    )
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    assert msg.usage.cache_read_input_tokens >= prompt - 1  # served from the cache the chat request left
    resp = oai(served).responses.create(model="default", instructions=system, input=user, max_output_tokens=4, temperature=0)
    assert resp.usage.input_tokens == prompt and resp.usage.input_tokens_details.cached_tokens >= prompt - 1
    assert resp.output_text == msg.content[0].text == chat.choices[0].message.content


def test_llama_server_helpers(served: Served) -> None:
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        toks = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert toks and all(isinstance(t, int) for t in toks)
        pieces = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == "Hello world"
        assert http.post("/detokenize", json={"tokens": toks}).json() == {"content": "Hello world"}
        msgs = [{"role": "user", "content": "Hi"}]
        prompt = http.post("/apply-template", json={"messages": msgs}).json()["prompt"]
        assert prompt == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        slots = http.get("/slots").json()
        assert slots["workers"][0]["slots"] and "n_tokens" in slots["workers"][0]["slots"][0]
        assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
        assert http.post("/tokenize", json={"text": "x"}).json()["error"]["param"] == "text"
        assert httpx.get(f"{served.url}/slots").status_code == 401  # the API key holds here too


def test_slots_show_the_session_a_client_named(served: Served) -> None:
    """Claude Code's session header reaches the router as the request's session (gateway/normalise.py), and /slots
    shows it on the slot that ran the request."""
    session = f"served-{uuid.uuid4()}"
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=120) as http:
        chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
        r = http.post("/v1/chat/completions", json=chat, headers={"x-claude-code-session-id": session})
        assert r.status_code == 200, r.text
        slots = [slot for w in http.get("/slots").json()["workers"] for slot in w["slots"]]
    (ran,) = [slot for slot in slots if slot["session"] == session]
    assert ran["n_tokens"] > 0 and ran["awaited_s"] >= 0  # (seconds its session is still expected back for it)


def test_bad_input_in_any_shape_does_not_disturb_other_streams(served: Served) -> None:
    results: dict[str, Any] = {}

    def long_stream() -> None:
        try:
            with claude(served).messages.stream(
                model="default", max_tokens=40, messages=[{"role": "user", "content": "Tell a story."}], extra_body=GREEDY
            ) as s:
                results["text"] = "".join(s.text_stream)
        except Exception as exc:
            results["error"] = exc

    t = threading.Thread(target=long_stream)
    t.start()
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        assert http.post("/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 400
        assert http.post("/v1/responses", json={"input": [{"type": "nonsense"}]}).status_code == 400
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}).status_code == 400
    t.join(120)
    assert "error" not in results and results["text"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_garbage_bodies_get_the_shape_s_error(served: Served, path: str) -> None:
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        body = r.json()
        assert ("type" in body and body["type"] == "error") if path == "/v1/messages" else "error" in body


def test_an_agents_tool_calls_through_the_http_api_keep_its_slot_awaited(served: Served) -> None:
    """A session's reply in tool calls, which the gateway reads from the worker itself (direct replies), still makes
    the router keep its slot for the session's next turn: /slots shows it awaited; the next turn is served from it."""
    session = f"agent-{uuid.uuid4()}"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                             "required": ["city"], "additionalProperties": False}}}]  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"messages": messages, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={**body, "max_tokens": 64, "temperature": 0},
                      headers={"x-claude-code-session-id": session})  # fmt: skip
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]
        assert reply["finish_reason"] == "tool_calls", reply
        # (the router marks it when the worker's JobDone reaches it, which may be just after the gateway's reply)
        deadline = time.monotonic() + 10
        while True:
            slots = [slot for w in http.get("/slots").json()["workers"] for slot in w["slots"]]
            (ran,) = [slot for slot in slots if slot["session"] == session]
            if ran["awaited_s"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ran["awaited_s"] > 0, ran
        call = reply["message"]["tool_calls"][0]
        messages += [reply["message"], {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'}]
        r = http.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0},
                      headers={"x-claude-code-session-id": session})  # fmt: skip
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prompt_tokens > 0
