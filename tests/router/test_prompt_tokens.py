"""Tokenizing only a prompt's new part: the same tokens as tokenizing it whole, on the real model's vocabulary,
for a growing conversation (with turn markers, or plain text cut between words) and for texts that try to break the
cut (whitespace, special-looking text, edits, random characters around spaces)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from common.model import resolve_model
from common.vocab import Vocab
from router.prompt_tokens import Overlaps, PromptTokenizer

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


PLAIN = "The keeper wrote in the log that the wind had turned north before dawn, and 42 boats stayed in."


def test_a_growing_plain_text_prompt_is_cut_between_words_and_tokenizes_as_a_whole(vocab: Vocab) -> None:
    """A prompt without turn markers (`/v1/completions`) is cut before a space between two words."""
    pt = PromptTokenizer(vocab)
    text, previous = "", 0
    for i in range(20):
        text += f" Turn {i}: {PLAIN} {TRICKY[i % len(TRICKY)]}"
        before = pt.reused_tokens
        whole = vocab.tokenize(text)
        assert pt.tokenize(text, True).tolist() == whole
        if i > 0:  # the previous text was found up to its last cut between words
            assert pt.reused_tokens - before >= previous - 24
        previous = len(whole)


def test_random_texts_around_spaces_tokenize_as_a_whole(vocab: Vocab) -> None:
    rng = random.Random(7)
    parts = ["a", "Z", "1", "é", "ß", "東", "Ω", " ", " ", "  ", "\n", ">", "<", "</", "\u2581", "\u0301", "_", "🚀", "the"]
    pt = PromptTokenizer(vocab)
    for _ in range(150):
        text = ""
        for _ in range(4):
            text += "".join(rng.choice(parts) for _ in range(rng.randint(1, 60)))
            assert pt.tokenize(text, False).tolist() == vocab.tokenize(text, add_special=False), repr(text)
    assert pt.reused_tokens > 0


def test_a_space_is_a_cut_only_between_two_words(vocab: Vocab, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = PromptTokenizer(vocab)
    assert pt._is_cut("ab cd", 2) and pt._is_cut("é 東", 1)
    assert not any(pt._is_cut(t, 2) for t in ("a  b", "a> </b", "a_ b", "ab\u00a0c", "a. b"))
    monkeypatch.setattr(vocab, "add_space_prefix", True)  # such a vocabulary puts a space before every piece it starts
    assert PromptTokenizer(vocab)._word_cut is None


def test_only_the_most_recent_heads_are_kept(vocab: Vocab) -> None:
    pt = PromptTokenizer(vocab, max_entries=2)
    prompts = [turn("user", f"conversation{i}") + "<start_of_turn>model\n" for i in range(4)]  # (no cut between words)
    for p in prompts:
        pt.tokenize(p, True)
    assert len(pt._entries) == 2 and sum(pt._lengths.values()) == 2
    before = pt.reused_tokens
    assert pt.tokenize(prompts[0] + "x", True).tolist() == vocab.tokenize(prompts[0] + "x")  # forgotten: whole
    assert pt.reused_tokens == before
    assert pt.tokenize(prompts[3] + "x", True).tolist() == vocab.tokenize(prompts[3] + "x")  # kept: reused
    assert pt.reused_tokens > before


def test_a_remembered_reply_comes_back_with_the_tokens_the_model_wrote(vocab: Vocab) -> None:
    """The next turn's prompt holds the reply as the template writes it back: its head is the prompt's tokens and the
    reply's own (spelled here letter by letter, which re-tokenizing the text would not give); the rest is tokenized."""
    pt = PromptTokenizer(vocab)
    prompt = turn("user", "Say hello.") + "<start_of_turn>model\n"
    first = pt.tokenize(prompt, True)
    spelled = np.asarray([t for ch in "Hello there" for t in vocab.tokenize(ch, add_special=False)], dtype=np.int32)
    assert spelled.tolist() != vocab.tokenize("Hello there", add_special=False)
    pt.remember(prompt, True, first, spelled)
    following = prompt + "Hello there<end_of_turn>\n" + turn("user", "Again.") + "<start_of_turn>model\n"
    got = pt.tokenize(following, True).tolist()
    assert got[: len(first) + len(spelled)] == first.tolist() + spelled.tolist()
    assert vocab.detokenize(got[1:]) == following and pt.remembered == 1
    other = prompt + "Hello there!<end_of_turn>\n"  # (the text differs from the reply's: tokenized as usual)
    assert pt.tokenize(other, True).tolist() == vocab.tokenize(other)


def test_which_special_texts_overlap_others_as_a_pairwise_comparison_says() -> None:
    """Overlaps (an index, made once) says what comparing each text with every other one says: whether another
    contains it, starts inside it or ends inside it (a long text compared one by one)."""

    def pairwise(s: str, texts: list[str]) -> bool:
        return not any(
            t and t != s and (s in t or any(t.startswith(s[k:]) or t.endswith(s[:k]) for k in range(1, len(s)))) for t in texts
        )

    rng = random.Random(7)
    texts = ["<end_of_turn>", "<start_of_turn>", "<eos>", "turn>x", "<start", "aa", "a", "<|im_end|>", "|im", "x" * 80]
    texts += ["".join(rng.choice("cdefgh") for _ in range(rng.randint(2, 6))) for _ in range(300)]
    index = Overlaps(texts)
    verdicts = [index.alone(s) for s in texts]
    assert verdicts == [pairwise(s, texts) for s in texts]
    assert True in verdicts and False in verdicts
    assert not index.alone("<start_of_turn>")  # "<start" is inside it
    assert index.alone("<|im_end|>") is pairwise("<|im_end|>", texts)


def test_the_checks_a_remembered_reply_needs_agree_with_the_special_texts_one_by_one(vocab: Vocab) -> None:
    """`_ends_before_special` and `_before_control` read indexes made once (a finished reply used to compare every
    special text's heads on the router's loop, 15-18 ms); they answer as the texts compared one by one do."""
    pt = PromptTokenizer(vocab)
    specials = [t for t in pt._text.values() if t]
    controls = sorted((t for t in pt._control_texts if pt._alone(t)), key=len, reverse=True)
    rng = random.Random(7)
    ends = ["plain reply", "reply ending in <", "reply ending in <start_of", "<end_of_turn>", "x\n\n", "", "naïve 🚀"]
    ends += [rng.choice(specials)[: rng.randrange(1, 8)] for _ in range(200)]
    for text in ("prompt " + e for e in ends):
        one_by_one = not any(text.endswith(s[:k]) for s in specials for k in range(1, len(s)))
        assert pt._ends_before_special(text) == one_by_one
    texts = [turn("user", "a question") + "<start_of_turn>model\n", "text <b>bold</b> and <unused3> here"]
    texts += ["".join(rng.choice([*specials[:400], "a", " ", "\n"]) for _ in range(30)) for _ in range(30)]
    for text in texts:
        for c in range(len(text)):
            assert pt._before_control(text, c) == any(text.startswith(t, c) for t in controls), (text, c)
