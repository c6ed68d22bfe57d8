"""Engine with the real default model: determinism gate, reuse accounting, slot choice, chunked prefill."""

from __future__ import annotations

import time

import pytest
from worker_helpers import assert_slot_invariant, complete, start

from protocol import JobDone, unpack_tokens

pytestmark = pytest.mark.model

TURNS = [
    "User: Hi! What is the capital of France?\nAssistant:",
    "\nUser: And what river runs through it?\nAssistant:",
    "\nUser: Name a famous museum there.\nAssistant:",
    "\nUser: What is painted on its most famous canvas?\nAssistant:",
    "\nUser: Who painted it?\nAssistant:",
    "\nUser: In which century did he live?\nAssistant:",
    "\nUser: Name another of his inventions.\nAssistant:",
    "\nUser: Was it ever built?\nAssistant:",
    "\nUser: Thanks. Summarise our talk in one line.\nAssistant:",
    "\nUser: Now say goodbye.\nAssistant:",
]


def test_multi_turn_reuse_matches_cold_every_turn(engine, vocab):
    """Determinism gate: a 30-turn conversation on one slot with reuse generates exactly what a cold slot does, and
    reuses everything the slot holds: the previous prompt and the reply (its tokens' KV came from padded batches)."""
    history: list[int] = vocab.tokenize("A conversation.\n")
    held = 0
    for i in range(30):
        turn = TURNS[i % len(TURNS)]
        prompt = history + vocab.tokenize(turn, add_special=False)
        warm = complete(engine, prompt, slot=0, max_tokens=6)
        cold = complete(engine, prompt, slot=1, prefix_cache=False, max_tokens=6)
        assert isinstance(warm.final, JobDone) and isinstance(cold.final, JobDone)
        assert warm.tokens == cold.tokens, f"turn {i}: cached {warm.tokens} != cold {cold.tokens}"
        assert cold.final.reused_tokens == 0
        assert warm.final.reused_tokens == held
        assert_slot_invariant(engine, warm)
        held, history = warm.final.slot_tokens, prompt + warm.tokens


def test_concurrent_matches_alone(engine, vocab):
    """Four sequences decoded in one batch produce exactly what each produces alone."""
    texts = ["The sun is", "Water boils at", "My favourite food is", "Once upon a time, a"]
    prompts = [vocab.tokenize(t) for t in texts]
    alone = [complete(engine, p, slot=i, prefix_cache=False, max_tokens=12).tokens for i, p in enumerate(prompts)]
    runs = [start(engine, p, slot=i, prefix_cache=False, max_tokens=12) for i, p in enumerate(prompts)]
    together = []
    for r in runs:
        r.wait()
        together.append(r.tokens)
    assert together == alone


def test_slots_apart_match_alone(engine, vocab):
    """Slots 1 and 3 decoding together (their padded batch spans idle slot 2 too) produce what each does alone."""
    prompts = {1: vocab.tokenize("The river flows"), 3: vocab.tokenize("In the morning the baker")}
    alone = {i: complete(engine, p, slot=i, prefix_cache=False, max_tokens=12).tokens for i, p in prompts.items()}
    runs = {i: start(engine, p, slot=i, prefix_cache=False, max_tokens=12) for i, p in prompts.items()}
    for r in runs.values():
        r.wait()
    assert {i: r.tokens for i, r in runs.items()} == alone


def test_follow_up_turn_reuses_prompt_and_generated_tokens(fast_engine):
    """Default mode: the next turn reuses previous prompt + generated - 1 tokens and prefills only the rest."""
    vocab = fast_engine.vocab
    p1 = vocab.tokenize("User: Tell me about cats.\nAssistant:")
    first = complete(fast_engine, p1, slot=0, prefix_cache=False, max_tokens=7)
    new = vocab.tokenize("\nUser: And dogs?\nAssistant:", add_special=False)
    p2 = p1 + first.tokens + new
    second = complete(fast_engine, p2, slot=0, max_tokens=3)
    assert first.final.slot_tokens == len(p1) + 7 - 1
    assert second.final.reused_tokens == len(p1) + 7 - 1
    assert second.final.prefilled_tokens == len(new) + 1
    assert_slot_invariant(fast_engine, second)


