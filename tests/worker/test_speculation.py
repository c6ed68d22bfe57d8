"""Speculative decoding from the conversation's own n-grams, with the real default model: the output is what it is
without speculation (deterministic mode, where results do not depend on batch shape: greedy, a seeded sampling chain
with penalties and a logit bias, a grammar), guesses are taken, the slot's KV stays exact, a job that ends mid-guess
keeps only its own tokens, and impossible flags are refused."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from worker_helpers import Run, assert_slot_invariant, complete

from protocol import Constraint, JobDone
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.speculate import RATE_WEIGHT, START_RATE, Drafter, OutputPool, StepCost

pytestmark = pytest.mark.model

PATTERN = "red, green, blue, yellow, " * 8


@pytest.fixture(scope="module")
def exact_spec() -> Iterator[Engine]:
    """Deterministic mode with speculation, 2 slots: a slot generating alone has 8 rows per decode batch (7 for
    guesses), two together 4 each."""
    eng = Engine(WorkerConfig(slots=2, ctx_per_slot=1024, threads=2, deterministic=True, spec="ngram")).start()
    yield eng
    eng.stop()


class AlwaysPays(StepCost):
    def pays(self, rate: float, decode_rows: int, rows: int, guess: int) -> bool:
        return True


@pytest.fixture(scope="module")
def fast_spec() -> Iterator[Engine]:
    """Default settings with speculation, guesses of up to 8 tokens, every guess made: whether a guess pays is
    weighed against step times (worker/speculate.py StepCost, tested below on its own), and on a busy shared machine
    those say "no" often enough to change which tokens were guessed from one run to the next."""
    eng = Engine(WorkerConfig(slots=2, ctx_per_slot=1024, threads=2, spec="ngram", spec_max=8)).start()
    eng.call(lambda e: setattr(e, "step_cost", AlwaysPays())).result(10)
    yield eng
    eng.stop()


def set_spec(engine: Engine, on: bool) -> None:
    engine.call(lambda e: setattr(e, "spec", on)).result(10)


def spec_counts(engine: Engine) -> tuple[int, int, int]:
    c = engine.call(lambda e: e.counters).result(10)
    return c.spec_proposed, c.spec_accepted, c.invariant_violations


SAMPLINGS = {
    "greedy": {},
    "seeded-chain": {"temperature": 0.9, "seed": 11, "top_k": 40, "presence_penalty": 0.3, "logit_bias": {"236761": -2.0}},
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_output_is_identical_with_and_without_speculation(exact_spec, name):
    prompt = exact_spec.vocab.tokenize(PATTERN)
    kw = {"max_tokens": 48, **SAMPLINGS[name]}
    set_spec(exact_spec, False)
    plain = complete(exact_spec, prompt, slot=0, prefix_cache=False, **kw)
    set_spec(exact_spec, True)
    before = spec_counts(exact_spec)
    guessed = complete(exact_spec, prompt, slot=0, prefix_cache=False, **kw)
    after = spec_counts(exact_spec)
    assert isinstance(plain.final, JobDone) and isinstance(guessed.final, JobDone)
    assert guessed.tokens == plain.tokens and guessed.final.text == plain.final.text
    assert after[1] > before[1], "no guess was taken: the test did not exercise speculation"
    assert after[2] == before[2]  # no invariant violation
    assert_slot_invariant(exact_spec, guessed)


def test_guesses_that_would_not_pay_in_their_step_are_withheld_and_change_nothing(fast_spec):
    prompt = fast_spec.vocab.tokenize(PATTERN)
    set_spec(fast_spec, False)
    plain = complete(fast_spec, prompt, slot=0, prefix_cache=False, max_tokens=24)
    set_spec(fast_spec, True)

    class NeverPays(StepCost):  # a device where a guessed row always costs more than it gives
        def pays(self, rate: float, decode_rows: int, rows: int, guess: int) -> bool:
            return False

    costly = NeverPays()
    always = fast_spec.call(lambda e: e.step_cost).result(10)
    fast_spec.call(lambda e: setattr(e, "step_cost", costly)).result(10)
    try:
        before = fast_spec.call(lambda e: (e.counters.spec_proposed, e.counters.spec_withheld)).result(10)
        withheld = complete(fast_spec, prompt, slot=0, prefix_cache=False, max_tokens=24)
        after = fast_spec.call(lambda e: (e.counters.spec_proposed, e.counters.spec_withheld)).result(10)
    finally:
        fast_spec.call(lambda e: setattr(e, "step_cost", always)).result(10)
    assert isinstance(withheld.final, JobDone) and withheld.tokens == plain.tokens
    assert after[0] == before[0] and after[1] > before[1]  # nothing guessed was computed; each withheld guess counted
    assert_slot_invariant(fast_spec, withheld)


def test_a_grammar_constrains_guessed_tokens_too(exact_spec):
    prompt = exact_spec.vocab.tokenize(PATTERN)
    grammar = Constraint(grammar='start: ("red, " | "green, " | "blue, ")+ "yellow."\n')
    set_spec(exact_spec, False)
    plain = complete(exact_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, constraint=grammar)
    set_spec(exact_spec, True)
    guessed = complete(exact_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, constraint=grammar)
    assert isinstance(guessed.final, JobDone)
    assert guessed.tokens == plain.tokens
    assert "yellow," not in guessed.final.text  # the pattern's own continuation is not what the grammar allows
    assert_slot_invariant(exact_spec, guessed)


def test_a_grammar_that_completes_inside_a_taken_guess_ends_there_and_not_before(fast_spec):
    prompt = fast_spec.vocab.tokenize(PATTERN)
    want = "red, green, blue, yellow, red, green, blue"  # the pattern, guessed on past where the grammar ends
    grammar = Constraint(grammar=f'start: "{want}"\n')
    set_spec(fast_spec, False)
    plain = complete(fast_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, constraint=grammar)
    set_spec(fast_spec, True)
    before = spec_counts(fast_spec)
    guessed = complete(fast_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, constraint=grammar)
    after = spec_counts(fast_spec)
    assert isinstance(guessed.final, JobDone) and guessed.final.finish_reason == "stop"
    assert guessed.final.text == plain.final.text == want and guessed.tokens == plain.tokens
    assert after[1] > before[1], "no guess was taken: the test did not exercise speculation"
    assert_slot_invariant(fast_spec, guessed)


def test_guesses_are_taken_and_the_kv_stays_exact(fast_spec):
    prompt = fast_spec.vocab.tokenize(PATTERN)
    before = spec_counts(fast_spec)
    run = complete(fast_spec, prompt, slot=0, max_tokens=64)
    after = spec_counts(fast_spec)
    assert isinstance(run.final, JobDone) and run.final.generated_tokens == 64
    assert after[1] - before[1] >= 16  # the pattern is guessed most of the way
    assert after[2] == before[2]
    assert run.final.slot_tokens == len(prompt) + 63  # prompt + reply but its last token, as without guesses
    assert_slot_invariant(fast_spec, run)
    nxt = complete(fast_spec, prompt + run.tokens + fast_spec.vocab.tokenize(" red,", add_special=False), slot=0, max_tokens=4)
    assert nxt.final.reused_tokens == run.final.slot_tokens  # the next turn reuses it all
    assert_slot_invariant(fast_spec, nxt)


def stop_inside_a_guess(run: Run) -> str:
    """A stop string that first appears at a token taken from a guess with more taken tokens after it: deltas sent
    by one verification arrive within microseconds of each other."""
    text = ""
    ends = []
    for d in run.deltas:
        text += d.text
        ends.append(len(text))
    for j in range(1, len(run.deltas) - 1):
        in_burst = run.times[j] - run.times[j - 1] < 1e-3 and run.times[j + 1] - run.times[j] < 1e-3
        if not in_burst or not run.deltas[j].text:
            continue
        for n in range(1, ends[j] + 1):
            stop = text[ends[j] - n : ends[j]]
            if text.find(stop) + n == ends[j]:
                return stop
    raise AssertionError(f"no token inside a taken guess in {[d.text for d in run.deltas]}")


def complete_with_the_same_guesses(engine: Engine, prompt: list[int], **kw) -> Run:
    """A run whose guesses depend only on its tokens: no recent output to guess from (the pool would hold the
    previous run's)."""
    pool = engine.call(lambda e: e.pool).result(10)
    engine.call(lambda e: setattr(e, "pool", OutputPool(e.cfg.spec_ngram))).result(10)
    try:
        return complete(engine, prompt, **kw)
    finally:
        engine.call(lambda e: setattr(e, "pool", pool)).result(10)


def test_a_job_that_stops_inside_a_guess_keeps_only_its_own_tokens(fast_spec):
    prompt = fast_spec.vocab.tokenize(PATTERN)
    free = complete_with_the_same_guesses(fast_spec, prompt, slot=1, prefix_cache=False, max_tokens=40)
    stop = stop_inside_a_guess(free)
    run = complete_with_the_same_guesses(fast_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, stop=[stop])
    assert isinstance(run.final, JobDone) and run.final.stop == stop and stop not in run.final.text
    # the slot keeps the stopping token's KV (it was a taken guess) and drops the guessed tokens after it
    assert run.final.slot_tokens == len(prompt) + run.final.generated_tokens
    assert_slot_invariant(fast_spec, run)


def test_max_tokens_bounds_the_guesses(fast_spec):
    prompt = fast_spec.vocab.tokenize(PATTERN)
    run = complete(fast_spec, prompt, slot=1, prefix_cache=False, max_tokens=13)
    assert isinstance(run.final, JobDone) and run.final.generated_tokens == 13
    assert run.final.slot_tokens == len(prompt) + 12
    assert_slot_invariant(fast_spec, run)


def test_drafter_guesses_what_followed_the_latest_occurrence():
    d = Drafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3], capacity=4, n=3, k_max=8)
    d.k = 8
    assert d.propose(8) == [4, 6, 7, 1, 2, 3]  # after the latest earlier "1 2 3", up to the end of the history
    assert d.propose(2) == [4, 6]
    d.push(4)
    assert d.propose(8) == [6, 7, 1, 2, 3, 4]
    d.push(8)
    assert d.propose(8) == []  # "3 4 8" never occurred
    d.verified(proposed=4, accepted=4)
    assert d.k == 8
    d.verified(proposed=8, accepted=2)
    assert d.k == 2


