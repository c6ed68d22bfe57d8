"""Tokenizing only a prompt's new part: the same tokens as tokenizing it whole, on the real model's vocabulary,
for a growing conversation and for texts that try to break the cut (whitespace, special-looking text, edits)."""

from __future__ import annotations

import pytest

from kvroute.model import resolve_model
from kvroute.vocab import Vocab
from router.prompt_tokens import PromptTokenizer

pytestmark = pytest.mark.model

TRICKY = [
    "plain words",
    "  leading spaces and a trailing newline\n",
    "\n\nblank lines first",
    "a user writes <start_of_turn>model\n inside the text",
    "html the vocabulary knows: <b>bold</b> <table><tr>",
    "unicode: naïve café — 東京 🚀",
    "</s> and <eos> as text",
    "",
    "ends with a marker<end_of_turn>",
]


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab.load(resolve_model(None))


def turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def test_a_growing_conversation_tokenizes_as_a_whole_and_reuses_its_history(vocab: Vocab) -> None:
    pt = PromptTokenizer(vocab)
    history = ""
    previous = 0  # tokens of the previous prompt
    for i in range(24):
        history += turn("user", f"step {i}: {TRICKY[i % len(TRICKY)]}")
        prompt = history + "<start_of_turn>model\n"
        before = pt.reused_tokens
        whole = vocab.tokenize(prompt)
        assert pt.tokenize(prompt, True).tolist() == whole
        assert pt.tokenize(prompt, False).tolist() == vocab.tokenize(prompt, add_special=False)
        if i > 0:  # the previous prompt was found (all of it but "model\n"), twice: with and without BOS
            assert pt.reused_tokens - before >= 2 * (previous - 3)
        previous = len(whole)
        history = prompt + f"reply {i}: {TRICKY[(i + 3) % len(TRICKY)]}<end_of_turn>\n"


@pytest.mark.parametrize("edit", ["<start_of_turn>user\nEDITED", "<start_of_turn>user\n step 0", " "])
def test_an_edited_history_is_tokenized_as_a_whole(vocab: Vocab, edit: str) -> None:
    pt = PromptTokenizer(vocab)
    first = turn("user", "first question") + turn("model", "first answer") + "<start_of_turn>model\n"
    pt.tokenize(first, True)
    second = edit + first[len(edit) :] + turn("user", "next")
    assert pt.tokenize(second, True).tolist() == vocab.tokenize(second)


@pytest.mark.parametrize("text", TRICKY)
def test_any_text_and_its_continuations(vocab: Vocab, text: str) -> None:
    pt = PromptTokenizer(vocab)
    base = turn("user", text) + "<start_of_turn>model\n"
    for tail in ("", text, "<end_of_turn>", " <start_of_turn>", "\n" + text + "<end_of_turn>\n<start_of_turn>user\n"):
        for t in (base, base + tail, base + tail + base):
            assert pt.tokenize(t, True).tolist() == vocab.tokenize(t)


def test_a_special_another_special_overlaps_is_no_cut(vocab: Vocab) -> None:
    pt = PromptTokenizer(vocab)
    pt._text = {1: "<a>", 2: "a>b", 3: "<x>", 4: "y<x", 5: "<q>", 6: "[<q>]", 7: "<ok>"}
    assert not pt._alone("<a>")  # a special starts inside it and runs past its end
    assert not pt._alone("<x>")  # one ends inside it
    assert not pt._alone("<q>")  # one contains it
    assert pt._alone("<ok>")


def test_only_the_most_recent_heads_are_kept(vocab: Vocab) -> None:
    pt = PromptTokenizer(vocab, max_entries=2)
    prompts = [turn("user", f"conversation {i}") + "<start_of_turn>model\n" for i in range(4)]
    for p in prompts:
        pt.tokenize(p, True)
    assert len(pt._entries) == 2 and sum(pt._lengths.values()) == 2
    before = pt.reused_tokens
    assert pt.tokenize(prompts[0] + "x", True).tolist() == vocab.tokenize(prompts[0] + "x")  # forgotten: whole
    assert pt.reused_tokens == before
    assert pt.tokenize(prompts[3] + "x", True).tolist() == vocab.tokenize(prompts[3] + "x")  # kept: reused
    assert pt.reused_tokens > before
