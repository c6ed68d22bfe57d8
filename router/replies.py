"""What the router sends a client about a request: deltas as the reply is read, then one result for all choices."""

from __future__ import annotations

from chat.output import Piece
from protocol import Choice, Delta, FinishReason, JobDone, Result, TokenLogprob, ToolCall, ToolCallDelta, Usage
from router.requests import Req


def delta_of(req: Req, piece: Piece, tokens: bytes, logprobs: list[TokenLogprob]) -> Delta:
    calls = [ToolCallDelta(index=i, id=call_id, name=c.name, arguments=c.arguments) for i, call_id, c in piece.calls]
    return Delta(
        id=req.rid,
        index=req.index,
        text=piece.content,
        reasoning=piece.reasoning,
        tool_calls=calls,
        tokens=tokens,
        logprobs=logprobs,
    )


def choice_of(req: Req, done: JobDone) -> Choice:
    """The reply of one choice, read by its parser (which has seen every delta and `finish`)."""
    assert req.attempt is not None
    parser = req.attempt.parser
    calls = [ToolCall(id=call_id, name=c.name, arguments=c.arguments) for _, call_id, c in parser.calls]
    reason = done.finish_reason
    if calls and reason == FinishReason.STOP:
        reason = FinishReason.TOOL_CALLS
    return Choice(
        index=req.index,
        finish_reason=reason,
        text=parser.text,
        tokens=done.tokens,
        reasoning=parser.reasoning_text,
        tool_calls=calls,
        logprobs=req.attempt.logprobs,
        stop=done.stop,
        completion_tokens=done.generated_tokens,
        cached_tokens=done.reused_tokens,
    )


def result_of(choices: list[Req], worker: str, slot: int) -> Result:
    """One result for the request: choice 0's fields, every choice when there are several. The prompt is counted
    once (the choices share its KV); completion tokens are summed."""
    lead = choices[0]
    first, usage = lead.choice, lead.usage
    assert first is not None and usage is not None and lead.timings is not None
    total = sum(r.usage.completion_tokens for r in choices if r.usage is not None)
    return Result(
        id=lead.rid,
        finish_reason=first.finish_reason,
        text=first.text,
        tokens=first.tokens,
        usage=Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens, completion_tokens=total),
        timings=lead.timings,
        worker=worker,
        slot=slot,
        stop=first.stop,
        reasoning=first.reasoning,
        tool_calls=first.tool_calls,
        logprobs=first.logprobs,
        choices=[r.choice for r in choices if r.choice is not None] if len(choices) > 1 else [],
    )
