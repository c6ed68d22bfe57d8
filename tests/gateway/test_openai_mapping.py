"""Unit tests (no model): OpenAI bodies -> protocol submits, errors -> OpenAI envelopes, via a fake router backend."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fake_router import FakeRouter, client_for, result

from gateway.errors import RequestError
from gateway.openai_chat import chat_submit, completion_submit, usage_body
from kvroute.client import KvrouteError
from protocol import ErrorCode, Usage, pack_tokens


def test_completion_defaults_follow_openai() -> None:
    sub, stream, usage = completion_submit({"prompt": "hi"}, "r1")
    assert sub.prompt == "hi" and sub.sampling.max_tokens == 16 and sub.sampling.temperature == 1.0
    assert (stream, usage) == (False, False)


def test_completion_fields_map_onto_sampling() -> None:
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "seed": 42,
        "logit_bias": {"17": -100},
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "x",
    }
    sub, stream, usage = completion_submit(body, "r1")
    s = sub.sampling
    assert sub.tokens == pack_tokens([1, 2, 3]) and sub.prompt is None
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (5, 0.0, 0.5, 7, 0.1, 42)
    assert s.logit_bias == {"17": -100.0} and s.stop == ["\n"]
    assert (stream, usage) == (True, True)
    assert completion_submit({"prompt": "x", "deadline_ms": 300}, "r")[0].deadline_ms == 300
    assert chat_submit({"messages": [{"role": "user", "content": "x"}], "deadline_ms": 9}, "r")[0].deadline_ms == 9
    for bad in (0, 2**31, 18446744073709550846):  # the last one once overflowed the router's job frame (schemathesis)
        with pytest.raises(RequestError, match="deadline_ms"):
            completion_submit({"prompt": "x", "deadline_ms": bad}, "r")


def test_chat_maps_roles_and_text_parts() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    }
    sub, _, _ = chat_submit(body, "r2")
    assert [(m.role, m.text()) for m in sub.messages or []] == [("developer", "be brief"), ("user", "ab")]
    assert sub.sampling.max_tokens is None  # chat: until the context is full, as OpenAI does


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "mirostat": 2}, "mirostat"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stop": [1]}, "stop[0]"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [2**31]}, "prompt"),  # found by schemathesis: not an int32 token id
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
    ],
)
def test_unsupported_values_name_the_field(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        completion_submit(body, "r")
    assert info.value.status == 400
    if param:
        assert info.value.param == param


def test_chat_bad_messages_name_the_field() -> None:
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].image_url"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom", "custom": {}}]}, "tools[0].type"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format.json_schema.schema"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "a b", "arguments": "{}"}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
    ]:  # fmt: skip
        with pytest.raises(RequestError) as info:
            chat_submit(body, "r")
        assert info.value.param == param


JSON = {"content-type": "application/json"}


@pytest.fixture
def fake() -> FakeRouter:
    return FakeRouter()


@pytest.mark.anyio
async def test_each_key_is_a_tenant_by_default_and_a_body_salt_narrows_it(fake: FakeRouter) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with client_for(fake, "key-one, key-two") as c:
        for key, body in (("key-one", chat), ("key-two", chat), ("key-one", {**chat, "cache_salt": "team-x"})):
            r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": "key-two"})
        assert r.status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "hi"}, headers={"x-api-key": "key-3"})).status_code == 401
        assert (await c.get("/slots", headers={"x-api-key": "key-two"})).status_code == 200
    one, two, one_x, two_again = (s.cache_salt for s in fake.submits)
    assert one and two and one != two and two == two_again and one_x == f"{one}/team-x"
    assert "key-one" not in one  # (the key itself never leaves the gateway)
    assert fake.status_salts == [two]  # /slots shows the caller's own slots in full
    async with client_for(fake) as c:  # without keys: the body's salt as given, none otherwise
        await c.post("/v1/chat/completions", json={**chat, "cache_salt": "team-x"})
        await c.post("/v1/chat/completions", json=chat)
    assert [s.cache_salt for s in fake.submits[-2:]] == ["team-x", None]
    async with client_for(fake, "key-one, key-two", shared_cache=True) as c:  # --shared-cache: keys share, as before
        for key in ("key-one", "key-two"):
            await c.post("/v1/chat/completions", json={**chat, "cache_salt": "team-x"}, headers={"x-api-key": key})
        await c.post("/v1/chat/completions", json=chat, headers={"x-api-key": "key-one"})
    assert [s.cache_salt for s in fake.submits[-3:]] == ["team-x", "team-x", None]


async def _post(fake: FakeRouter, path: str, body: Any, **kw: Any) -> httpx.Response:
    async with client_for(fake, kw.pop("api_key", None)) as c:
        return await c.post(path, json=body, **kw)


@pytest.mark.anyio
async def test_completion_response_carries_cached_tokens(fake: FakeRouter) -> None:
    r = await _post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 5},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_usage_gives_the_thinking_s_tokens() -> None:
    usage = Usage(prompt_tokens=10, cached_tokens=4, completion_tokens=9, reasoning_tokens=6)
    body = usage_body(result(usage=usage, reasoning="hm"))
    assert (body["completion_tokens"], body["completion_tokens_details"]) == (9, {"reasoning_tokens": 6})


@pytest.mark.anyio
async def test_streamed_chat_ends_with_usage_and_done(fake: FakeRouter) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}
    r = await _post(fake, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 5


# llama-server's `timings` for the fake's reply: 7 prompt tokens, 5 of them cached, in 4 ms; 2 generated in 50 ms
TIMINGS = {
    "cache_n": 5,
    "prompt_n": 2,
    "prompt_ms": 4.0,
    "prompt_per_token_ms": 2.0,
    "prompt_per_second": 500.0,
    "predicted_n": 2,
    "predicted_ms": 50.0,
    "predicted_per_token_ms": 25.0,
    "predicted_per_second": 40.0,
}


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_replies_carry_llama_servers_timings_streamed_or_not(fake: FakeRouter, path: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    assert (await _post(fake, path, body)).json()["timings"] == TIMINGS
    for usage in (False, True):  # on the last chunk, whether the stream asked for its usage or not (as llama-server)
        options = {"stream": True, "stream_options": {"include_usage": usage}}
        r = await _post(fake, path, body | options)
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert chunks[-1]["timings"] == TIMINGS and ("usage" in chunks[-1]) == usage
        assert not any("timings" in c for c in chunks[:-1])


@pytest.mark.anyio
async def test_a_responses_stream_ends_with_timings_beside_its_response(fake: FakeRouter) -> None:
    r = await _post(fake, "/v1/responses", {"input": "hi", "stream": True})
    events = [json.loads(line[6:]) for part in r.text.split("\n\n") for line in part.split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed" and events[-1]["timings"] == TIMINGS


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.BAD_REQUEST, 400),
        (ErrorCode.CONTEXT_OVERFLOW, 400),
        (ErrorCode.QUEUE_FULL, 429),
        (ErrorCode.NO_WORKERS, 503),
        (ErrorCode.DEADLINE_EXCEEDED, 504),
        (ErrorCode.INTERNAL, 500),
    ],
)
async def test_router_errors_become_http_statuses(fake: FakeRouter, code: str, status: int) -> None:
    fake.error = KvrouteError(
        "it failed", code=code, error_id="abc123" if code == ErrorCode.INTERNAL else None, retry_after_ms=2000
    )
    r = await _post(fake, "/v1/completions", {"prompt": "hi"})
    assert r.status_code == status
    err = r.json()["error"]
    openai_code = "context_length_exceeded" if code == ErrorCode.CONTEXT_OVERFLOW else code  # (OpenAI's own)
    assert err["code"] == openai_code and "it failed" in err["message"]
    if code == ErrorCode.QUEUE_FULL:
        assert r.headers["retry-after"] == "2"
    if code == ErrorCode.INTERNAL:
        assert "abc123" in err["message"]


@pytest.mark.anyio
async def test_model_names_and_json_errors(fake: FakeRouter) -> None:
    assert (await _post(fake, "/v1/completions", {"prompt": "hi", "model": "gemma"})).status_code == 200
    assert (await _post(fake, "/v1/completions", {"prompt": "hi", "model": "default"})).status_code == 200
    # any name is served, as llama-server does: Claude Code asks for a second, smaller model by another name
    assert (await _post(fake, "/v1/completions", {"prompt": "hi", "model": "claude-haiku-4-5"})).status_code == 200
    async with client_for(fake, aliases=("small", "gemma"), strict_model_name=True) as c:
        assert (await c.post("/v1/completions", json={"prompt": "hi", "model": "small"})).status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'gemma', 'small'" in r.json()["error"]["message"]
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["gemma", "small"]
    async with client_for(fake) as c:
        r = await c.post("/v1/completions", content=b"{not json", headers=JSON)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await c.post("/v1/completions", content=b"[1,2]", headers=JSON)
        assert r.status_code == 400


@pytest.mark.anyio
async def test_api_key_everywhere_but_health(fake: FakeRouter) -> None:
    async with client_for(fake, api_key="sekrit") as c:
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
        assert (await c.get("/health")).status_code == 200


@pytest.mark.anyio
async def test_health_is_503_until_a_worker_is_ready(fake: FakeRouter) -> None:
    fake.workers_ready = False
    async with client_for(fake, status_fresh_s=0) as c:  # (a view of the router's status as fresh as can be)
        assert (await c.get("/health")).status_code == 503
        fake.workers_ready = True
        assert (await c.get("/health")).json() == {"status": "ok", "workers": 1}
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["gemma"]
        metrics = await c.get("/metrics")
        assert "kvroute_http_requests_total" in metrics.text and "kvroute_requests_waiting 0.0" in metrics.text
        assert "kvroute_router_up 1" in metrics.text


@pytest.mark.anyio
async def test_every_api_lists_the_sampling_a_request_leaves_to_the_server(fake: FakeRouter) -> None:
    # (the router fills them from its flags, the GGUF or llama-server's: tests/router/test_scheduler.py)
    async with client_for(fake) as c:
        await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5})
        await c.post("/v1/messages", json={"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        await c.post("/v1/responses", json={"input": "hi", "top_k": 3})
        await c.post("/v1/completions", json={"prompt": "hi", "top_k": 0, "seed": 1, "repeat_penalty": 1.1})
    chat, messages, responses, completions = fake.submits
    penalties = ["repeat_penalty", "repeat_last_n"]
    assert (chat.sampling.temperature, chat.sampling_unset) == (0.5, ["top_k", "top_p", "min_p", "seed", *penalties])
    assert (messages.sampling.temperature, messages.sampling_unset) == (
        1.0, ["temperature", "top_k", "top_p", "min_p", "seed", *penalties]
    )  # fmt: skip
    assert (responses.sampling.top_k, responses.sampling_unset) == (3, ["temperature", "top_p", "min_p", "seed", *penalties])
    # (top_k 0 and repeat_penalty were asked for: they stay as asked)
    assert completions.sampling_unset == ["temperature", "top_p", "min_p", "repeat_last_n"]


@pytest.mark.anyio
async def test_a_response_is_incomplete_only_at_its_own_max_output_tokens(fake: FakeRouter) -> None:
    # the stand-in ends every job with `length`: the request's limit, or the server's --max-tokens cap
    async with client_for(fake) as c:
        own = (await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})).json()
        capped = (await c.post("/v1/responses", json={"input": "hi"})).json()
        streamed = (await c.post("/v1/responses", json={"input": "hi", "stream": True})).text
    assert (own["status"], own["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert (capped["status"], capped["incomplete_details"]) == ("completed", None)
    assert "response.completed" in streamed and "response.incomplete" not in streamed


def test_a_bad_sampling_default_stops_start_up_naming_its_flag() -> None:
    from router.config import RouterConfig

    for kw, flag in (({"temp": 5.0}, "--temp"), ({"top_p": 0.0}, "--top-p"), ({"seed": -1}, "--seed")):
        with pytest.raises(ValueError, match=flag):
            RouterConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--repeat-penalty"):
        RouterConfig(repeat_penalty=0.0)
    given = {k: v for k, v in RouterConfig(temp=0.0, top_k=40).sampling_flags().items() if v is not None}
    assert given == {"temperature": 0.0, "top_k": 40}
