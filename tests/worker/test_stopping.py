"""TextStream (no model): UTF-8 hold-back and stop strings across token boundaries."""

from __future__ import annotations

from worker.stopping import TextStream


def test_split_utf8_sequence_is_held_until_complete():
    s = TextStream()
    euro = "€".encode()
    assert s.push(b"price " + euro[:1]) == "price "
    assert s.push(euro[1:2]) == ""
    assert s.push(euro[2:] + b"5") == "€5"
    assert s.full_text() == "price €5"


def test_stop_string_across_tokens_is_not_emitted():
    s = TextStream(["END"])
    out = [s.push(p) for p in (b"abc E", b"N", b"Dxyz")]
    assert out == ["abc ", "", ""]
    assert s.stop == "END" and s.full_text() == "abc "


def test_held_prefix_is_released_when_it_cannot_match():
    s = TextStream(["END"])
    assert s.push(b"x E") == "x "
    assert s.push(b"Nd") == "ENd"
    assert s.push(b" EN") == " "
    assert s.flush() == "EN"
    assert s.stop is None and s.full_text() == "x ENd EN"


def test_earliest_stop_wins_and_incomplete_utf8_flushes_as_replacement():
    s = TextStream(["b", "ab"])
    assert s.push(b"xab") == "x" and s.stop == "ab"
    t = TextStream()
    t.push("é".encode()[:1])
    assert t.flush() == "\ufffd"
