"""A reply's messages to its client, built from what its job produced: by the router for the replies it relays, and
by a client reading direct replies (kvroute/direct.py), so that both give the client the same messages."""

from __future__ import annotations

from chat.output_parser import OutputParser, Piece
from protocol import Choice, Delta, FinishReason, JobDone, Result, Timings, TokenLogprob, ToolCall, Usage


def delta_of(rid: str, index: int, piece: Piece, tokens: bytes, logprobs: list[TokenLogprob]) -> Delta:
    """A delta of choice `index`: what the parser made of the job's new text."""
    return Delta(
        id=rid,
        index=index,
        text=piece.content,
        reasoning=piece.reasoning,
        tool_calls=piece.calls,
        tokens=tokens,
        logprobs=logprobs,
    )


def choice_of(index: int, parser: OutputParser, done: JobDone, logprobs: list[TokenLogprob]) -> Choice:
    """The reply of one choice, read by its parser (which has seen every delta and `finish`)."""
    calls = [ToolCall(id=c.id or "", name=c.name, arguments=c.arguments) for c in parser.tool_calls]
    reason = done.finish_reason
    if calls and reason == FinishReason.STOP:
        reason = FinishReason.TOOL_CALLS
    return Choice(
        index=index,
        finish_reason=reason,
        text=parser.text,
        tokens=done.tokens,
        reasoning=parser.reasoning_text,
        tool_calls=calls,
        logprobs=logprobs,
        stop=done.stop,
        completion_tokens=done.generated_tokens,
        cached_tokens=done.reused_tokens,
    )


def result_of(rid: str, choices: list[Choice], usage: Usage, timings: Timings, worker: str, slot: int) -> Result:
    """One result for the request: choice 0's fields, every choice when there are several (`usage` counts the prompt
    once, the choices' completion tokens summed)."""
    first = choices[0]
    return Result(
        id=rid,
        finish_reason=first.finish_reason,
        text=first.text,
        tokens=first.tokens,
        usage=usage,
        timings=timings,
        worker=worker,
        slot=slot,
        stop=first.stop,
        reasoning=first.reasoning,
        tool_calls=first.tool_calls,
        logprobs=first.logprobs,
        choices=choices if len(choices) > 1 else [],
    )
