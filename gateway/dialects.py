"""Each generating HTTP API as a dialect that `Gateway.serve` runs the same way: a body decoded into a protocol
`Submit` under the API's field policy (gateway/fields.py), the reply's body and stream events, and the API's
error shapes (an HTTP error body, an error in the middle of a stream).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway import anthropic, normalise, openai_chat, responses
from gateway.errors import (
    ANTHROPIC_ERRORS,
    OPENAI_ERRORS,
    Errors,
    chat_stream_error,
    messages_stream_error,
    responses_stream_error,
)
from gateway.fields import HINT_HEADERS, Policy
from gateway.images import Images
from gateway.keepalive import Tick
from protocol import Delta, Overflow, Result, Submit

Events = Callable[[AsyncIterator[Delta | Result | Tick]], AsyncIterator[bytes]]


@dataclass
class Call:
    """One decoded request: its submit, whether it streams, and how its reply is written. `reply` and `events` read
    `sub` as they write (the service tier a reply names is the priority applied, the request's headers' included:
    `Gateway.serve` adds them to `sub` after the body is decoded)."""

    sub: Submit
    stream: bool
    reply: Callable[[Result], dict[str, Any]]
    events: Events
    # a stream that fails before its first token, as the API's own events (Responses' `response.failed`, which Codex
    # reads for a context overflow, and compacts), or None: an HTTP error status
    failed: Callable[[str, str], bytes] | None = None  # (error code as the API names it, message)


@dataclass(frozen=True)
class Dialect:
    api: str  # the field policy's name (gateway/fields.py) and the metrics' label
    errors: Errors
    stream_error: Callable[[str, str, Overflow | None], bytes]  # (message, code, a context overflow's numbers)
    decode: Callable[[dict[str, Any], str, Policy, str, Images], Call]  # (body, request id, policy, model name, images)
    hint_headers: tuple[str, ...] = ()  # request headers that are hints: counted like fields


def _chat(raw: dict[str, Any], rid: str, policy: Policy, model: str, images: Images) -> Call:
    named = raw.get("service_tier") is not None  # (OpenAI's reply names the tier applied when the request names one)
    sub, stream, include_usage = openai_chat.chat_submit(raw, rid, policy, images)
    return _openai_call(sub, stream, include_usage, rid, model, chat=True, named_tier=named)


def _completions(raw: dict[str, Any], rid: str, policy: Policy, model: str, images: Images) -> Call:
    sub, stream, include_usage = openai_chat.completion_submit(raw, rid, policy)
    return _openai_call(sub, stream, include_usage, rid, model, chat=False)


def _openai_call(
    sub: Submit, stream: bool, include_usage: bool, rid: str, model: str, *, chat: bool, named_tier: bool = False
) -> Call:
    created, logprobs = openai_chat.now(), sub.sampling.logprobs is not None

    def tier() -> str | None:
        return normalise.service_tier(sub) if named_tier else None

    make = openai_chat.chat_body if chat else openai_chat.completion_body
    return Call(
        sub,
        stream,
        lambda r: make(r, model, created, logprobs, tier()),
        lambda msgs: openai_chat.openai_events(
            msgs, chat=chat, rid=rid, model=model, created=created, include_usage=include_usage, logprobs=logprobs,
            service_tier=tier(),
        ),
    )  # fmt: skip


def _responses(raw: dict[str, Any], rid: str, policy: Policy, model: str, images: Images) -> Call:
    sub, stream, asked = responses.responses_submit(raw, rid, policy, images)
    created, logprobs = responses.now(), sub.sampling.logprobs is not None

    def tier() -> str | None:
        return normalise.service_tier(sub) if asked.body.service_tier is not None else None

    return Call(
        sub,
        stream,
        lambda r: responses.response_body(r, rid, model, asked, created, logprobs, tier()),
        lambda msgs: responses.response_events(msgs, rid, model, asked, created, tier()),
        lambda code, message: responses.failed_events(rid, model, asked, created, code, message, tier()),
    )


def _messages(raw: dict[str, Any], rid: str, policy: Policy, model: str, images: Images) -> Call:
    sub, asked = anthropic.messages_request(raw, rid, policy, images)
    return Call(
        sub,
        asked.stream,
        lambda r: anthropic.message_body(r, model, asked.omit_thinking),
        lambda msgs: anthropic.message_events(msgs, rid, model, asked.omit_thinking),
    )


CHAT = Dialect("chat", OPENAI_ERRORS, chat_stream_error, _chat)
COMPLETIONS = Dialect("completions", OPENAI_ERRORS, chat_stream_error, _completions)
RESPONSES = Dialect("responses", OPENAI_ERRORS, responses_stream_error, _responses)
MESSAGES = Dialect("messages", ANTHROPIC_ERRORS, messages_stream_error, _messages, hint_headers=HINT_HEADERS["messages"])
