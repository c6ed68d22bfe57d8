"""Images on every API (gateway/images.py): each API's image part decoded into the submit at its place among the text
parts, the bytes as sent; each bad image a 400 naming the part or its field; the header reader's sizes for each format
served; the bounds as the HTTP server's flags; a large image decoded off the event loop (no model)."""

from __future__ import annotations

import argparse
import base64
import struct
import threading
import zlib
from typing import Any

import pytest
from fake_router import FakeRouter, ScriptedRouter, client_for, result

import gateway.images
from common.config import add_args, from_args
from gateway import anthropic, responses
from gateway.errors import RequestError
from gateway.fields import Policy
from gateway.images import ImageLimits, Images, image_size
from gateway.openai_chat import chat_submit
from gateway.server import HttpConfig
from protocol import ChatMessage, ImagePart, Submit, TextPart


def png(width: int = 1, height: int = 1) -> bytes:
    """A PNG of one red pixel (or a header claiming width x height: the size is read from IHDR alone)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")


def jpeg(width: int, height: int, frame: int = 0xC0) -> bytes:
    """A JPEG's head: APP0 (JFIF), an APP1, fill bytes, then the frame header `frame` (SOF0 baseline, SOF2 ...)."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    app1 = b"\xff\xe1" + struct.pack(">H", 8) + b"Exif\x00\x00"
    sof = bytes([0xFF, frame]) + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9)
    return b"\xff\xd8" + app0 + app1 + b"\xff\xff" + sof + b"\xff\xda\x00\x02\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00;"


def bmp(width: int, height: int, core: bool = False) -> bytes:
    dib = struct.pack("<IHH", 12, width, height) if core else struct.pack("<Iii", 40, width, height) + bytes(28)
    return b"BM" + struct.pack("<IHHI", 14 + len(dib), 0, 0, 14 + len(dib)) + dib


def webp(kind: bytes, width: int, height: int) -> bytes:
    if kind == b"VP8 ":
        body = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    elif kind == b"VP8L":
        body = b"\x2f" + struct.pack("<I", (width - 1) | (height - 1) << 14)
    else:
        body = bytes(4) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunk = kind + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


RED = png()
B64 = base64.b64encode(RED).decode()


# ---- the header reader ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "size"),
    [
        (png(), ("PNG", 1, 1)),
        (png(3000, 2000), ("PNG", 3000, 2000)),
        (jpeg(640, 488), ("JPEG", 640, 488)),
        (jpeg(33, 44, frame=0xC2), ("JPEG", 33, 44)),  # progressive
        (gif(5, 7), ("GIF", 5, 7)),
        (bmp(10, -20), ("BMP", 10, 20)),  # (a top-down image: negative height)
        (bmp(12, 13, core=True), ("BMP", 12, 13)),
        (webp(b"VP8 ", 320, 200), ("WebP", 320, 200)),
        (webp(b"VP8L", 16, 9), ("WebP", 16, 9)),
        (webp(b"VP8X", 4000, 3000), ("WebP", 4000, 3000)),
    ],
)
def test_the_header_gives_each_format_s_size(data: bytes, size: tuple[str, int, int]) -> None:
    assert image_size(data) == size


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"II*\x00" + bytes(20), "not a PNG, JPEG, GIF, BMP or WebP image"),  # TIFF
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "not a PNG, JPEG, GIF, BMP or WebP image"),
        (RED[:20], "cut short"),
        (b"\xff\xd8\xff\xda\x00\x02", "cut short"),  # a scan before any frame header
        (gif(0, 7), "gives no size"),
        (webp(b"VP8 ", 1, 1).replace(b"\x9d\x01\x2a", b"xxx"), "cut short"),
    ],
)
def test_what_is_no_image_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(RequestError) as info:
        image_size(data, "x")
    assert info.value.status == 400 and info.value.param == "x" and why in info.value.message


# ---- Chat Completions -------------------------------------------------------------------------------------------


def chat(content: Any, images: Images | None = None, role: str = "user", **body: Any) -> Submit:
    messages = [{"role": "system", "content": "s"}, {"role": role, "content": content}]
    return chat_submit({"messages": messages, **body}, "r", None, images)[0]


