"""The official `openai` package and plain HTTP against a real kvroute serve (real model, real sockets)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
from served import Served

from kvroute.client import Client


def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=120)


def wait_idle(served: Served, timeout_s: float = 30) -> list:
    """Slots once nothing is busy (a cancelled job frees its slot within a step)."""
    deadline = time.monotonic() + timeout_s
    with Client(served.zmq, timeout_s=10) as c:
        while time.monotonic() < deadline:
            slots = [s for w in c.status().workers for s in w.slots]
            if slots and not any(s.busy for s in slots):
                return slots
            time.sleep(0.1)
    raise AssertionError("slots still busy")


def test_models_and_completion(served: Served) -> None:
    client = oai(served)
    models = [m.id for m in client.models.list().data]
    assert len(models) == 1
    out = client.completions.create(model=models[0], prompt="The capital of France is", max_tokens=6, temperature=0)
    assert out.choices[0].text.strip()
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens > 3


def test_streamed_chat_then_second_turn_reuses_the_history(served: Served) -> None:
    client = oai(served)
    history = [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Name a color of the sky."},
    ]
    stream = client.chat.completions.create(
        model="default", messages=history, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text and finish in ("stop", "length") and usage is not None
    first_prompt = usage.prompt_tokens
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And of grass?"}]
    second = client.chat.completions.create(model="default", messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The second prompt starts with the first prompt exactly, so at least all of it is reused.
    assert cached >= first_prompt, (cached, first_prompt)
    assert cached < second.usage.prompt_tokens
    assert second.choices[0].message.content is not None


def test_error_statuses(served: Served) -> None:
    h = served.headers
    with httpx.Client(base_url=served.url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "1024" in r.json()["error"]["message"]  # the numbers are named
        r = c.post("/v1/completions", json={"prompt": "hi", "top_p": 7}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=chat, headers=h)  # any model name is served (--strict-model-name: 404)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
        r = c.post(
            "/v1/completions",
            json={"prompt": "Count: one two three", "max_tokens": 900, "ignore_eos": True, "deadline_ms": 300},
            headers=h,
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
        assert c.get("/health").status_code == 200  # no key needed


def test_queue_full_is_429_with_retry_after(served: Served) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"Story number {i}:", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        return await c.post("/v1/completions", json=body, headers=served.headers)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 429 in statuses and 200 in statuses, statuses
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
    wait_idle(served)


def test_disconnect_mid_stream_frees_the_slot(served: Served) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=120) as c,
        c.stream("POST", "/v1/completions", json=body, headers=served.headers) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    slots = wait_idle(served)
    assert all(s.n_tokens < 600 for s in slots), "the job was not stopped"


def test_metrics_after_traffic(served: Served) -> None:
    r = httpx.get(f"{served.url}/metrics", headers=served.headers, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'kvroute_http_requests_total{endpoint="/v1/completions",status="200"}' in r.text


def test_health_503_without_workers(tmp_path) -> None:
    lone = Served("--workers", "0", "--no-workers-grace-s", "0", wait_ready=False, log=tmp_path / "lone.log")
    try:
        lone.wait_health(503, timeout_s=60)
        r = httpx.post(f"{lone.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    finally:
        assert lone.stop() == 0


def test_sse_wire_format(served: Served) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers, timeout=120)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_embeddings_with_the_official_client(served: Served) -> None:
    """/v1/embeddings (gateway/embeddings.py): the openai package's `embeddings.create`, batched inputs equal to one by
    one, base64 equal to floats, token ids as input, and the fields it cannot serve refused by name."""
    import base64

    import numpy as np

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=120)
    texts = ["The sea is calm tonight.", "A lighthouse keeper writes in his log."]
    both = client.embeddings.create(model="any", input=texts)
    assert [d.index for d in both.data] == [0, 1] and both.usage.prompt_tokens > 0
    dims = len(both.data[0].embedding)
    assert dims > 0 and abs(float(np.linalg.norm(both.data[0].embedding)) - 1.0) < 1e-5
    alone = [client.embeddings.create(model="any", input=t).data[0].embedding for t in texts]
    assert [d.embedding for d in both.data] == alone
    raw = httpx.post(
        f"{served.url}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}, headers=served.headers, timeout=60
    ).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist() == alone[0]
    ids = httpx.post(f"{served.url}/tokenize", json={"content": texts[0], "add_special": True}, headers=served.headers).json()[
        "tokens"
    ]
    by_ids = httpx.post(f"{served.url}/v1/embeddings", json={"input": ids}, headers=served.headers, timeout=60).json()
    assert by_ids["data"][0]["embedding"] == alone[0]
    for body, param in (
        ({"input": texts[0], "dimensions": dims // 2}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [2, 10**9]}, "input"),  # outside the vocabulary
        ({"input": [1.5]}, "input"),
        ({"input": [[2, 100], [2] + [100] * 8192]}, "input"),  # over the embedding context (worker/embedder.py)
    ):
        bad = httpx.post(f"{served.url}/v1/embeddings", json=body, headers=served.headers, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert "input 1 has 8193 tokens" in bad.text