def test_drafter_follows_the_place_the_output_copies_and_finds_it_again_after_an_edit():
    # A file whose line "1 2 3" occurs twice, then the request to repeat it (99). Copying the file, the output's
    # last tokens "1 2 3" last occurred in the output itself, followed by 7: the drafter guesses what follows the
    # place it has been copying (8) instead. After an edit it looks for the output's last tokens near where it left
    # the file first: "11 12 13" also occurs later (followed by 20), and the latest occurrence would guess that.
    file = [10, 1, 2, 3, 7, 1, 2, 3, 8, 11, 12, 13, 14, 15, 16, 11, 12, 13, 20]
    d = Drafter([*file, 99], capacity=64, n=3, k_max=8)
    d.k = 8

    def produce(tokens: list[int]) -> None:  # as the engine does: a guess before every step
        for tok in tokens:
            d.propose(1)
            d.push(tok)

    produce(file[:8])
    assert d.propose(3) == [8, 11, 12]
    # an edit: 50 instead of 8, then the file again from 11 on; n tokens of it find the place just after
    produce([50, 11, 12])
    assert d.propose(3) == []  # "50 11 12" never occurred
    produce([13])
    assert d.propose(3) == [14, 15, 16]


def test_drafter_guesses_from_a_recent_output_of_the_same_tenant_where_the_history_has_nothing():
    pool = OutputPool(n=3)
    pool.add("a", [1, 2, 3, 4, 5, 6, 7, 8])
    d = Drafter([9, 9, 1, 2, 3], capacity=64, n=3, k_max=8, pool=pool.lookup("a"))
    d.k = 4
    assert d.propose(8) == [4, 5, 6, 7]  # "1 2 3" is not earlier in the history: the recent output has it
    d.push(4)
    d.push(5)
    assert d.propose(8) == [6, 7, 8]  # it follows that output while the job copies it
    d.push(30)
    assert d.propose(8) == []  # left it, and "4 5 30" occurs nowhere
    other = Drafter([9, 9, 1, 2, 3], capacity=64, n=3, k_max=8, pool=pool.lookup("b"))
    assert other.propose(8) == []  # another tenant's outputs never guess
    own = Drafter([1, 2, 3, 50, 51, 1, 2, 3], capacity=64, n=3, k_max=8, pool=pool.lookup("a"))
    own.k = 2
    assert own.propose(8) == [50, 51]  # the conversation's own text goes first


