"""bench/images.py's pieces that need no server: each API's request about an image and its follow-up, reading each
API's usage, and llama-server's encode times from its log."""

from __future__ import annotations

from bench.images import body, encode_ms, table, usage

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


def test_the_table_takes_tokens_from_the_first_run_and_every_repeats_times() -> None:
    def run(ms: float, encode: float, cached: int = 30) -> dict:
        rows = [{"turn": t, "prompt": 40, "cached": cached, "computed": 40 - cached, "prompt_ms": ms} for t in (1, 2, 3)]
        return {"apis": {"chat": rows}, "images_encoded": 2, "encode_ms_each": encode, "mispredictions": 0.0}

    report = {"cases": {"c": {"kvroute": [run(10.0, 1.5), run(11.0, 1.6)], "llama-server": [run(9.0, 1.0), run(9.5, 1.1)]}}}
    text = table(report)
    assert "| c | chat | 1 | 40 / 40 | 10 (30) | 10 (30) | yes |" in text
    assert "encode ms, kvroute / llama-server, each repeat: 1.5 / 1.0, 1.6 / 1.1" in text
    assert "chat turn 3 prompt ms, each repeat: 10.0 / 9.0, 11.0 / 9.5" in text
    report["cases"]["c"]["kvroute"][1] = run(11.0, 1.6, cached=20)  # (a repeat that reused otherwise: said so)
    assert "| c | chat | 1 | 40 / 40 | 10 (30) | 10 (30) | no |" in table(report)
