"""worker/guide_pieces.py: the pieces llguidance reads, computed from llama.cpp once and then read from the cache,
the same either way; a damaged file is computed again, and a cache that cannot be written is not fatal."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from common.vocab import Vocab
from worker import guide_pieces
from worker.guide_pieces import SPECIAL, Stopped, pieces_file
from worker.guide_pieces import guide_pieces as pieces_of

pytestmark = pytest.mark.model


def test_pieces_are_kept_and_read_back_the_same(vocab: Vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    path = pieces_file(vocab)
    assert vocab.fingerprint in path.name
    computed = pieces_of(vocab, threading.Event())
    assert path.is_file() and path.stat().st_mode & 0o777 == 0o600
    assert len(computed) == vocab.n_vocab
    assert computed[vocab.eos or 1].startswith(SPECIAL)  # (a control token, marked)
    assert all(computed[t] == vocab.piece(t) for t in range(1000, 1100))  # (ordinary text, as it is)

    def not_again(*_: object) -> list[bytes]:
        raise AssertionError("computed again: the cache was not read")

    monkeypatch.setattr(guide_pieces, "compute", not_again)
    assert pieces_of(vocab, threading.Event()) == computed


def test_a_damaged_file_is_computed_again_and_an_unwritable_cache_is_not_fatal(
    vocab: Vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    good = pieces_of(vocab, threading.Event())
    path = pieces_file(vocab)
    path.write_bytes(path.read_bytes()[:-3])  # cut short
    assert guide_pieces.read(path, vocab.n_vocab) is None
    assert pieces_of(vocab, threading.Event()) == good
    assert guide_pieces.read(path, vocab.n_vocab + 1) is None  # (another vocabulary's count)

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KVROUTE_CACHE", str(blocked))
    assert pieces_of(vocab, threading.Event()) == good


def test_a_stop_ends_the_computation(vocab: Vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        pieces_of(vocab, stop)
    assert not pieces_file(vocab).exists()