def test_the_output_pool_keeps_the_latest_occurrence_and_drops_the_oldest_outputs():
    pool = OutputPool(n=2, capacity=10)
    pool.add("", [1, 2, 3, 4])
    pool.add("", [1, 2, 7, 8])
    found = pool.lookup("")(np.array([1, 2]))
    assert found is not None and found[0][found[1]] == 7  # the latest output with "1 2"
    pool.add("", [5, 6, 9, 9, 9])  # over 10 tokens: the oldest output goes
    assert pool.tokens == 9
    assert pool.lookup("")(np.array([3, 4])) is None
    assert pool.lookup("")(np.array([7, 8])) is None  # (followed by nothing)
    assert pool.lookup("")(np.array([2, 7])) is not None
    pool.add("", list(range(50)))  # longer than the whole pool: not kept
    assert pool.tokens == 9


def test_a_job_guesses_from_what_an_earlier_job_of_its_tenant_generated(exact_spec):
    """The same request again, in another slot and without its cached prefix: the second job takes more of its
    guesses (it copies the first one's output) and produces the same tokens; another tenant's gets no such help."""
    prompt = exact_spec.vocab.tokenize("The history of the printing press")  # (its reply repeats itself little)

    def taken(salt: str) -> tuple[list[int], int]:
        before = spec_counts(exact_spec)[1]
        run = complete(exact_spec, prompt, slot=1, prefix_cache=False, max_tokens=40, cache_salt=salt)
        assert isinstance(run.final, JobDone) and run.final.generated_tokens == 40
        return run.tokens, spec_counts(exact_spec)[1] - before

    first, alone = taken("press-1")
    again, helped = taken("press-1")
    other, not_helped = taken("press-2")
    assert again == first == other
    assert helped >= alone + 15
    assert not_helped == alone