def test_full_match_backs_off_one_token(fast_engine):
    vocab = fast_engine.vocab
    prompt = vocab.tokenize("Exactly the same prompt twice, please.")
    complete(fast_engine, prompt, slot=1, prefix_cache=False, max_tokens=1)  # slot holds exactly the prompt
    again = complete(fast_engine, prompt, slot=1, max_tokens=2)
    assert again.final.reused_tokens == len(prompt) - 1
    assert again.final.prefilled_tokens == 1
    assert_slot_invariant(fast_engine, again)


def test_edited_earlier_message_reuses_exact_common_prefix(fast_engine):
    vocab = fast_engine.vocab
    head = vocab.tokenize("System: be brief.\nUser: My name is Alice and I like")
    a = head + vocab.tokenize(" apples. What do I like?\nAssistant:", add_special=False)
    b = head + vocab.tokenize(" pears. What do I like?\nAssistant:", add_special=False)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    complete(fast_engine, a, slot=0, prefix_cache=False, max_tokens=4)
    edited = complete(fast_engine, b, slot=0, max_tokens=4)
    assert edited.final.reused_tokens == common
    assert edited.final.prefilled_tokens == len(b) - common
    assert_slot_invariant(fast_engine, edited)


def test_edited_prompt_output_matches_cold_in_deterministic_mode(engine, vocab):
    head = vocab.tokenize("System: be brief.\nUser: My name is Bob and my favourite colour is")
    a = head + vocab.tokenize(" green. Which colour do I like?\nAssistant:", add_special=False)
    b = head + vocab.tokenize(" purple. Which colour do I like?\nAssistant:", add_special=False)
    complete(engine, a, slot=3, prefix_cache=False, max_tokens=4)
    edited = complete(engine, b, slot=3, max_tokens=8)
    assert edited.final.reused_tokens > 0
    cold = complete(engine, b, slot=3, prefix_cache=False, max_tokens=8)
    assert edited.tokens == cold.tokens


def test_unnamed_job_picks_slot_with_longest_prefix(fast_engine):
    engine, vocab = fast_engine, fast_engine.vocab
    doc = vocab.tokenize("A long shared document about the history of tea in China and Japan. " * 4)
    seeded = complete(engine, doc + vocab.tokenize(" First question?", add_special=False), slot=1, max_tokens=2)
    follow = complete(engine, doc + vocab.tokenize(" Second question?", add_special=False), max_tokens=2)
    assert follow.final.slot == seeded.final.slot == 1
    assert follow.final.reused_tokens >= len(doc)


def test_named_busy_slot_queues_fifo(engine, vocab):
    p = vocab.tokenize("Count with me: one, two, three,")
    first = start(engine, p, slot=2, max_tokens=10)
    second = start(engine, p, slot=2, max_tokens=3)
    third = start(engine, p, slot=2, max_tokens=3)
    for r in (first, second, third):
        assert isinstance(r.wait(), JobDone)
        assert r.final.slot == 2
    assert first.times[-1] <= second.times[0] and second.times[-1] <= third.times[0]
    assert second.final.timings.queue_ms > 0


def test_chunked_prefill_does_not_stall_generating_slots(engine, vocab):
    """A 3,000-token prompt arriving while 3 slots generate: they keep producing tokens during its prefill."""
    stories = [vocab.tokenize(f"Story number {i}: once upon a time") for i in range(3)]
    gens = [start(engine, p, slot=i, prefix_cache=False, max_tokens=40) for i, p in enumerate(stories)]
    for g in gens:  # wait until all three are decoding
        while len(g.deltas) < 2:
            time.sleep(0.005)
    long_prompt = vocab.tokenize("The quick brown fox jumps over the lazy dog. " * 300)[:3000]
    assert len(long_prompt) == 3000
    long = start(engine, long_prompt, slot=3, prefix_cache=False, max_tokens=2)
    long.wait()
    for g in gens:
        g.wait()
    assert long.final.reused_tokens == 0 and long.final.prefilled_tokens == 3000
    t_first = long.times[0]  # the long job's first token
    t_begin = t_first - long.final.timings.prefill_ms / 1000.0
    for g in gens:
        during = [t for t in g.times if t_begin <= t < t_first]
        assert len(during) >= 3, f"a generating slot produced {len(during)} tokens during the 3,000-token prefill"
    assert all(len(unpack_tokens(g.final.tokens)) == 40 for g in gens)
