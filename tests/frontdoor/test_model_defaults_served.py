"""Issue 63, served: a request that sets no sampling gets the model's own (its GGUF's `general.sampling.*`), else the
models file's, else llama-server's, shown in `GET /props`; a request that sets no output cap stops at
--default-max-tokens; a model whose template has no tool syntax is not shown a request's tools (a hint, counted) unless
its models-file entry says `generic_tools`. One real `kvroute serve` over tiny random-weight GGUFs (bench/tiny_chat.py)
written with and without the keys."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import Served

from bench.tiny_chat import chat_model

pytestmark = pytest.mark.model

TEMPLATE = "Qwen-Qwen3-0.6B"
NO_TOOL_SYNTAX = "google-gemma-2-2b-it"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "tell me about paris"}]
KWARGS = {"enable_thinking": False}
OPEN_CAP = 12  # --default-max-tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("defaults"))
    greedy = chat_model(tmp / "greedy.gguf", TEMPLATE, metadata={"general.sampling.top_k": 1, "general.sampling.temp": 0.6})
    plain = chat_model(tmp / "plain.gguf", TEMPLATE)
    untaught = chat_model(tmp / "untaught.gguf", NO_TOOL_SYNTAX)
    models = tmp / "models.toml"
    models.write_text(
        f'[models.greedy]\npath = "{greedy}"\n\n[models.plain]\npath = "{plain}"\n\n'
        f'[models.tuned]\npath = "{plain}"\ntemp = 0.0\nmin_p = 0.1\n\n'
        f'[models.untaught]\npath = "{untaught}"\nload = "on_demand"\n\n'
        f'[models.generic]\npath = "{untaught}"\nload = "on_demand"\ngeneric_tools = true\n'
    )
    flags = ("--models", str(models), "--slots", "1", "--ctx-per-slot", "1024", "--threads", "1")
    s = Served(*flags, "--default-max-tokens", str(OPEN_CAP), "--top-p", "0.9", log=tmp / "serve.log")
    yield s
    s.stop()


def chat(s: Served, model: str, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "messages": USER, "chat_template_kwargs": KWARGS, **fields}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def text(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["message"]["content"])


def props(s: Served, model: str) -> dict[str, Any]:
    """`GET /props` of `model` once its worker has said hello (a model's slots count from then: several models' workers
    start side by side, and a loaded CI machine once read 0 slots just after the server said it was ready)."""
    end = time.monotonic() + 60
    while True:
        got = dict(httpx.get(f"{s.url}/props", params={"model": model}, timeout=10).json())
        if got["total_slots"] or time.monotonic() > end:
            return got
        time.sleep(0.2)


def test_props_show_each_models_defaults_and_where_they_come_from(served: Served) -> None:
    greedy = props(served, "greedy")
    params, sources = greedy["default_generation_settings"]["params"], greedy["sampling_sources"]
    assert (params["top_k"], params["temperature"], params["top_p"], params["min_p"]) == (1, 0.6, 0.9, 0.05)
    assert (sources["top_k"], sources["temperature"], sources["top_p"], sources["min_p"]) == (
        "gguf", "gguf", "flag", "llama-server"
    )  # fmt: skip
    assert (params["n_predict"], params["seed"], greedy["total_slots"]) == (OPEN_CAP, -1, 1)
    plain = httpx.get(f"{served.url}/props", params={"model": "plain"}, timeout=10).json()
    assert plain["default_generation_settings"]["params"]["top_k"] == 40 and plain["sampling_sources"]["top_k"] == "llama-server"
    tuned = httpx.get(f"{served.url}/props", params={"model": "tuned"}, timeout=10).json()
    assert tuned["default_generation_settings"]["params"]["min_p"] == 0.1 and tuned["sampling_sources"]["min_p"] == "models file"
    unknown = httpx.get(f"{served.url}/props", params={"model": "nope"}, timeout=10)
    assert unknown.status_code == 400 and "nope" in unknown.text


def test_unsampled_requests_sample_as_the_gguf_says(served: Served) -> None:
    """The GGUF says top_k 1: every reply that leaves sampling to the server is the greedy one (llama-server's too);
    without the key, llama-server's top_k 40 at 0.8 samples (a random-weight model's next token is nearly uniform)."""
    greedy = text(chat(served, "greedy", temperature=0, max_tokens=OPEN_CAP))
    assert [text(chat(served, "greedy")) for _ in range(3)] == [greedy] * 3
    plain_greedy = text(chat(served, "plain", temperature=0, max_tokens=OPEN_CAP))
    assert any(text(chat(served, "plain")) != plain_greedy for _ in range(3))
    assert text(chat(served, "tuned")) == plain_greedy, "the models file's temp 0 is greedy"


def test_a_request_without_an_output_cap_stops_at_the_default_one(served: Served) -> None:
    open_ = chat(served, "plain", temperature=0)
    assert (open_["choices"][0]["finish_reason"], open_["usage"]["completion_tokens"]) == ("length", OPEN_CAP)
    asked = chat(served, "plain", temperature=0, max_tokens=OPEN_CAP + 8)
    assert asked["usage"]["completion_tokens"] == OPEN_CAP + 8, "a request's own cap is not bounded by the default"


def not_offered(s: Served, model: str) -> float:
    """`kvroute_tools_not_offered_total` of `model` in /metrics."""
    for line in httpx.get(f"{s.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'kvroute_tools_not_offered_total{{model="{model}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no kvroute_tools_not_offered_total for {model}")


def test_a_model_without_tool_syntax_is_shown_tools_only_where_asked(served: Served) -> None:
    """As llama-server renders them: the untaught model's reply to a request with tools is its text (the tools a hint,
    counted); a required call is still written; `generic_tools` in the models file shows them to every request."""
    reply = chat(served, "untaught", tools=TOOLS, temperature=0)
    assert reply["choices"][0]["finish_reason"] != "tool_calls" and not reply["choices"][0]["message"].get("tool_calls")
    assert not_offered(served, "untaught") == 1
    forced = chat(served, "untaught", tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not_offered(served, "untaught") == 1
    chat(served, "generic", tools=TOOLS, temperature=0)
    assert not_offered(served, "generic") == 0
    assert props(served, "untaught")["tool_format"] == "generic, only where a call is required (--generic-tools: always)"
    assert props(served, "generic")["tool_format"] == "generic"
    assert props(served, "plain")["tool_format"] == "hermes"
