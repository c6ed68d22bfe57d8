"""What agents send, through the official `openai` package, against the real `kvroute serve` (real model)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from served import Served

from kvroute.client import Client

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {"type": "object"}}},
]
# arguments nested past what a template may walk (a cut call's arguments, not JSON, are rendered as written instead)
DEEP_ARGUMENTS = '{"a": ' + "[" * 10_000 + "]" * 10_000 + "}"
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# a 1x1 PNG
RED_PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=120)


def forced(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("tool_choice", "required")
    return client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=0, max_tokens=60, **kw
    )


def test_a_forced_call_parses_and_validates(served: Served) -> None:
    client = oai(served)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = forced(client, tool_choice=choice)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
        else:
            assert isinstance(json.loads(call.function.arguments), dict)


def test_a_forced_call_streams_as_tool_call_chunks(served: Served) -> None:
    stream = oai(served).chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish, text = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and text == ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)


def test_a_tool_result_round_trip_reuses_the_whole_history(served: Served) -> None:
    client = oai(served)
    first = forced(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": ["sun", "rain", "sun"], "high_c": 21})},
    ]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
    assert cached >= first.usage.prompt_tokens  # the first prompt whole, and the call the model wrote
    c = second.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content is not None or c.message.tool_calls


def test_json_schema_output_validates(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
    }
    out = oai(served).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Name a city and its country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=60,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    obj = oai(served).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "A JSON object please."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)


def test_logprobs_are_present_and_agree_with_greedy_choice(served: Served) -> None:
    out = oai(served).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for lp in content:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
        assert bytes(lp.bytes).decode("utf-8", "replace") == lp.token
    text = "".join(lp.token for lp in content)
    assert text.startswith(out.choices[0].message.content) or out.choices[0].finish_reason == "stop"
    completion = oai(served).completions.create(model="default", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2)
    lps = completion.choices[0].logprobs
    assert (
        len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == 3
        and "".join(lps.tokens) == completion.choices[0].text
    )


def test_penalties_change_greedy_output(served: Served) -> None:
    client = oai(served)

    def run(**kw: Any) -> str:
        # (seeded: computed the same way every time, so that greedy equals greedy bit for bit; unseeded, a reused prefix
        # or a guess verified in one batch may tip a near tie: worker/speculate.py)
        out = client.completions.create(model="default", prompt="Once upon a time", max_tokens=16, temperature=0, seed=1, **kw)
        return out.choices[0].text

    plain = run()
    assert run(frequency_penalty=2.0) != plain
    assert run(presence_penalty=2.0) != plain
    assert run() == plain


def test_n_choices_share_one_prompt(served: Served) -> None:
    client = oai(served)
    prompt = [{"role": "user", "content": "Write one word about the sea. " * 12}]  # long enough for a KV copy
    out = client.chat.completions.create(model="default", messages=prompt, n=2, temperature=0.9, seed=7, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content for c in out.choices)
    assert 2 <= out.usage.completion_tokens <= 16  # both choices counted
    with Client(served.zmq, timeout_s=60, curve_key=None) as zmq_client:
        result = zmq_client.submit(messages=prompt, n=2, temperature=0.9, seed=7, max_tokens=8)
    # the prompt is computed once: the second choice copies it from the first's slot (its whole KV but the last token)
    assert result.choices[1].cached_tokens >= result.usage.prompt_tokens - 1, result.choices
    again = client.chat.completions.create(model="default", messages=prompt, n=2, temperature=0.9, seed=7, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]  # seed + index per choice
    stream = client.chat.completions.create(model="default", messages=prompt, n=2, temperature=0, max_tokens=4, stream=True)
    seen: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            seen[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and seen[0] == seen[1] != ""  # greedy: both choices alike


def test_bad_agent_requests_get_a_400_naming_the_field_while_others_stream(served: Served) -> None:
    client = oai(served)
    streamed: dict[str, Any] = {}

    def long_stream() -> None:
        try:
            s = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "Tell a story."}],
                max_tokens=48,
                temperature=0,
                stream=True,
            )
            streamed["text"] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        except Exception as exc:  # reported below
            streamed["error"] = exc

    worker = threading.Thread(target=long_stream)
    worker.start()
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"grammar": "root ::= missing_rule"}, "grammar"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_nobody", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": DEEP_ARGUMENTS}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "x"},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"modalities": ["audio"]}, "modalities"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
            "messages[0].content[0].image_url.url",  # (the server fetches no URL)
        ),
        (  # an image, read by no projector: the router's refusal names it
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": RED_PIXEL}}]}]},
            "messages[0].content[0]",
        ),
    ]
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        for extra, param in bad:
            body = {"model": "default", "messages": ASK, "max_tokens": 4, **extra}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, r.json()
    worker.join(120)
    assert "error" not in streamed and streamed["text"], streamed


def test_metrics_show_the_reuse_a_conversation_just_caused(served: Served) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with httpx.Client(base_url=served.url, headers=served.headers, timeout=30) as http:
            body = http.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body)
            for s in fam.samples
        }

    before = scrape()
    client = oai(served)
    history = [{"role": "user", "content": "Name a fruit that is yellow and curved. " * 8}]
    first = client.chat.completions.create(model="default", messages=history, max_tokens=6, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Another?"}]
    second = client.chat.completions.create(model="default", messages=history, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens // 2
    after = scrape()

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("kvroute_prefix_cache_hits_total") >= cached
    assert grew("kvroute_prefix_cache_queries_total") >= first.usage.prompt_tokens + second.usage.prompt_tokens
    assert grew("kvroute_generation_tokens_total") >= 2
    assert after[("kvroute_router_up", ())] == 1
    assert after[("kvroute_reuse_mispredictions_total", ())] == before.get(("kvroute_reuse_mispredictions_total", ()), 0)
    assert after[("kvroute_time_to_first_token_seconds_count", ())] >= 2
    workers = {dict(labels)["worker"] for name, labels in after if name == "kvroute_worker_slots"}
    assert workers == {"cpu0"} and after[("kvroute_worker_slots", (("worker", "cpu0"),))] == 2
    assert ("kvroute_worker_decode_tokens_total", (("worker", "cpu0"),)) in after  # from the worker's heartbeats
    assert any(name == "kvroute_http_requests_total" for name, _ in after)  # the front's own figures too
