"""The tokens of the model's thinking, counted by the router while its reader is in the thinking (issue 63): the
result's `usage.reasoning_tokens` (Responses' `output_tokens_details.reasoning_tokens`, Chat's
`completion_tokens_details.reasoning_tokens`), streamed or not, summed over a request's choices; a delta of several
tokens (speculation's guesses) in which the thinking ends counts its share (no model: the router's core, driven)."""

from __future__ import annotations

from typing import Any

from scheduler_helpers import CLIENT, PROMPT, core, hello, jobs, to_client

from chat.output import OutputSpec
from protocol import Delta, Job, JobDelta, JobDone, Result, Sampling, Submit, Timings, pack_tokens, token_hash, unpack_tokens
from router.prepare import Prepared
from router.scheduler import Scheduler

THINKING = OutputSpec(reasoning=("<think>", "</think>"))


def submit(s: Scheduler, rid: str = "a", **kw: Any) -> list[Job]:
    sub = Submit(id=rid, tokens=pack_tokens(PROMPT.tolist()), sampling=Sampling(max_tokens=64, temperature=0.0), **kw)
    req = s.accept(CLIENT, (), sub)
    assert req is not None
    s.prepared(req, Prepared(PROMPT, None, THINKING))
    return jobs(s.take())


def reply(s: Scheduler, job: Job, pieces: list[tuple[str, int]]) -> tuple[list[Delta], Result | None]:
    """The worker writes `pieces` (text, tokens it took) then ends; the deltas and result the client gets."""
    generated: list[int] = []
    deltas: list[Delta] = []
    for text, n in pieces:
        toks = list(range(1000 + len(generated), 1000 + len(generated) + n))
        generated += toks
        s.worker_message(b"w0", JobDelta(id=job.id, text=text, tokens=pack_tokens(toks), reused_tokens=0))
        deltas += to_client(s.take(), Delta)
    kept = unpack_tokens(job.tokens) + generated[:-1]
    s.worker_message(
        b"w0",
        JobDone(id=job.id, slot=job.slot, finish_reason="stop", text="".join(t for t, _ in pieces), tokens=pack_tokens(generated),
                prompt_tokens=len(PROMPT), reused_tokens=0, prefilled_tokens=len(PROMPT), generated_tokens=len(generated),
                slot_tokens=len(kept), slot_hash=token_hash(kept), timings=Timings()),
    )  # fmt: skip
    out = s.take()
    results = to_client(out, Result)
    return deltas + to_client(out, Delta), results[0] if results else None


def test_the_result_counts_the_thinking_tokens_with_its_tags_a_tag_in_pieces_included() -> None:
    s = core()
    hello(s)
    (job,) = submit(s, stream=True)
    pieces = [("<", 1), ("think", 1), (">", 1), ("plan", 1), (" it", 1), ("</think>", 1), ("\n\n", 1), ("Done", 1), (".", 1)]
    deltas, res = reply(s, job, pieces)
    assert res is not None and res.reasoning == "plan it" and res.text == "Done."
    assert res.usage.completion_tokens == 9 and res.usage.reasoning_tokens == 6
    assert "".join(d.reasoning or "" for d in deltas) == "plan it"  # (streamed apart from the text)


def test_a_reply_without_thinking_counts_none() -> None:
    s = core()
    hello(s)
    (job,) = submit(s)
    _, res = reply(s, job, [("<b", 1), (">Hi", 1), ("</b>", 1)])
    assert res is not None and res.text == "<b>Hi</b>" and res.usage.reasoning_tokens == 0


def test_a_delta_of_several_tokens_in_which_the_thinking_ends_counts_its_share() -> None:
    s = core()
    hello(s)
    (job,) = submit(s)
    # 8 tokens whose first 8 bytes of 30 end the thinking: 3 of them (8 x 8 / 30, rounded up) are the thinking's
    _, res = reply(s, job, [("<think>", 1), ("hmm", 1), ("</think>\n\nThe answer is twelve", 8)])
    assert res is not None and res.text == "The answer is twelve" and res.reasoning == "hmm"
    assert res.usage.completion_tokens == 10 and res.usage.reasoning_tokens == 2 + 3


def test_choices_sum_their_thinking_tokens() -> None:
    s = core()
    hello(s, slots=2)
    first, second = submit(s, n=2)
    assert reply(s, first, [("<think>", 1), ("a", 1), ("</think>", 1), ("x", 1)])[1] is None  # (the other runs on)
    _, res = reply(s, second, [("<think>", 1), ("b", 1), ("c", 1), ("</think>", 1), ("y", 1)])
    assert res is not None and res.usage.completion_tokens == 9 and res.usage.reasoning_tokens == 3 + 4
