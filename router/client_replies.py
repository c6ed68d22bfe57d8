"""What the router sends a client about a request: deltas as the reply is read, then one result for all choices
(chat/reply_messages.py builds them, as a client reading direct replies does)."""

from __future__ import annotations

from chat import reply_messages
from chat.output_parser import Piece
from protocol import Choice, Delta, JobDone, Result, TokenLogprob, Usage
from router.requests import Req


def delta_of(req: Req, piece: Piece, tokens: bytes, logprobs: list[TokenLogprob]) -> Delta:
    return reply_messages.delta_of(req.rid, req.index, piece, tokens, logprobs)


def choice_of(req: Req, done: JobDone) -> Choice:
    assert req.attempt is not None
    return reply_messages.choice_of(req.index, req.attempt.parser, done, req.attempt.logprobs)


def result_of(choices: list[Req], worker: str, slot: int) -> Result:
    """One result for the request: choice 0's fields, every choice when there are several. The prompt is counted
    once (the choices share its KV); completion tokens are summed."""
    lead = choices[0]
    usage = lead.usage
    assert usage is not None and lead.timings is not None
    total = sum(r.usage.completion_tokens for r in choices if r.usage is not None)
    reasoning = sum(r.usage.reasoning_tokens for r in choices if r.usage is not None)
    usage = Usage(
        prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens, completion_tokens=total, reasoning_tokens=reasoning
    )
    done = [r.choice for r in choices if r.choice is not None]
    return reply_messages.result_of(lead.rid, done, usage, lead.timings, worker, slot)