def image_url(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def test_chat_image_parts_become_image_parts_in_their_place() -> None:
    sub = chat([{"type": "text", "text": "Compare"}, image_url(data_url(RED), detail="low"), {"type": "text", "text": "with"},
                image_url(B64)])  # fmt: skip  # (bare base64, as llama-server takes it)
    m = (sub.messages or [])[1]
    assert m.content == [TextPart(text="Compare"), ImagePart(data=RED, detail="low"), TextPart(text="with"), ImagePart(data=RED)]
    wrapped = "data:image/png;base64," + "\n".join(B64[i : i + 76] for i in range(0, len(B64), 76))  # (MIME's lines)
    assert (chat([image_url(wrapped)]).messages or [])[1].images() == [ImagePart(data=RED)]


@pytest.mark.parametrize(
    ("part", "param", "why"),
    [
        (image_url("https://example.com/cat.png"), ".image_url.url", "does not fetch URLs"),
        (image_url("http://127.0.0.1/x.png"), ".image_url.url", "data URL"),
        (image_url("file:///etc/passwd"), ".image_url.url", "file: URLs are not served"),
        (image_url("data:image/png;base64,%%%%"), ".image_url.url", "not valid base64"),
        (image_url("data:image/png," + B64), ".image_url.url", "must be base64"),
        (image_url(data_url(RED, "text/plain")), ".image_url.url", "not an image"),
        (image_url(data_url(b"just some text")), ".image_url.url", "not a PNG, JPEG, GIF, BMP or WebP image"),
        (image_url(data_url(png(9000, 10))), ".image_url.url", "at most 8192 on a side"),
        (image_url(data_url(png(8000, 8000))), ".image_url.url", "at most 33000000 are served"),
        (image_url(data_url(RED), detail="x" * 40), ".image_url.detail", ""),
        ({"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}, "", "not supported"),
    ],
)
def test_a_bad_chat_image_is_a_400_naming_it(part: dict[str, Any], param: str, why: str) -> None:
    with pytest.raises(RequestError) as info:
        chat([{"type": "text", "text": "see"}, part])
    assert info.value.status == 400 and info.value.param == "messages[1].content[1]" + param
    assert why in info.value.message


@pytest.mark.parametrize("role", ["assistant", "system", "developer", "tool"])
def test_chat_images_are_served_in_user_messages_only(role: str) -> None:
    extra = {"tool_call_id": "c"} if role == "tool" else {}
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": [image_url(data_url(RED))], **extra}]
    with pytest.raises(RequestError) as info:
        chat_submit({"messages": messages}, "r")
    assert info.value.param == "messages[1].content[0]" and "user messages" in info.value.message


def test_the_bounds_on_bytes_and_count_name_the_part() -> None:
    with pytest.raises(RequestError) as info:
        chat([image_url(data_url(RED))], Images(ImageLimits(max_bytes=len(RED) - 1)))
    assert info.value.param == "messages[1].content[0].image_url.url" and "--max-image-bytes" in info.value.message
    with pytest.raises(RequestError) as info:  # (too long to be decoded at all)
        chat([image_url(data_url(RED * 100))], Images(ImageLimits(max_bytes=10)))
    assert info.value.param == "messages[1].content[0].image_url.url" and "--max-image-bytes" in info.value.message
    three = [image_url(data_url(RED))] * 3
    assert len((chat(three, Images(ImageLimits(max_images=3))).messages or [])[1].images()) == 3
    with pytest.raises(RequestError) as info:
        chat(three, Images(ImageLimits(max_images=2)))
    assert info.value.param == "messages[1].content[2]" and "more than 2 images" in info.value.message
    with pytest.raises(RequestError) as info:
        chat([image_url(data_url(png(100, 50)))], Images(ImageLimits(max_side=99)))
    assert "--max-image-side" in info.value.message
    with pytest.raises(RequestError) as info:
        chat([image_url(data_url(png(100, 50)))], Images(ImageLimits(max_pixels=4999)))
    assert "--max-image-pixels" in info.value.message


# ---- Responses --------------------------------------------------------------------------------------------------


def input_image(url: str | None = None, **more: Any) -> dict[str, Any]:
    return {"type": "input_image", **({"image_url": url} if url is not None else {}), **more}


def test_responses_input_images_in_messages_and_in_call_outputs() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is"}, input_image(data_url(RED), detail="high"),
                                     {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Here:"},
                                                                     input_image(data_url(RED))]},
    ]  # fmt: skip
    sub, _, _ = responses.responses_submit({"input": items}, "r")
    user, _, tool = sub.messages or []
    assert user.content == [TextPart(text="What is"), ImagePart(data=RED, detail="high"), TextPart(text="?")]
    assert tool.role == "tool" and tool.content == [TextPart(text="Here:"), ImagePart(data=RED)]
    text_only = [*items[:2], {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]}]
    assert (responses.responses_submit({"input": text_only}, "r")[0].messages or [])[2].content == "ok"  # (as before)


