"""--context-shift through the real `kvroute serve` (router + worker + HTTP, real model): a conversation longer than
the slot is served with its oldest turns dropped, and the reply says so; without the flag it is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import Served

CTX = 256
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = Path(tmp_path_factory.mktemp("shift")) / "serve.log"
    s = Served(
        *("--workers", "1", "--slots", "1", "--ctx-per-slot", str(CTX), "--threads", "2", "--host-cache-mb", "0"),
        "--context-shift",
        log=log,
    )
    yield s
    s.stop()


def conversation(turns: int = 14) -> list[dict[str, str]]:
    """Longer than the shared server's 1024-token slots too (about 1,500 tokens)."""
    history = [{"role": "system", "content": "You are the harbour master. Answer in a few words."}]
    for t in range(turns):
        history.append({"role": "user", "content": f"Turn {t}: the fishing boats came home at dusk, " * 4 + "which ones?"})
        history.append({"role": "assistant", "content": f"Turn {t}: the red trawler and two sloops from the north."})
    history.append({"role": "user", "content": "Which boat is still out at sea?"})
    return history


def chat(served: Served, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=served.headers, timeout=120)


def test_a_long_conversation_is_served_with_its_oldest_turns_dropped(shifted: Served) -> None:
    r = chat(shifted, conversation())
    assert r.status_code == 200, r.text[:300]
    usage = r.json()["usage"]
    shift = usage["context_shift"]
    assert shift["dropped_messages"] > 0 and shift["dropped_messages"] % 2 == 0  # whole turns: user + assistant
    assert shift["dropped_tokens"] > 1024 - CTX
    assert usage["prompt_tokens"] + MAX_TOKENS <= CTX and usage["completion_tokens"] > 0
    # streamed, the usage chunk says the same
    r = chat(shifted, conversation(), stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["context_shift"] == shift


def test_the_anthropic_and_responses_apis_say_so_in_their_usage_too(shifted: Served) -> None:
    system, *messages = conversation()
    headers = {**shifted.headers, "anthropic-version": "2023-06-01"}
    body = {"system": system["content"], "messages": messages, "max_tokens": MAX_TOKENS, "model": "default"}
    r = httpx.post(f"{shifted.url}/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["context_shift"]["dropped_messages"] > 0
    body = {"instructions": system["content"], "input": messages, "max_output_tokens": 16, "model": "default"}
    r = httpx.post(f"{shifted.url}/v1/responses", json=body, headers=shifted.headers, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["context_shift"]["dropped_messages"] > 0


def test_a_conversation_that_fits_says_nothing_about_shifting(shifted: Served) -> None:
    r = chat(shifted, conversation(1))
    assert r.status_code == 200 and "context_shift" not in r.json()["usage"], r.text[:300]


def test_a_last_message_longer_than_the_slot_is_still_refused_with_both_numbers(shifted: Served) -> None:
    history = conversation(2)
    history[-1] = {"role": "user", "content": "Tell me about every boat in the harbour. " * 40}
    r = chat(shifted, history)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    message = r.json()["error"]["message"]
    assert "after --context-shift dropped 4 messages" in message and f"a slot of {CTX} tokens" in message


def test_without_context_shift_the_long_conversation_is_refused(served: Served) -> None:
    r = chat(served, conversation())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 1024 tokens. However, you requested ")
    assert "(prompt of " in message and "a slot of 1024 tokens" in message and "context-shift" not in message
