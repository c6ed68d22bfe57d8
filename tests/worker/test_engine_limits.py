"""Engine with the real model: limits, cancellation, deadlines, sampling, stop strings, failure paths."""

from __future__ import annotations

import threading
import time

import pytest
from worker_helpers import assert_slot_invariant, complete, start

from protocol import JobDone, JobError, token_hash

pytestmark = pytest.mark.model


def test_context_overflow_is_refused_with_numbers(engine):
    run = complete(engine, [2] * engine.n_ctx, max_tokens=1)
    assert isinstance(run.final, JobError) and run.final.code == "context_overflow" and run.final.slot == -1
    assert str(engine.n_ctx) in run.final.message
    run = complete(engine, [2] * 100, max_tokens=engine.n_ctx - 50)
    assert run.final.code == "context_overflow" and "100" in run.final.message


def test_cancel_keeps_valid_kv(engine, vocab):
    run = start(engine, vocab.tokenize("Tell me a long story."), slot=0, max_tokens=300)
    while len(run.deltas) < 3:
        time.sleep(0.005)
    engine.cancel(run.final.id if run.final else run.deltas[0].id)
    run.wait()
    assert run.final.finish_reason == "cancelled" and 3 <= run.final.generated_tokens < 300
    assert_slot_invariant(engine, run)


def test_deadline_exceeded(engine, vocab):
    run = complete(engine, vocab.tokenize("Count to one thousand:"), slot=1, max_tokens=300, deadline_ms=300)
    assert run.final.finish_reason == "deadline_exceeded" and run.final.generated_tokens < 300
    assert_slot_invariant(engine, run)


def test_stop_string_across_tokens(engine, vocab):
    prompt = vocab.tokenize("The capital of France is")
    free = complete(engine, prompt, slot=2, max_tokens=12)
    text = free.final.text
    # a stop string that straddles two tokens of the free-running output
    pieces = [vocab.piece(t).decode("utf-8", "replace") for t in free.tokens]
    cut = len(pieces[0]) + len(pieces[1])
    stop = text[cut - 2 : cut + 2]
    stopped = complete(engine, prompt, slot=2, max_tokens=12, stop=[stop])
    assert stopped.final.finish_reason == "stop" and stopped.final.stop == stop
    assert stopped.final.text == text[: text.index(stop)]
    assert "".join(d.text for d in stopped.deltas) == stopped.final.text


def test_seed_reproducible_and_logit_bias(engine, vocab):
    prompt = vocab.tokenize("My favourite animal is")
    a = complete(engine, prompt, slot=3, temperature=1.0, seed=42, max_tokens=16)
    b = complete(engine, prompt, slot=3, temperature=1.0, seed=42, max_tokens=16)
    assert a.tokens == b.tokens
    greedy = complete(engine, prompt, slot=3, max_tokens=1).tokens[0]
    banned = complete(engine, prompt, slot=3, max_tokens=1, logit_bias={str(greedy): -100.0}).tokens[0]
    assert banned != greedy
    forced = complete(engine, prompt, slot=3, max_tokens=3, logit_bias={"1000": 100.0}).tokens
    assert forced == [1000, 1000, 1000]


def test_decode_failure_ends_job_and_worker_keeps_serving(engine, vocab):
    real = engine.core._decode
    calls = {"n": 0}

    def failing() -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            real()  # the ubatch is processed, then the call reports a fatal error (processed ubatches are kept)
            return -3
        return real()

    engine.call(lambda e: setattr(e, "_decode", failing)).result(10)
    try:
        run = complete(engine, vocab.tokenize("Failing soon:"), slot=0, max_tokens=20)
    finally:
        engine.call(lambda e: setattr(e, "_decode", real)).result(10)
    err = run.final
    assert isinstance(err, JobError) and err.code == "internal" and err.error_id and "-3" in err.message
    held = engine.call(lambda e: (e.llama.seq_len(0), list(e.table[0].tokens))).result(10)
    assert held[0] == err.slot_tokens == len(held[1]) and err.slot_hash == token_hash(held[1])
    assert engine.counters.decode_errors >= 1
    assert isinstance(complete(engine, vocab.tokenize("Still alive?"), slot=0, max_tokens=2).final, JobDone)