@pytest.mark.parametrize(
    ("part", "param", "why"),
    [
        (input_image(file_id="file-123"), ".file_id", "keeps no files"),
        (input_image("https://example.com/cat.png"), ".image_url", "does not fetch URLs"),
        (input_image(), ".image_url", "needs `image_url`"),
        (input_image(data_url(b"GIF89a")), ".image_url", "cut short"),
        ({"type": "input_file", "file_data": "x"}, "", "not supported"),
    ],
)
def test_a_bad_responses_image_is_a_400_naming_it(part: dict[str, Any], param: str, why: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.responses_submit({"input": [{"role": "user", "content": [part]}]}, "r")
    assert info.value.status == 400 and info.value.param == "input[0].content[0]" + param and why in info.value.message


def test_responses_images_are_not_in_an_assistant_s_output() -> None:
    with pytest.raises(RequestError) as info:
        responses.responses_submit({"input": [{"role": "assistant", "content": [input_image(data_url(RED))]}]}, "r")
    assert info.value.param == "input[0].content[0]"


# ---- Anthropic Messages -----------------------------------------------------------------------------------------


def image_block(data: str = B64, media_type: str = "image/png", **block: Any) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}, **block}


def messages(*turns: dict[str, Any], images: Images | None = None) -> list[ChatMessage]:
    return anthropic.messages_request({"max_tokens": 8, "messages": list(turns)}, "r", None, images)[0].messages or []


def test_anthropic_image_blocks_in_user_turns() -> None:
    turn = {"role": "user", "content": [image_block(cache_control={"type": "ephemeral"}), {"type": "text", "text": "What?"}]}
    policy = Policy("messages", strict=True)  # (cache_control is a known hint: served)
    (m,) = anthropic.messages_request({"max_tokens": 8, "messages": [turn]}, "r", policy)[0].messages or []
    assert m.role == "user" and m.content == [ImagePart(data=RED), TextPart(text="What?")]
    assert policy.ignored == ["messages[].content[].cache_control"]


def test_an_image_in_a_tool_result_is_the_tool_message_s_image() -> None:
    """Claude Code's Read tool on a PNG answers with the image in the tool_result's content."""
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                              "input": {"file_path": "/tmp/shot.png"}}]}  # fmt: skip
    result_turn = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image_block(cache_control={"type": "ephemeral"})]},
            {"type": "text", "text": "What does the screenshot show?"},
        ],
    }
    ask = {"role": "user", "content": "Look at /tmp/shot.png"}
    policy = Policy("messages", strict=True)
    body = {"max_tokens": 8, "messages": [ask, call, result_turn]}
    _, _, tool, user = anthropic.messages_request(body, "r", policy)[0].messages or []
    assert policy.ignored == ["messages[].content[].content[].cache_control"]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "toolu_1", [ImagePart(data=RED)])
    assert user.content == [TextPart(text="What does the screenshot show?")]
    failed = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                           "content": [image_block(), {"type": "text", "text": "cut"}]}]}  # fmt: skip
    assert messages(ask, call, failed)[2].content == [TextPart(text="Error: "), ImagePart(data=RED), TextPart(text="cut")]
    text_only = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "a"}]}]}  # fmt: skip
    assert messages(ask, call, text_only)[2].content == "a"  # (as before)


