"""chat/grammar.py CheckedGrammars: a grammar many requests repeat is compiled once on the router (issue 61 item 7:
each request compiled its grammar again), its error too; what is kept is bounded by its text."""

from __future__ import annotations

from chat.grammar import CheckedGrammars

GOOD = 'start: "yes" | "no"\n'
BAD = "start: undefined_rule\n"


def test_a_grammar_checked_once_is_not_compiled_again_and_its_error_is_kept() -> None:
    checked = CheckedGrammars()
    assert checked.error(GOOD) == "" and checked.error(GOOD) == ""
    first = checked.error(BAD)
    assert first and checked.error(BAD) == first
    assert checked.compiles == 2


def test_what_is_kept_is_bounded_by_its_text_least_recently_used_out_first() -> None:
    checked = CheckedGrammars(max_chars=2 * len(GOOD))
    other = 'start: "maybe"\n'
    checked.error(GOOD)
    checked.error(other)
    checked.error(GOOD)  # (used again: the other is now the oldest)
    checked.error('start: "a"\n')
    assert checked.compiles == 3
    checked.error(GOOD)
    assert checked.compiles == 3, "kept"
    checked.error(other)
    assert checked.compiles == 4, "dropped for room, compiled again"