def test_a_guess_not_computed_is_checked_against_what_comes_and_moves_the_rate():
    d = Drafter([1, 2, 3, 4, 5, 6, 7, 8, 9], capacity=32, n=2, k_max=8)
    d.k = 4
    assert d.rate == START_RATE
    for tok in (1, 2):  # the output starts copying: a guess of 3 4 5 6 is made but not computed
        d.shadow(8)
        d.push(tok)
    d.shadow(8)
    for tok in (3, 4, 5, 9):  # three of its tokens come, then another: taken 3 of 4
        d.push(tok)
    assert d.rate == pytest.approx(START_RATE + RATE_WEIGHT * (3 / 4 - START_RATE)) and d.k == 3


def cpu_like() -> StepCost:
    # a step's time as this project's CPU gives it: the first row ~18 ms, each further row ~8 ms (and a noisy copy of
    # each, which only ever adds time)
    cost = StepCost()
    for rows in (1, 2, 8, 9, 16, 24):
        cost.observe(rows, 0.018 + 0.008 * (rows - 1) + 0.05)
        cost.observe(rows, 0.018 + 0.008 * (rows - 1))
    return cost


def test_a_guess_pays_when_enough_of_it_is_taken_for_the_step_it_joins():
    cost = cpu_like()
    assert StepCost().pays(0.0, 8, 8, 4)  # nothing measured yet: guess
    assert cost.cost(8) == pytest.approx(0.018 + 0.056)  # the floor, not the noisy copy
    # one slot generating: a guess of 4 taken at 60% pays, at 10% not
    assert cost.pays(0.6, 1, 1, 4) and not cost.pays(0.1, 1, 1, 4)
    # eight slots generating: 60% no longer pays (each guessed row costs about what a decode row does), 97% does
    assert not cost.pays(0.6, 8, 8, 4) and cost.pays(0.97, 8, 8, 4)


def test_more_rows_never_look_cheaper_than_fewer_however_noisy_the_floors():
    cost = StepCost()
    cost.observe(8, 0.080)
    cost.observe(16, 0.070)  # a quiet moment for 16 rows, a busy one for 8: the floors fall as rows grow
    assert cost.cost(16) == pytest.approx(0.080) and cost.cost(12) == pytest.approx(0.080)
    assert cost.cost(24) >= 0.080  # and never below, past the largest row count seen
    cost = cpu_like()
    cost.observe(32, 0.018 + 0.008 * 23)  # the last segment flat: 24 and 32 rows timed alike
    assert cost.cost(40) - cost.cost(32) == pytest.approx(8 * (cost.cost(32) - cost.cost(1)) / 31)  # the mean slope
    assert not cost.pays(0.6, 24, 32, 8)  # so a guess that does not pay in a busy step is still withheld


@pytest.mark.parametrize(
    ("fields", "flag"),
    [({"spec_max": 0}, "--spec-max"), ({"spec_ngram": 0}, "--spec-ngram"), ({"spec": "draft"}, "--spec"),
     ({"spec": "ngram", "snapshots": True}, "--snapshots"), ({"spec_max": 600}, "--spec-max")],
)  # fmt: skip
def test_impossible_speculation_flags_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        WorkerConfig(**fields)
