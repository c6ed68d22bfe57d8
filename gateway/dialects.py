"""Each generating HTTP API as a dialect that `Gateway.serve` runs the same way: a body decoded into a protocol
`Submit` under the API's field policy (gateway/fields.py), the reply's body and stream events, and the API's
error shapes (an HTTP error body, an error in the middle of a stream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from gateway import anthropic, openai_chat, responses
from gateway.fields import Policy
from gateway.keepalive import Tick
from protocol import Delta, ErrorCode, Result, Submit

Events = Callable[[AsyncIterator[Delta | Result | Tick]], AsyncIterator[bytes]]

# protocol error code -> (HTTP status, OpenAI error type)
OPENAI_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    ErrorCode.CONTEXT_OVERFLOW: (400, "invalid_request_error"),
    ErrorCode.TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.QUEUE_FULL: (429, "rate_limit_error"),
    ErrorCode.NO_WORKERS: (503, "service_unavailable"),
    ErrorCode.WORKER_LOST: (503, "service_unavailable"),
    ErrorCode.ROUTER_LOST: (503, "service_unavailable"),
    ErrorCode.REPLY_UNREACHABLE: (503, "service_unavailable"),
    ErrorCode.DRAINING: (503, "service_unavailable"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout"),
    ErrorCode.CANCELLED: (499, "cancelled"),
    ErrorCode.TOO_SLOW: (408, "timeout"),
}


@dataclass(frozen=True)
class Errors:
    """An API family's error body: OpenAI's (`{"error": {message, type, param, code}}`) or Anthropic's (`{"type":
    "error", "error": {type, message}}`, no `param`: the message names the field)."""

    anthropic: bool

    def status_of(self, code: str) -> tuple[int, str]:
        """A protocol error code's (HTTP status, error type)."""
        if self.anthropic:
            return anthropic.ERROR_TYPES.get(code, (500, "api_error"))
        return OPENAI_STATUS.get(code, (500, "internal_error"))

    def response(
        self,
        message: str,
        status: int,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        if self.anthropic:
            return JSONResponse(anthropic.error_body(message, type_), status, headers=headers)
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        return JSONResponse(body, status, headers=headers)

    def of(self, kind: str, message: str, status: int, code: str | None = None) -> JSONResponse:
        """An error of a kind both families have, in this family's words (`KINDS`)."""
        openai_type, anthropic_type = KINDS[kind]
        return self.response(message, status, type_=anthropic_type if self.anthropic else openai_type, code=code)


# an error kind -> (OpenAI's type, Anthropic's type)
KINDS = {
    "auth": ("authentication_error", "authentication_error"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "timeout": ("timeout", "timeout_error"),
    "internal": ("internal_error", "api_error"),
}
OPENAI_ERRORS = Errors(anthropic=False)
ANTHROPIC_ERRORS = Errors(anthropic=True)


def errors_for(path: str) -> Errors:
    """The error shape of the API a path belongs to (the one place that decides it)."""
    return ANTHROPIC_ERRORS if path.startswith("/v1/messages") else OPENAI_ERRORS


def openai_stream_error(message: str, code: str) -> bytes:
    """An error in the middle of a Chat Completions / Completions stream, and the end of it."""
    type_ = OPENAI_STATUS.get(code, (500, "internal_error"))[1]
    err = {"error": {"message": message, "type": type_, "code": code, "param": None}}
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


@dataclass
class Call:
    """One decoded request: its submit, whether it streams, and how its reply is written."""

    sub: Submit
    stream: bool
    reply: Callable[[Result], dict[str, Any]]
    events: Events


@dataclass(frozen=True)
class Dialect:
    api: str  # the field policy's name (gateway/fields.py) and the metrics' label
    errors: Errors
    stream_error: Callable[[str, str], bytes]
    decode: Callable[[dict[str, Any], str, Policy, str], Call]  # (body, request id, policy, model name)
    hint_headers: tuple[str, ...] = ()  # request headers that are hints: counted like fields


def _chat(raw: dict[str, Any], rid: str, policy: Policy, model: str) -> Call:
    sub, stream, include_usage = openai_chat.chat_submit(raw, rid, policy)
    return _openai_call(sub, stream, include_usage, rid, model, chat=True)


def _completions(raw: dict[str, Any], rid: str, policy: Policy, model: str) -> Call:
    sub, stream, include_usage = openai_chat.completion_submit(raw, rid, policy)
    return _openai_call(sub, stream, include_usage, rid, model, chat=False)


def _openai_call(sub: Submit, stream: bool, include_usage: bool, rid: str, model: str, *, chat: bool) -> Call:
    created, logprobs = openai_chat.now(), sub.sampling.logprobs is not None
    make = openai_chat.chat_body if chat else openai_chat.completion_body
    return Call(
        sub,
        stream,
        lambda r: make(r, model, created, logprobs),
        lambda msgs: openai_chat.openai_events(
            msgs, chat=chat, rid=rid, model=model, created=created, include_usage=include_usage, logprobs=logprobs
        ),
    )


def _responses(raw: dict[str, Any], rid: str, policy: Policy, model: str) -> Call:
    sub, stream, asked = responses.responses_submit(raw, rid, policy)
    created, logprobs = responses.now(), sub.sampling.logprobs is not None
    return Call(
        sub,
        stream,
        lambda r: responses.response_body(r, rid, model, asked, created, logprobs),
        lambda msgs: responses.response_events(msgs, rid, model, asked, created),
    )


def _messages(raw: dict[str, Any], rid: str, policy: Policy, model: str) -> Call:
    sub, stream = anthropic.messages_submit(raw, rid, policy)
    return Call(
        sub,
        stream,
        lambda r: anthropic.message_body(r, model),
        lambda msgs: anthropic.message_events(msgs, rid, model),
    )


CHAT = Dialect("chat", OPENAI_ERRORS, openai_stream_error, _chat)
COMPLETIONS = Dialect("completions", OPENAI_ERRORS, openai_stream_error, _completions)
RESPONSES = Dialect("responses", OPENAI_ERRORS, responses.error_event, _responses)
MESSAGES = Dialect("messages", ANTHROPIC_ERRORS, anthropic.error_event, _messages, hint_headers=("anthropic-beta",))
