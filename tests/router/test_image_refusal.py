"""Images reach the router in a submit's messages; a model without a vision projector refuses them, naming the first
image part and how to serve one (`--mmproj`), before any rendering or tokenizing (vocabulary only, no weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from chat.request import MEDIA_MARKER, ChatFormat
from chat.template import ChatTemplate
from protocol import ChatMessage, ImagePart, Sampling, Submit, TextPart, Tokenize
from router.client_requests import ClientRequests
from router.prepare import PrepareError, check_images, first_image, prepare, tokens_reply

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c49444154789c63f8cfc0000003010100c9fe92ef"
    "0000000049454e44ae426082"
)
MESSAGES = [
    ChatMessage(role="user", content="Hello"),
    ChatMessage(role="assistant", content="Hi."),
    ChatMessage(role="user", content=[TextPart(text="What is this?"), ImagePart(data=PNG), ImagePart(data=PNG)]),
]


def chat() -> ChatFormat:
    return ChatFormat(ChatTemplate.choose(None, None, "gemma", bos_text="<bos>"))


def test_a_model_without_a_projector_refuses_images_naming_the_first() -> None:
    sub = Submit(id="s", messages=MESSAGES, sampling=Sampling(max_tokens=4))
    assert first_image(MESSAGES) == "messages[2].content[1]"
    for work in (
        lambda: prepare(sub, None, chat()),  # type: ignore[arg-type]  # (refused before the vocabulary is used)
        lambda: tokens_reply(Tokenize(messages=MESSAGES), None, chat()),  # type: ignore[arg-type]
    ):
        with pytest.raises(PrepareError) as info:
            work()
        assert info.value.param == "messages[2].content[1]"
        assert "no vision projector" in str(info.value) and "--mmproj FILE" in str(info.value)


def test_requests_without_images_are_not_refused() -> None:
    check_images(Submit(messages=MESSAGES[:2]), chat())
    check_images(Submit(prompt="x"), chat())


def test_with_a_projector_the_prompt_carries_a_marker_per_image(vocab) -> None:
    fmt = chat()
    fmt.vision = object()  # (what the router sets for a model served with --mmproj)
    p = prepare(Submit(id="s", messages=MESSAGES, sampling=Sampling(max_tokens=4)), vocab, fmt)
    assert p.text.count(MEDIA_MARKER) == 2 and "What is this?<__media__><__media__>" in p.text


def test_a_submit_with_an_image_is_never_small_work() -> None:
    """The preparing threads' small-work one takes a submit whose frame is small and whose texts tokenize fast; a few
    bytes of PNG may unpack to megapixels that the projector resizes, so a submit with an image never counts as small."""
    model = SimpleNamespace(prompts=SimpleNamespace(cost=SimpleNamespace(seconds=lambda text, exact: 0.0)))
    text_only = Submit(id="s", messages=MESSAGES[:2], sampling=Sampling(max_tokens=4))
    with_image = Submit(id="s", messages=MESSAGES, sampling=Sampling(max_tokens=4))
    assert ClientRequests._small(text_only, 200, model)  # type: ignore[arg-type]
    assert not ClientRequests._small(with_image, 200, model)  # type: ignore[arg-type]
