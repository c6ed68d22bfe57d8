"""The benchmark's workload generator: same seed, same prompts; sizes in model tokens; prompts carry history."""

from __future__ import annotations

import dataclasses

import pytest

from bench.workloads import WORKLOADS, Session, Sizes, TextGen, build, grow, model_tokenizer


def words(text: str) -> list[int]:
    """A stand-in tokenizer for the logic tests: one token per whitespace-separated word."""
    return [len(w) for w in text.split()]


SMALL = Sizes(
    turns=3, long_turns=4, sessions=3, session_turns=2, requests=3, fanout_requests=3,
    preamble_tokens=120, shared_tokens=40, system_tokens=60, prompt_tokens=50, document_tokens=90,
)  # fmt: skip


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_workload_other_seed_other_text(name: str) -> None:
    a, b = build(name, SMALL, words), build(name, SMALL, words)
    assert a == b
    c = build(name, dataclasses.replace(SMALL, seed=SMALL.seed + 1), words)
    assert [s.opening for s in c.sessions] != [s.opening for s in a.sessions]


def test_counts_follow_the_sizes() -> None:
    assert len(build("agent-long", SMALL, words).sessions[0].messages) == SMALL.turns
    assert len(build("long-session", SMALL, words).sessions[0].messages) == SMALL.long_turns
    multi = build("multi-agent", SMALL, words)
    assert (len(multi.sessions), multi.concurrency, multi.n_requests) == (3, 3, 3 * SMALL.session_turns)
    many = build("many-agents", SMALL, words)
    assert (len(many.sessions), many.concurrency) == (SMALL.many_sessions, SMALL.many_sessions)
    assert many.sessions[:3] == multi.sessions  # the same agents, more of them
    throughput = build("throughput", SMALL, words)
    assert (len(throughput.sessions), throughput.concurrency) == (SMALL.requests, SMALL.concurrency)
    assert len({s.opening for s in throughput.sessions}) == SMALL.requests  # distinct prompts
    fan = build("fanout", SMALL, words)
    assert len({s.opening for s in fan.sessions}) == 1  # one shared document
    assert len({s.messages for s in fan.sessions}) == SMALL.fanout_requests  # different questions


def test_multi_agent_sessions_share_a_preamble_and_differ_after_it() -> None:
    openings = [s.opening for s in build("multi-agent", SMALL, words).sessions]
    shared = openings[0][: openings[0].index("\n\nYou are agent")]
    assert all(o.startswith(shared) for o in openings)
    assert len(set(openings)) == len(openings)


def test_grow_reaches_the_target_and_overshoots_by_little() -> None:
    gen = TextGen("x")
    for target in (10, 57, 300):
        n = len(words(grow("Start.", target, gen.statement, words)))
        assert target <= n <= target + 1


def test_prompt_is_opening_then_history_then_message() -> None:
    s = Session("s", "OPEN", ("<m0>", "<m1>", "<m2>"), 8)
    assert s.prompt(0, []) == "OPEN<m0>"
    assert s.prompt(2, ["c0", "c1"]) == "OPEN<m0>c0<m1>c1<m2>"
    with pytest.raises(ValueError, match="needs the 2 earlier completions"):
        s.prompt(2, ["c0"])


@pytest.mark.model
def test_sizes_are_model_tokens() -> None:
    from common.model import resolve_model

    tokenize = model_tokenizer(str(resolve_model(None)))
    sizes = Sizes()
    agent = build("agent-long", dataclasses.replace(sizes, turns=3), tokenize)
    assert sizes.preamble_tokens <= len(tokenize(agent.sessions[0].opening)) <= sizes.preamble_tokens + 3
    for m in agent.sessions[0].messages:
        assert abs(len(tokenize(m)) - sizes.user_tokens) <= 3
    fan = build("fanout", dataclasses.replace(sizes, fanout_requests=2), tokenize)
    assert sizes.document_tokens <= len(tokenize(fan.sessions[0].opening)) <= sizes.document_tokens + 3
