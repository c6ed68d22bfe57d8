"""What the replies of several APIs share: the usage's `context_shift`, llama-server's `timings`, OpenAI's token
logprobs (Chat Completions' and Responses'), the usage of embeddings and rerank, and a server-sent event as the
event-typed streams (Responses, Anthropic Messages) write one."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol import Result, TokenLogprob


def context_shift(result: Result) -> dict[str, Any]:
    """The usage's `context_shift` when --context-shift dropped messages: the prompt served is not the one sent (every
    API's usage says so the same way)."""
    if not result.dropped_messages:
        return {}
    return {"context_shift": {"dropped_messages": result.dropped_messages, "dropped_tokens": result.dropped_tokens}}


def timings_body(result: Result) -> dict[str, Any]:
    """llama-server's `timings` (its replies carry them beside the usage, streamed or not; its web UI and scripts read
    them): the prompt tokens reused (`cache_n`) and computed (`prompt_n`) and the time they took, then the generated
    ones (`predicted_n`) and theirs. A stream gets them on its last chunk whether it asked for usage or not."""
    u, t = result.usage, result.timings
    computed = u.prompt_tokens - u.cached_tokens
    return {
        "cache_n": u.cached_tokens,
        "prompt_n": computed,
        "prompt_ms": t.prefill_ms,
        "prompt_per_token_ms": t.prefill_ms / computed if computed else 0.0,
        "prompt_per_second": 1e3 * computed / t.prefill_ms if t.prefill_ms else 0.0,
        "predicted_n": u.completion_tokens,
        "predicted_ms": t.decode_ms,
        "predicted_per_token_ms": t.decode_ms / u.completion_tokens if u.completion_tokens else 0.0,
        "predicted_per_second": 1e3 * u.completion_tokens / t.decode_ms if t.decode_ms else 0.0,
    }


def inputs_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The usage of an embeddings or rerank reply: its inputs' tokens, and those whose KV was kept (as chat's usage says
    it; OpenAI's embeddings usage has no such field) when there are any."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def piece(data: bytes) -> str:
    """A token's bytes as text (a part of a character replaced)."""
    return data.decode("utf-8", "replace")


def chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    """Token logprobs as Chat Completions gives them (Responses' output text carries the same `content` items)."""
    return {
        "content": [
            {
                "token": piece(lp.piece),
                "logprob": lp.logprob,
                "bytes": list(lp.piece),
                "top_logprobs": [{"token": piece(x.piece), "logprob": x.logprob, "bytes": list(x.piece)} for x in lp.top],
            }
            for lp in lps
        ],
        "refusal": None,
    }


def sse(event: str, data: Any) -> bytes:
    """A server-sent event with its type (`event:`) and its data as JSON."""
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