def test_no_kv_room_is_retried_with_a_smaller_batch(engine, vocab):
    real = engine.core._decode
    state = {"failed": False}

    def once_full() -> int:
        if not state["failed"] and engine.llama.batch.n > 16:
            state["failed"] = True
            return 1  # llama.cpp: no KV slot for this batch, memory unchanged
        return real()

    before, prefilled = engine.counters.decode_retries, engine.counters.prefill_rows
    prompt = vocab.tokenize("A fairly long prompt " * 10)
    engine.call(lambda e: setattr(e, "_decode", once_full)).result(10)
    try:
        run = complete(engine, prompt, slot=1, prefix_cache=False, max_tokens=2)
    finally:
        engine.call(lambda e: setattr(e, "_decode", real)).result(10)
    assert state["failed"] and engine.counters.decode_retries == before + 1
    assert engine.counters.prefill_rows - prefilled == len(prompt)  # the batch that failed is not counted
    assert isinstance(run.final, JobDone)
    assert_slot_invariant(engine, run)


def test_invariant_violation_is_reported_and_slot_cleared(engine, vocab):
    run = start(engine, vocab.tokenize("Invariant test:"), slot=2, max_tokens=200)
    while len(run.deltas) < 2:
        time.sleep(0.005)
    before = engine.counters.invariant_violations
    engine.call(lambda e: e.table[2].tokens.append(5)).result(10)  # the slot now believes a token its KV lacks
    run.wait()
    err = run.final
    assert isinstance(err, JobError) and err.code == "internal" and err.error_id in err.message
    assert err.slot == 2 and err.slot_tokens == 0
    assert engine.counters.invariant_violations == before + 1
    assert engine.call(lambda e: (e.llama.seq_len(2), e.table[2].n_tokens)).result(10) == (0, 0)


def test_a_short_prompt_is_prefilled_before_a_long_one_that_came_first(engine, vocab):
    """Prefill budget goes to the prompt with the least left to compute: a 50-token agent turn that arrives while a
    cold 1,500-token prompt is being read gets its first token first (oldest-first would finish the long one first)."""
    long_prompt = vocab.tokenize("The keeper wrote in the log every night of the year. " * 125)
    short_prompt = vocab.tokenize("Visitor: is the lamp lit tonight? Keeper:")
    assert len(long_prompt) > 2 * engine.n_batch and len(short_prompt) < 64
    long_run = start(engine, long_prompt, slot=2, prefix_cache=False, max_tokens=2)
    while not engine.call(lambda e: e.table.slots[2].n_tokens > 0).result(10):  # the long one is being read
        pass
    short_run = start(engine, short_prompt, slot=3, prefix_cache=False, max_tokens=2)
    long_run.wait(), short_run.wait()
    assert isinstance(long_run.final, JobDone) and isinstance(short_run.final, JobDone)
    assert short_run.times[0] < long_run.times[0]


def test_only_the_compute_thread_decodes(engine, vocab):
    """A second live thread calling llama_decode would make llama.cpp's OpenMP threads sleep at every barrier
    (worker/llama.py `decode`): it is refused before anything is computed, and the engine goes on."""
    complete(engine, vocab.tokenize("Hi"), max_tokens=1)  # the compute thread has decoded
    raised: list[BaseException] = []

    def stray() -> None:
        try:
            engine.llama.decode()
        except RuntimeError as exc:
            raised.append(exc)

    t = threading.Thread(target=stray, name="stray")
    t.start()
    t.join()
    assert raised and "stray" in str(raised[0]) and "kvroute-engine" in str(raised[0])
    assert isinstance(complete(engine, vocab.tokenize("Hi"), max_tokens=2).final, JobDone)
