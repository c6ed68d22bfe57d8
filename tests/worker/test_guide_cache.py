"""worker/guide.py `CompiledGrammars`: a grammar is compiled once per worker and each job advances its own clone, whose
masks are a fresh compile's; lazy grammars too; the cache is bounded; a grammar that does not compile is refused
every time with its error. With a byte-level llguidance tokenizer: no model."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from protocol import Constraint
from worker.guide import CompiledGrammars, Guide, GuideError, GuideTokenizer

llguidance = pytest.importorskip("llguidance")

EOS = 256
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}
GRAMMAR = f"start: %json {json.dumps(SCHEMA)}\n"
REPLY = b'{"city": "Oslo", "n": 7}'


class ByteTokenizer:
    """A token per byte, and an end token: the smallest vocabulary llguidance takes."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class ByteVocab:
    """What a Guide reads of the model's vocabulary, for ByteTokenizer."""

    n_vocab = EOS + 1

    def piece(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def tokenize(self, text: str, **_: Any) -> list[int]:
        return list(text.encode())


@pytest.fixture(scope="module")
def tok() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))


@dataclass
class Tokenizer:
    """What a Guide reads of worker/guide.py's GuideTokenizer: the vocabulary and the worker's compiled grammars."""

    llg: Any
    vocab: ByteVocab = field(default_factory=ByteVocab)
    grammars: CompiledGrammars = field(init=False)

    def __post_init__(self) -> None:
        self.grammars = CompiledGrammars(lambda: self.llg)


def guide(tokenizer: Tokenizer, c: Constraint) -> Guide:
    return Guide(c, cast(GuideTokenizer, tokenizer))


def mask(matcher: Any) -> np.ndarray:
    return np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)


def test_two_jobs_with_one_schema_compile_once_and_advance_apart(tok: Any) -> None:
    tokenizer = Tokenizer(tok)
    first, second = guide(tokenizer, Constraint(grammar=GRAMMAR)), guide(tokenizer, Constraint(grammar=GRAMMAR))
    cache = tokenizer.grammars
    assert (cache.compiles, cache.hits, len(cache)) == (1, 1, 1)
    assert first.matcher is not second.matcher
    fresh = llguidance.LLMatcher(tok, GRAMMAR, log_level=0)
    for byte in REPLY:  # the first job writes the reply; the second stays at the start
        assert np.array_equal(mask(first.matcher), mask(fresh))
        first.follow(byte)
        assert fresh.consume_token(byte)
    assert first.matcher.is_accepting() and fresh.is_accepting()
    assert np.array_equal(mask(second.matcher), mask(llguidance.LLMatcher(tok, GRAMMAR, log_level=0)))
    assert not second.matcher.is_accepting()
    for byte in b'{"city": "Rome", "n": 12}':  # then writes another, on its own
        second.follow(byte)
    assert second.matcher.is_accepting() and not second.failed
    assert cache.compiles == 1 and cache.template(GRAMMAR).is_accepting() is False  # (the kept one never moved)


def test_a_lazy_grammar_compiles_once_across_jobs_and_not_at_its_trigger(tok: Any) -> None:
    tokenizer = Tokenizer(tok)
    lazy = Constraint(grammar=GRAMMAR, triggers=["{"])
    for _ in range(3):
        g = guide(tokenizer, lazy)
        assert g.matcher is None
        for byte in b"Sure: " + REPLY:
            g.follow(byte)
        assert g.matcher is not None and g.matcher.is_accepting() and not g.failed
    assert (tokenizer.grammars.compiles, tokenizer.grammars.hits) == (1, 2)


def test_a_grammar_that_does_not_compile_is_refused_each_time_and_compiled_once(tok: Any) -> None:
    tokenizer = Tokenizer(tok)
    for _ in range(3):
        with pytest.raises(GuideError, match=r"grammar does not compile: .*undefined_rule"):
            guide(tokenizer, Constraint(grammar="start: undefined_rule\n"))
    assert tokenizer.grammars.compiles == 1
    tokenizer.grammars.compile_ahead("start: undefined_rule\n")  # (ahead of a job: nothing raised, nothing compiled)
    assert tokenizer.grammars.compiles == 1


def test_compiled_ahead_the_job_finds_it_compiled(tok: Any) -> None:
    cache = CompiledGrammars(lambda: tok)
    cache.compile_ahead(GRAMMAR)
    cache.compile_ahead(GRAMMAR)
    assert (cache.compiles, cache.hits) == (1, 0)  # (hits count jobs' matchers only)
    cache.template(GRAMMAR)
    assert (cache.compiles, cache.hits, cache.compiled_on[threading.current_thread().name]) == (1, 1, 1)


def test_the_least_recently_used_go_past_either_bound(tok: Any) -> None:
    grammars = [f'start: "{c}"\n' for c in "abcd"]  # (11 characters each)
    cache = CompiledGrammars(lambda: tok, max_kept=3, max_chars=10_000)
    for g in grammars[:3]:
        cache.template(g)
    cache.template(grammars[0])  # (used again: "b" is the oldest now)
    cache.template(grammars[3])
    assert len(cache) == 3
    cache.template(grammars[0])
    cache.template(grammars[1])
    assert (cache.compiles, cache.hits) == (5, 2)  # "b" was compiled again
    by_chars = CompiledGrammars(lambda: tok, max_kept=100, max_chars=25)
    for g in grammars:
        by_chars.template(g)
    assert len(by_chars) == 2
    big = CompiledGrammars(lambda: tok, max_kept=100, max_chars=1)
    big.template(grammars[0])
    assert len(big) == 1  # (the newest stays, whatever its size)


def test_asked_from_two_threads_at_once_it_compiles_once(tok: Any) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_tokenizer() -> Any:
        started.set()
        release.wait(5)
        return tok

    cache = CompiledGrammars(slow_tokenizer)
    ahead = threading.Thread(target=cache.compile_ahead, args=(GRAMMAR,))
    ahead.start()
    assert started.wait(5)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(cache.template(GRAMMAR)))
    waiter.start()
    release.set()
    ahead.join(5)
    waiter.join(5)
    assert got and not got[0].is_error() and (cache.compiles, cache.hits) == (1, 1)