@pytest.mark.parametrize(
    ("block", "where", "why"),
    [
        ({"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}, ".source.type", "does not fetch"),
        ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, ".source.type", "keeps no files"),
        (image_block(media_type="application/pdf"), ".source.media_type", "not an image"),
        (image_block(data="not base64!"), ".source.data", "not valid base64"),
        (image_block(data=base64.b64encode(b"%PDF-1.7").decode()), ".source.data", "not a PNG"),
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, ".source.data", "needs its `data`"),
    ],
)
def test_a_bad_anthropic_image_is_a_400_naming_it(block: dict[str, Any], where: str, why: str) -> None:
    for turn, at in (
        ({"role": "user", "content": [block]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [block]}]},
         "messages[0].content[0].content[0]"),
    ):  # fmt: skip
        with pytest.raises(RequestError) as info:
            messages(turn)
        assert info.value.status == 400 and at + where in info.value.message and why in info.value.message


def test_anthropic_images_count_together_and_not_in_assistant_turns() -> None:
    tool_turn = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image_block()]},
                                             image_block()]}  # fmt: skip
    assert len(messages(tool_turn, images=Images(ImageLimits(max_images=2)))) == 2
    with pytest.raises(RequestError) as info:
        messages(tool_turn, images=Images(ImageLimits(max_images=1)))
    assert info.value.param == "messages[0].content[1]" and "more than 1 images" in info.value.message
    with pytest.raises(RequestError) as info:
        messages({"role": "user", "content": "hi"}, {"role": "assistant", "content": [image_block()]})
    assert info.value.param == "messages[1].content[0]" and "user turns and tool results" in info.value.message


# ---- over HTTP: the flags, the event loop -----------------------------------------------------------------------


def test_the_bounds_are_flags_of_the_http_server() -> None:
    assert HttpConfig().image_limits() == ImageLimits(20 * 1024 * 1024, 16, 8192, 33_000_000)
    parser = argparse.ArgumentParser()
    add_args(parser, HttpConfig)
    flags = ["--max-image-bytes", "1000", "--max-images", "2", "--max-image-side", "64", "--max-image-pixels", "900"]
    assert from_args(HttpConfig, parser.parse_args(flags)).image_limits() == ImageLimits(1000, 2, 64, 900)
    with pytest.raises(ValueError, match="--max-images"):
        HttpConfig(max_images=-1)


@pytest.mark.anyio
async def test_each_api_sends_the_image_and_the_gateway_s_bounds_apply() -> None:
    fake = ScriptedRouter(result(text="A red pixel."))
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": [image_url(data_url(RED))]}]},
        "/v1/responses": {"input": [{"role": "user", "content": [input_image(data_url(RED))]}]},
        "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": [image_block()]}]},
    }
    async with client_for(fake) as c:
        for path, body in bodies.items():
            r = await c.post(path, json=body)
            assert r.status_code == 200, r.text
        r = await c.post("/v1/messages/count_tokens", json={"messages": bodies["/v1/messages"]["messages"]})
        assert r.status_code == 200, r.text
    assert [(s.messages or [])[-1].images() for s in fake.submits] == [[ImagePart(data=RED)]] * 3
    assert fake.tokenized[0].messages and fake.tokenized[0].messages[0].images() == [ImagePart(data=RED)]
    async with client_for(FakeRouter(), image_limits=ImageLimits(max_images=0)) as c:
        r = await c.post("/v1/chat/completions", json=bodies["/v1/chat/completions"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
        r = await c.post("/v1/messages", json=bodies["/v1/messages"])
        assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_large_image_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    decoded = gateway.images.decoded

    def watched(text: str, field: str) -> bytes:
        threads.append(threading.current_thread())
        return decoded(text, field)

    monkeypatch.setattr(gateway.images, "decoded", watched)
    big = RED + bytes(64 * 1024)  # (a PNG's trailing bytes: the header is what is read)
    fake = FakeRouter()
    async with client_for(fake) as c:
        body = {"messages": [{"role": "user", "content": [image_url(data_url(big))]}]}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    assert threads and threads[0] is not threading.main_thread()
    assert (fake.submits[0].messages or [])[0].images() == [ImagePart(data=big)]
