"""--context-shift in the router: which history `prepare` keeps (real vocabulary, built-in Gemma template, no
weights), and what the core tells the client (plain calls)."""

from __future__ import annotations

import numpy as np
from scheduler_helpers import CLIENT, core, done, hello, jobs, to_client

from bench.tiny_mmproj import mmproj, png, tokens_per_image
from chat.output import OutputSpec
from chat.request import ChatFormat, shift_points, shifted
from chat.template import ChatTemplate
from common.projector import Projector
from protocol import ChatMessage, Error, ImagePart, Result, Sampling, Submit, TextPart
from router.prepare import Prepared, Shift, fits, prepare

CTX = 256
CHAT = ChatFormat(ChatTemplate.choose(None, None, "gemma", bos_text="<bos>"))


def conversation(turns: int) -> list[ChatMessage]:
    history = [ChatMessage(role="system", content="You are the harbour master. Answer briefly.")]
    for t in range(turns):
        history.append(ChatMessage(role="user", content=f"Turn {t}: which boats came home at dusk, and from where?"))
        history.append(ChatMessage(role="assistant", content=f"Turn {t}: the red trawler and two sloops from the north."))
    history.append(ChatMessage(role="user", content="And which one is still out?"))
    return history


def chat_submit(messages: list[ChatMessage], max_tokens: int | None = 16) -> Submit:
    return Submit(id="s", messages=messages, sampling=Sampling(max_tokens=max_tokens))


def test_the_oldest_turns_are_dropped_until_the_prompt_fits_and_no_more(vocab) -> None:
    history = conversation(12)
    sub = chat_submit(history)
    whole = prepare(sub, vocab, CHAT)
    assert whole.shift is None and len(whole.tokens) > CTX  # too long for the slot
    assert prepare(sub, vocab, CHAT, shift_to=4 * CTX).shift is None  # it fits a larger slot: untouched
    p = prepare(sub, vocab, CHAT, shift_to=CTX)
    assert p.shift is not None and p.shift.messages > 0 and fits(len(p.tokens), 16, CTX)
    assert p.shift.tokens == len(whole.tokens) - len(p.tokens)
    text = vocab.detokenize(p.tokens.tolist())
    assert "harbour master" in text and "still out?" in text and "Turn 0:" not in text  # system + last question kept
    # the fewest dropped: resuming one place earlier would not fit
    points = shift_points(history)
    at = next(a for a in points if len(history) - len(shifted(history, a)) == p.shift.messages)
    earlier = points[points.index(at) - 1]
    longer = prepare(chat_submit(shifted(history, earlier)), vocab, CHAT)
    assert not fits(len(longer.tokens), 16, CTX)


def test_a_history_that_cannot_fit_comes_back_shortened_as_far_as_allowed(vocab) -> None:
    history = conversation(3)
    history[-1] = ChatMessage(role="user", content="Tell me everything about the harbour. " * 60)  # alone > CTX
    p = prepare(chat_submit(history), vocab, CHAT, shift_to=CTX)
    assert p.shift is not None and p.shift.messages == 6 and len(p.tokens) > CTX  # only system + last user left
    lone = [history[0], history[-1]]
    p = prepare(chat_submit(lone), vocab, CHAT, shift_to=CTX)
    assert p.shift == Shift(0, 0)  # nothing could be dropped


def prepared_shift(s, rid: str, n_tokens: int, shift: Shift, max_tokens: int = 8) -> list:
    req = s.accept(CLIENT, (), Submit(id=rid, prompt="x", sampling=Sampling(max_tokens=max_tokens, temperature=0.0)))
    assert req is not None
    s.prepared(req, Prepared(np.arange(100, 100 + n_tokens, dtype=np.int32), None, OutputSpec(), shift))
    return s.take()


def test_the_result_says_what_was_dropped_and_an_overflow_names_both_numbers() -> None:
    s = core(context_shift=True)
    hello(s, slots=1, ctx_per_slot=CTX)
    (job,) = jobs(prepared_shift(s, "ok", 200, Shift(messages=5, tokens=300)))
    (res,) = to_client(done(s, job, [7, 8]), Result)
    assert (res.dropped_messages, res.dropped_tokens) == (5, 300)
    (err,) = to_client(prepared_shift(s, "big", 300, Shift(messages=6, tokens=90)), Error)
    assert err.code == "context_overflow"
    assert err.message == (
        f"prompt of 300 tokens (after --context-shift dropped 6 messages, 90 tokens) + max_tokens 8 does not fit a slot "
        f"of {CTX} tokens"
    )


def test_without_context_shift_an_overflow_names_the_prompt_and_the_slot() -> None:
    s = core()
    hello(s, slots=1, ctx_per_slot=CTX)
    req = s.accept(CLIENT, (), Submit(id="big", prompt="x", sampling=Sampling(max_tokens=None)))
    assert req is not None
    s.prepared(req, Prepared(np.arange(100, 100 + CTX, dtype=np.int32), None, OutputSpec()))
    (err,) = to_client(s.take(), Error)
    assert err.code == "context_overflow" and err.message == f"prompt of {CTX} tokens does not fit a slot of {CTX} tokens"
    assert s.slot_context() == CTX


def test_a_history_with_images_drops_its_oldest_messages_and_their_images(vocab, tmp_path) -> None:
    """A conversation whose first turn showed a picture and whose last asks about another, too long for the slot:
    the oldest turns go, the first picture with them; the last one stays, its rows in the prompt (the tiny Gemma 3
    projector: 16 rows an image)."""
    chat = ChatFormat(ChatTemplate.choose(None, None, "gemma", bos_text="<bos>"))
    chat.vision = Projector(str(mmproj(tmp_path / "tiny-mmproj.gguf")), vocab.model_ptr)
    try:
        history = conversation(12)
        history[1] = ChatMessage(role="user", content=[TextPart(text="Look at this."), ImagePart(data=png(40, 40, seed=1))])
        history[-1] = ChatMessage(role="user", content=[TextPart(text="And this one?"), ImagePart(data=png(40, 40, seed=2))])
        whole = prepare(chat_submit(history), vocab, chat)
        assert len(whole.images) == 2 and len(whole.tokens) > CTX
        p = prepare(chat_submit(history), vocab, chat, shift_to=CTX)
        assert p.shift is not None and p.shift.messages > 0 and fits(len(p.tokens), 16, CTX)
        assert p.shift.tokens == len(whole.tokens) - len(p.tokens)
        (kept,) = p.images  # the last picture's
        assert kept.data == png(40, 40, seed=2) and kept.n_tokens == tokens_per_image()
        assert int((p.tokens < 0).sum()) == tokens_per_image()
    finally:
        chat.vision.close()
