"""The real server with other families' chat templates (`--chat-template FILE`, and one taken from a GGUF's own
metadata): a forced call parses and validates, its round trip stays cached, a template's own error is a 400."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from served import Served

from common.files import made_once
from common.model import cache_dir, resolve_model

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city", "parameters": PARAMS}}]
ASK = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Rome?"}]


def serve(tmp: Path, *flags: str) -> Served:
    return Served("--workers", "1", "--slots", "1", "--ctx-per-slot", "2048", "--threads", "2", *flags, log=tmp / "serve.log")


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0, timeout=120)


def call_and_round_trip(s: Served, stable: bool) -> str:
    """A forced call that validates; the next turn reuses the prompt (and, if the template is prefix-stable, the
    call too). Returns the raw reply text (from the log-probability pieces)."""
    c = client(s)
    first = c.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=48, logprobs=True,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    raw = "".join(lp.token for lp in choice.logprobs.content)
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"c": 18}'},
    ]
    second = c.chat.completions.create(model="default", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    cached, before = second.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens
    assert cached >= 0.9 * before, (cached, before)
    if stable:  # all of it but, at most, its last token: these templates' markers are text to the default model's
        assert cached >= before - 1, (cached, before)  # vocabulary, which may merge it with the reply's first
    return raw


@pytest.mark.parametrize(
    ("template", "marker", "stable"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", "<tool_call>", True),
        ("meta-llama-Llama-3.2-3B-Instruct", '{"name": "get_weather", "parameters": ', True),
        ("Mistral-Small-3.2-24B-Instruct-2506", "[TOOL_CALLS]get_weather[CALL_ID]", True),
        ("google-gemma-4-31B-it", "<|tool_call>call:get_weather{", False),
    ],
)
def test_a_family_template_served(template: str, marker: str, stable: bool, tmp_path: Path) -> None:
    s = serve(tmp_path, "--chat-template", str(TEMPLATES / f"{template}.jinja"))
    try:
        assert marker in call_and_round_trip(s, stable)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def hermes_gguf() -> Path:
    """A copy of the default model whose GGUF carries Qwen 2.5's chat template (written with the `gguf` package, ~12 s
    on 2 cores), kept in the model cache beside the tiny architectures' (bench/tiny_archs.py), named by what it is
    made of: the model's file and the template's text."""
    model, template = resolve_model(None), TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
    made_of = f"{model.name}:{model.stat().st_size}:".encode() + template.read_bytes()
    out = cache_dir() / "derived" / f"{model.stem}-qwen-template-{hashlib.sha256(made_of).hexdigest()[:12]}.gguf"

    def make(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model), str(tmp), "--force",
               "--chat-template-file", str(template)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    return made_once(out, make)


def test_the_family_is_detected_from_the_gguf_s_own_template(hermes_gguf: Path, tmp_path: Path) -> None:
    s = serve(tmp_path, "--model", str(hermes_gguf))
    try:
        assert "<tool_call>" in call_and_round_trip(s, stable=True)
        log = (tmp_path / "serve.log").read_text()
        assert '"chat_template": "gguf"' in log and '"tool_calls": "hermes"' in log
    finally:
        s.stop()


def test_a_template_error_is_a_400_quoting_it_and_the_server_goes_on(tmp_path: Path) -> None:
    s = serve(tmp_path, "--chat-template", str(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as http:
            twice = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
            r = http.post("/v1/chat/completions", json=twice)
            assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages"
            ok = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        s.stop()
