"""bench/images.py's pieces that need no server: each API's request about an image and its follow-up, reading each
API's usage, and llama-server's encode times from its log."""

from __future__ import annotations

from bench.images import body, encode_ms, usage

PNG = b"\x89PNG\r\n\x1a\nfake"


def test_each_api_asks_about_the_image_and_follows_up() -> None:
    for api, path in (("chat", "/v1/chat/completions"), ("messages", "/v1/messages"), ("responses", "/v1/responses")):
        got_path, first = body(api, PNG, None)
        _, second = body(api, PNG, "A red square.")
        assert got_path == path
        history = first.get("messages") or first["input"]
        longer = second.get("messages") or second["input"]
        assert longer[: len(history)] == history and len(longer) == len(history) + 2  # (the reply, then the question)
        assert "iVBORw0KGgpmYWtl" in str(history)  # (the image, base64, where each API takes it)


def test_usage_is_read_as_each_api_reports_it() -> None:
    chat = {
        "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 30}},
        "choices": [{"message": {"content": "x"}}],
    }
    messages = {"usage": {"input_tokens": 10, "cache_read_input_tokens": 30}, "content": [{"type": "text", "text": "y"}]}
    responses = {
        "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 30}},
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "z"}]}],
    }
    assert usage("chat", chat) == (40, 30, "x")
    assert usage("messages", messages) == (40, 30, "y")  # (Anthropic's input_tokens leave out what was read from cache)
    assert usage("responses", responses) == (40, 30, "z")


def test_llama_servers_encode_is_from_its_start_to_its_rows() -> None:
    log = "\n".join([
        "0.00.206.861 I slot process_mtmd: id  0 | task 0 | encoding mtmd batch from idx = 13, n_chunks = 1",
        "0.00.209.360 I decoding image batch 1/1, n_tokens_batch = 96",
        "1.02.000.000 I slot process_mtmd: id  0 | task 3 | encoding mtmd batch from idx = 13, n_chunks = 1",
        "1.02.031.500 I decoding image batch 1/2, n_tokens_batch = 64",
        "1.02.040.000 I decoding image batch 2/2, n_tokens_batch = 32",
    ])  # fmt: skip
    assert encode_ms(log) == [2.5, 31.5]
