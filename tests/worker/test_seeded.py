"""A seed gives the same tokens every time the same request comes (issue 30), with the real default model.

Default mode (`fast_engine`, `default4`; speculation on): the same seeded job cold, cached, copied into another slot,
with speculation off, after another seeded prompt's prefix and batched with other jobs gives the same tokens, because
a seeded job takes no guesses (rows verified together are computed with other kernels than one row alone), has
llama_decodes of its own (other jobs' rows would change its kernels), computes its prompt in padded chunks (whose KV
does not depend on where a chunk starts: worker/llama.py) and its last prompt token alone, as a cached run of it does,
and reuses only KV that seeded prompts computed so.
Deterministic mode (`engine`, speculation on): the same after another request's prefix, batched with other jobs and
with guesses taken, because no decode batch asks for more rows of logits than llama.cpp computes as it computes a
prompt's (EXACT_OUTPUTS), not even with more generating slots than that."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_helpers import Run, assert_slot_invariant, complete, decodes, start

from common.slots import common_prefix
from protocol import JobDone
from worker.batching import EXACT_OUTPUTS
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.llama import alone_rows
from worker.speculate import StepCost

pytestmark = pytest.mark.model

SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": 40}
COLOURS = "red, green, blue, yellow, " * 6  # a reply that copies it can be guessed from the prompt


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def counters(engine: Engine) -> tuple[int, int, int]:
    c = engine.call(lambda e: e.counters).result(10)
    return c.spec_proposed, c.spec_accepted, c.invariant_violations


def set_spec(engine: Engine, on: bool) -> None:
    engine.call(lambda e: setattr(e, "spec", on)).result(10)


def logprobs(run: Run) -> list[float]:
    return [lp.logprob for d in run.deltas for lp in d.logprobs]


def done(run: Run) -> JobDone:
    assert isinstance(run.final, JobDone), run.final
    return run.final


def test_a_seeded_request_gives_the_same_tokens_cold_cached_in_another_slot_and_without_speculation(fast_engine):
    """Issue 30: the same chat request with seed 1234 at temperature 1.0, sent three times, gave three texts."""
    prompt = fast_engine.vocab.tokenize(chat(f"Say these colours again: {COLOURS}"))
    assert len(prompt) > 40  # (long enough for another slot to copy it rather than compute it)
    set_spec(fast_engine, True)
    # whether a guess pays is learned from the steps this engine timed (worker/speculate.py StepCost): after the earlier
    # tests' steps it may say guesses do not pay on this machine, and 24 tokens take none; a fresh table takes the first
    fast_engine.call(lambda e: setattr(e, "step_cost", StepCost())).result(10)
    guessed = counters(fast_engine)
    unseeded = complete(fast_engine, prompt, slot=0, prefix_cache=False, max_tokens=24)
    assert done(unseeded) and counters(fast_engine)[0] > guessed[0], "speculation is off: the test would prove nothing"

    before = counters(fast_engine)
    cold = complete(fast_engine, prompt, slot=0, prefix_cache=False, **SEEDED)
    cached = complete(fast_engine, prompt, slot=0, **SEEDED)
    fast_engine.call(lambda e: e.prefixes.clear(e.table[1])).result(10)
    copied = complete(fast_engine, prompt, slot=1, **SEEDED)
    after = counters(fast_engine)
    set_spec(fast_engine, False)
    try:
        plain = complete(fast_engine, prompt, slot=1, prefix_cache=False, **SEEDED)
    finally:
        set_spec(fast_engine, True)

    assert done(cold).reused_tokens == 0 and done(cold).generated_tokens == 40
    assert done(cached).reused_tokens == len(prompt) - 1 and done(cached).restored_tokens == 0
    assert done(copied).restored_tokens == done(copied).reused_tokens == len(prompt) - 1  # from slot 0's KV
    assert cached.tokens == cold.tokens and copied.tokens == cold.tokens and plain.tokens == cold.tokens
    assert done(cached).text == done(copied).text == done(plain).text == done(cold).text
    assert after[0] == before[0]  # a seeded job takes no guesses without deterministic mode
    assert after[2] == before[2]
    for run in (cold, cached, copied, plain):
        assert_slot_invariant(fast_engine, run)


def test_a_seeded_job_computes_its_prompt_alone_in_a_padded_chunk_and_its_last_token_on_its_own(fast_engine):
    prompt = fast_engine.vocab.tokenize(chat("Name three rivers of Europe."))
    n = len(prompt)
    with decodes(fast_engine) as seen:
        run = complete(fast_engine, prompt, slot=0, prefix_cache=False, **{**SEEDED, "max_tokens": 2})
    assert seen[0] == [(0, pos, False) for pos in range(alone_rows(n - 1))]  # n - 1 tokens, then padding
    assert seen[1:3] == [[(0, n - 1, True)], [(0, n, True)]]  # the last prompt token alone; the decode row alone
    assert done(run).slot_n_exact == n - 1  # what the next seeded job may reuse: not the last token, nor the reply
    assert_slot_invariant(fast_engine, run)  # (the padding's KV is gone)
    with decodes(fast_engine) as seen:
        complete(fast_engine, prompt, slot=0, prefix_cache=False, temperature=1.0, max_tokens=2)  # no seed
    assert len([r for r in seen[0] if r[0] == 0]) == n  # the whole prompt in one chunk


PROMPTS = [  # the first two parted, cached vs cold, when 8 guessed rows asked for logits in one batch
    "Write about: night lamp cook north bread north north sea sea storm storm lamp lamp log",
    "Write about: log salt keeper story sea dawn log salt log north salt sea wind bread rock log ship north night",
    "Write about: boat rope sea bread rock ship lamp wind boat salt rock night sail wind rock sea storm story keeper",
]


@pytest.mark.parametrize("text", PROMPTS[:2])
def test_deterministic_mode_gives_a_seeded_job_the_same_tokens_whatever_prefix_batch_and_guesses(engine, vocab, text):
    prompt = vocab.tokenize(chat(text))
    others = [vocab.tokenize(chat(t)) for t in PROMPTS if t != text]
    kw = {**SEEDED, "seed": 1235}
    before = counters(engine)
    with decodes(engine) as seen:
        cold = complete(engine, prompt, slot=0, prefix_cache=False, **kw)
        cached = complete(engine, prompt, slot=0, **kw)  # guesses from the cold run's output, taken whole
        complete(engine, others[0], slot=2, prefix_cache=False, **kw)
        # reuses what it can there: the chat template another prompt left, or, larger, the state the cached run left in
        # host RAM (any gain is worth a restore: common/slots.py COPY_MIN)
        after_other = complete(engine, prompt, slot=2, **kw)
        runs = [start(engine, p, slot=s, prefix_cache=False, **kw) for s, p in ((0, others[0]), (2, others[1]))]
        batched = start(engine, prompt, slot=1, prefix_cache=False, **kw)
        for r in [*runs, batched]:
            r.wait()
    after = counters(engine)
    other = done(after_other)
    assert other.reused_tokens > 0 and (other.reused_tokens < len(prompt) - 8 or other.restored_tokens == other.reused_tokens)
    assert done(cached).reused_tokens > 0
    assert cached.tokens == cold.tokens
    assert after_other.tokens == cold.tokens
    assert batched.tokens == cold.tokens
    assert after[1] > before[1], "no guess was taken: the test did not exercise speculation"
    assert after[2] == before[2]
    assert max(sum(out for _, _, out in rows) for rows in seen) == EXACT_OUTPUTS  # guesses fill up to the limit


@pytest.fixture(scope="module")
def nine() -> Iterator[Engine]:
    """Deterministic mode with more slots than EXACT_OUTPUTS, all generating at once."""
    eng = Engine(WorkerConfig(slots=9, ctx_per_slot=256, threads=2, deterministic=True)).start()
    yield eng
    eng.stop()


def test_more_generating_slots_than_exact_outputs_decode_in_several_batches(nine):
    prompts = [nine.vocab.tokenize(chat(f"Count from {i} to {i + 9}, one number per line.")) for i in range(9)]
    kw = {**SEEDED, "max_tokens": 10}
    with decodes(nine) as seen:
        runs = [start(nine, p, slot=s, prefix_cache=False, **kw) for s, p in enumerate(prompts)]
        for r in runs:
            r.wait()
    generating = [rows for rows in seen if len({s for s, _, out in rows if out}) > 1]
    assert generating, "the slots never decoded together"
    assert max(sum(out for _, _, out in rows) for rows in seen) <= EXACT_OUTPUTS
    assert any(len({s for s, _, out in rows if out}) == EXACT_OUTPUTS for rows in seen)
    for s in (0, 8):  # the first and the last slot alone give what they gave batched
        alone = complete(nine, prompts[s], slot=s, prefix_cache=False, **kw)
        assert alone.tokens == runs[s].tokens


# (long enough that a slot holds 256+ cells: flash attention takes another path for one row alone from there)
STORY = "The keeper of the lighthouse wrote in his log that the wind turned north and the sea rose over the rocks. " * 26


def test_without_deterministic_mode_a_seeded_job_repeats_after_other_prefixes_and_beside_another_prompt(default4):
    """Issue 30: a prompt found in part in the cache, or computed beside another prompt, changed a seeded job's
    tokens. (Its decode rows share the batch with other generating jobs: only deterministic mode repeats it then.)"""
    eng = default4
    prompt = eng.vocab.tokenize(chat(f"{STORY}What did the keeper see?"))
    sibling = eng.vocab.tokenize(chat(f"{STORY}What did the keeper eat?"))  # the same first ~590 tokens
    shared = common_prefix(prompt, sibling)
    assert 300 < shared < len(prompt) - 4
    kw = {**SEEDED, "seed": 1236, "logprobs": 1}  # (a logprob tells a changed logit even where the token stays)
    clear = lambda i: eng.call(lambda e: e.prefixes.clear(e.table[i])).result(10)  # noqa: E731

    cold = complete(eng, prompt, slot=0, prefix_cache=False, **kw)
    complete(eng, sibling, slot=1, prefix_cache=False, **kw)
    after_seeded = complete(eng, prompt, slot=1, **kw)  # reuses the sibling's prefix, computed for a seeded job
    clear(0), clear(1)
    complete(eng, sibling, slot=2, prefix_cache=False, temperature=1.0, max_tokens=4)  # no seed
    after_unseeded = complete(eng, prompt, slot=2, **kw)  # that prefix is not what a seeded prompt computes
    clear(2)
    other = eng.vocab.tokenize(chat("Hi."))  # a few rows beside the seeded prompt's chunk would change its KV
    with decodes(eng) as seen:
        batched = start(eng, prompt, slot=0, prefix_cache=False, **kw)
        beside = start(eng, other, slot=1, prefix_cache=False, temperature=1.0, max_tokens=1)  # done before it decodes
        for r in (batched, beside):
            r.wait()

    assert done(after_seeded).reused_tokens == shared and done(after_seeded).restored_tokens == 0
    assert done(after_unseeded).reused_tokens == 0  # (an unseeded job would have reused `shared` tokens of it)
    assert after_seeded.tokens == cold.tokens and logprobs(after_seeded) == logprobs(cold)
    assert after_unseeded.tokens == cold.tokens and logprobs(after_unseeded) == logprobs(cold)
    assert batched.tokens == cold.tokens and logprobs(batched) == logprobs(cold)
    n = len(prompt)
    reading = [rows for rows in seen if any(s == 0 and pos < n for s, pos, _ in rows)]  # its prompt, last token too
    assert all({s for s, _, _ in rows} == {0} for rows in reading)  # never beside another slot's rows
    assert any(1 in {s for s, _, _ in rows} for rows in seen[: seen.index(reading[-1])]), "nothing ran beside it"
    for run in (cold, after_seeded, after_unseeded, batched, beside):
        assert_slot_invariant(eng, run)
