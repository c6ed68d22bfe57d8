"""Images end to end (issue 64): one real `kvroute serve --mmproj` with the default model and the tiny random-weight
Gemma 3 projector (bench/tiny_mmproj.py), and llama-server with `--mmproj` on the same files as the reference. A chat
request with an image counts the prompt's tokens as llama-server does, a repeat of the conversation reuses the image as
text is reused (at least llama-server's reuse), Claude Code's shape (an image inside a `tool_result`) and Responses'
`input_image` are served, and another image is computed again from its first row. The same for a tiny M-RoPE model
(Qwen-VL's kind: an image advances fewer positions than its rows) against llama-server, reply for reply."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from served import Served

from bench import tiny_archs
from bench.tiny_mmproj import check as llama_server_check
from bench.tiny_mmproj import mmproj, png, qwen2vl_mmproj, tokens_per_image

pytestmark = pytest.mark.model

N_IMG = tokens_per_image()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_body(data: bytes, after: str = "") -> dict[str, Any]:  # (what bench/tiny_mmproj.py `check` sends llama-server)
    return {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(data)}},
            *([{"type": "text", "text": after}] if after else []),
        ]}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
    }  # fmt: skip


@pytest.fixture(scope="module")
def seer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("images"))
    proj = mmproj(tmp / "tiny-mmproj.gguf")
    flags = ("--mmproj", str(proj), "--slots", "2", "--ctx-per-slot", "2048", "--threads", "1")
    s = Served(*flags, log=tmp / "serve.log")
    yield s
    s.stop()


def text_tokens(s: Served, prompt: str) -> int:
    """Tokens of a rendered prompt's text, its media marker (llama-server's is random) left out."""
    text = re.sub(r"<__media(_[A-Za-z0-9]+)?__>", "", prompt)
    return len(post(s, "/tokenize", {"content": text})["tokens"])


def post(s: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{s.url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_an_image_counts_as_llama_server_counts_it_and_a_repeat_reuses_it(seer: Served, tmp_path: Path) -> None:
    reference = llama_server_check(tmp_path)  # (llama-server on the same model and projector, the same request twice)
    picture = png(48, 40, seed=1)
    first = post(seer, "/v1/chat/completions", chat_body(picture))["usage"]
    again = post(seer, "/v1/chat/completions", chat_body(picture))["usage"]
    # an image takes as many positions as llama-server gives it: the prompt's tokens less its text's, on both (their
    # texts differ by a newline: llama-server's legacy template path writes one before the image, its Jinja path not)
    ours = post(seer, "/apply-template", chat_body(picture))["prompt"]
    rows = first["prompt_tokens"] - text_tokens(seer, ours)
    theirs = reference["reply1"]["usage"]["prompt_tokens"] - text_tokens(seer, reference["prompt"])
    assert rows == theirs >= N_IMG
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reference["reply2"]["timings"]["cache_n"], (again, reference["reply2"])
    other = post(seer, "/v1/chat/completions", chat_body(png(48, 40, seed=2)))["usage"]
    assert other["prompt_tokens"] == first["prompt_tokens"]
    assert other["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] - N_IMG  # the new image is computed


def test_claude_codes_image_in_a_tool_result_and_responses_input_image(seer: Served) -> None:
    picture = png(40, 40, seed=5)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(picture).decode()}
    messages = [
        {"role": "user", "content": "Read the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "s.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": source}]}]},
    ]  # fmt: skip
    tools = [{"name": "Read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    body = {"model": "m", "max_tokens": 4, "messages": messages, "tools": tools, "temperature": 0}
    reply = post(seer, "/v1/messages", body)
    assert reply["usage"]["input_tokens"] + reply["usage"].get("cache_read_input_tokens", 0) > N_IMG
    again = post(seer, "/v1/messages", body)
    assert again["usage"]["cache_read_input_tokens"] > N_IMG  # the screenshot's rows are reused

    item = {"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                        {"type": "input_image", "image_url": data_url(picture)}]}  # fmt: skip
    out = post(seer, "/v1/responses", {"input": [item], "max_output_tokens": 4, "temperature": 0})
    assert out["status"] in ("completed", "incomplete") and out["usage"]["input_tokens"] > N_IMG


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3-VL model (M-RoPE, attention alone; weights of stdev 0.5, so positions change its replies) and the
    tiny Qwen2-VL projector."""
    tmp = Path(tmp_path_factory.mktemp("qwen-images"))
    return tiny_archs.model("qwen3vl", stdev=0.5), qwen2vl_mmproj(tmp / "tiny-qwen2vl.gguf")


@pytest.fixture(scope="module")
def qwen_seer(qwen_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model, proj = qwen_files
    flags = ("--model", str(model), "--mmproj", str(proj), "--chat-template", "chatml", "--slots", "2",
             "--ctx-per-slot", "2048", "--threads", "1")  # fmt: skip
    s = Served(*flags, log=Path(tmp_path_factory.mktemp("qwen-serve")) / "serve.log")
    yield s
    s.stop()


def test_an_mrope_image_is_served_as_llama_server_serves_it(
    qwen_seer: Served, qwen_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """An image of 4 x 2 merged patches: 8 rows, 4 positions (Qwen-VL's M-RoPE). The prompt's tokens, the reply, and
    the repeat's reuse are llama-server's on the same files (the reply is greedy: the text after the image must sit
    at the positions llama.cpp gives it)."""
    picture, after = png(32, 16, seed=1), "Tell me what it shows, and what is in its corners, in a few words."
    model, proj = qwen_files
    reference = llama_server_check(tmp_path, model, proj, ("--jinja", "--chat-template", "chatml"), picture, after)
    first = post(qwen_seer, "/v1/chat/completions", chat_body(picture, after))
    again = post(qwen_seer, "/v1/chat/completions", chat_body(picture, after))
    assert first["usage"]["prompt_tokens"] == reference["reply1"]["usage"]["prompt_tokens"]
    for ours, theirs in ((first, reference["reply1"]), (again, reference["reply2"])):
        assert ours["choices"][0]["message"]["content"] == theirs["content"]
        logprobs = [t["logprob"] for t in ours["choices"][0]["logprobs"]["content"]]
        # (with the text after the image placed as one position a row, the first differs by 0.017)
        assert logprobs == pytest.approx(theirs["logprobs"], abs=1e-3), (logprobs, theirs["logprobs"])
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= reference["reply2"]["timings"]["cache_n"], (again["usage"], reference["reply2"])
