"""Images in a chat request, rendered: the text a template sees carries llama.cpp mtmd's media marker where each image
is, the parts joined as llama-server joins content parts with media (common/chat.cpp `to_json_oaicompat`: a newline
between two text parts, nothing before or after a marker); text-only content renders as before (no model)."""

from __future__ import annotations

import pytest
from conftest import chat_format

from chat.grammar import ChatError
from chat.request import MEDIA_MARKER, ChatFormat, content_text
from chat.template import ChatTemplate
from protocol import ChatMessage, ImagePart, Submit, TextPart, ToolCall

PNG = b"\x89PNG\r\n\x1a\n"  # (the renderer does not read the bytes)
IMAGE = ImagePart(data=PNG)
GEMMA = ChatFormat(ChatTemplate.choose(None, None, "gemma", bos_text="<bos>"))


def parts(*items: str | None) -> ChatMessage:
    """A user message of text parts, None standing for an image."""
    return ChatMessage(role="user", content=[IMAGE if x is None else TextPart(text=x) for x in items])


def test_the_marker_is_llama_cpp_s_default() -> None:
    assert MEDIA_MARKER == "<__media__>"  # mtmd_default_marker(); llama-server's with LLAMA_MEDIA_MARKER unset is random


@pytest.mark.parametrize(
    ("items", "text"),
    [
        (("What is this?", None), "What is this?<__media__>"),
        ((None, "Describe it."), "<__media__>Describe it."),
        (("Compare", None, "and", None, "please."), "Compare<__media__>and<__media__>please."),
        (("One.", "Two.", None, "Three.", "Four."), "One.\nTwo.<__media__>Three.\nFour."),
        ((None, None), "<__media__><__media__>"),
        (("", "a", None), "a<__media__>"),  # (a newline only after text already written)
    ],
)
def test_parts_with_images_join_as_llama_server_joins_them(items: tuple[str | None, ...], text: str) -> None:
    m = parts(*items)
    assert content_text(m) == text
    assert m.text() == "".join(x for x in items if x is not None)  # (text() stays text only)
    assert m.images() == [IMAGE] * items.count(None)


def test_text_only_parts_render_as_before() -> None:
    assert content_text(parts("One.", "Two.")) == "One.Two."


def test_the_template_sees_the_markers_where_the_images_are() -> None:
    sub = Submit(
        messages=[
            ChatMessage(role="system", content="Be brief."),
            parts("What is in", None, "this picture?"),
            ChatMessage(role="assistant", content="A cat."),
            parts(None, "And this one?"),
        ]
    )
    text = GEMMA.prepare(sub).text
    assert "<start_of_turn>user\nBe brief.\n\nWhat is in<__media__>this picture?<end_of_turn>" in text
    assert "<start_of_turn>user\n<__media__>And this one?<end_of_turn>" in text
    assert text.count(MEDIA_MARKER) == 2


def test_a_tool_result_s_image_renders_in_the_tool_message() -> None:
    fmt = chat_format("Qwen-Qwen2.5-7B-Instruct")
    call = ToolCall(id="c1", name="Read", arguments='{"file_path": "/tmp/a.png"}')
    sub = Submit(
        messages=[
            ChatMessage(role="user", content="Look at /tmp/a.png"),
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id="c1", content=[TextPart(text="The image:"), IMAGE]),
        ]
    )
    text = fmt.prepare(sub).text
    assert "<tool_response>\nThe image:<__media__>\n</tool_response>" in text


def test_text_holding_the_marker_is_refused_beside_images() -> None:
    sub = Submit(messages=[ChatMessage(role="user", content="a <__media__> here"), parts("see", None)])
    with pytest.raises(ChatError) as info:
        GEMMA.prepare(sub)
    assert info.value.param == "messages[0].content" and MEDIA_MARKER in str(info.value)
    sub = Submit(messages=[parts("see <__media__>", None)])
    with pytest.raises(ChatError) as info:
        GEMMA.prepare(sub)
    assert info.value.param == "messages[0].content[0]"
    # without images the marker is text like any other
    assert "a <__media__> here" in GEMMA.prepare(Submit(messages=[ChatMessage(role="user", content="a <__media__> here")])).text


def test_vision_is_off_until_the_router_gives_a_projector() -> None:
    assert GEMMA.vision is None
