"""Errors as each API gives them, in one place: the table from the protocol's error code, or an error the gateway makes
itself (`OWN`: a refused body, a Host, a key, a body's size or time), to each API's HTTP status and error type, each API
family's error body, and an error in the middle of each API's stream. A context overflow's words
for Anthropic's clients are made from its numbers (protocol `Overflow`), never read back from the router's English.

OpenAI's body is `{"error": {message, type, param, code}}`; Anthropic's `{"type": "error", "error": {type, message}}`
(no `param`: the message names the field). Anthropic's 529 is its "overloaded", which its SDKs retry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.responses import JSONResponse

from gateway.replies import sse
from protocol import ErrorCode, Overflow


class RequestError(Exception):
    """A request the gateway refuses itself (no protocol code): its `kind` (a row of `OWN`: the HTTP status and each
    family's error type), the field it names (`param`) and the body's `code`."""

    def __init__(self, message: str, *, param: str | None = None, kind: str = "bad_request", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.kind, self.code = message, param, kind, code

    @property
    def status(self) -> int:
        """Its HTTP status (the same in both families)."""
        return OWN[self.kind].openai[0]


@dataclass(frozen=True)
class Kind:
    """What one error (a protocol error code, or one the gateway makes: `OWN`) is in each API family: (HTTP status,
    error type)."""

    openai: tuple[int, str]
    anthropic: tuple[int, str]


UNAVAILABLE = Kind((503, "service_unavailable"), (529, "overloaded_error"))
TABLE: dict[str, Kind] = {
    ErrorCode.BAD_REQUEST: Kind((400, "invalid_request_error"), (400, "invalid_request_error")),
    ErrorCode.CONTEXT_OVERFLOW: Kind((400, "invalid_request_error"), (400, "invalid_request_error")),
    ErrorCode.TOO_LARGE: Kind((413, "invalid_request_error"), (413, "request_too_large")),
    ErrorCode.UNAUTHORIZED: Kind((401, "authentication_error"), (401, "authentication_error")),
    ErrorCode.NOT_FOUND: Kind((404, "invalid_request_error"), (404, "not_found_error")),
    ErrorCode.QUEUE_FULL: Kind((429, "rate_limit_error"), (429, "rate_limit_error")),
    ErrorCode.NO_WORKERS: UNAVAILABLE,
    ErrorCode.WORKER_LOST: UNAVAILABLE,
    ErrorCode.ROUTER_LOST: UNAVAILABLE,
    ErrorCode.REPLY_UNREACHABLE: UNAVAILABLE,
    ErrorCode.DRAINING: UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: Kind((504, "timeout"), (504, "timeout_error")),
    ErrorCode.TOO_SLOW: Kind((408, "timeout"), (408, "timeout_error")),
    ErrorCode.CANCELLED: Kind((499, "cancelled"), (500, "api_error")),
}
INTERNAL = Kind((500, "internal_error"), (500, "api_error"))

# errors the gateway makes itself (no protocol code), by kind: a row of TABLE where one is the same error, else its own
OWN: dict[str, Kind] = {
    "bad_request": TABLE[ErrorCode.BAD_REQUEST],  # a body it cannot serve (RequestError's default)
    "auth": TABLE[ErrorCode.UNAUTHORIZED],  # a missing or wrong API key
    "host": Kind((403, "invalid_request_error"), (403, "permission_error")),  # a Host this server does not answer to
    "not_found": TABLE[ErrorCode.NOT_FOUND],  # a model this server does not serve (--strict-model-name)
    "body_timeout": Kind((408, "invalid_request_error"), (408, "invalid_request_error")),  # a body slower than allowed
    "too_large": TABLE[ErrorCode.TOO_LARGE],  # a body over --max-body-bytes (by its Content-Length, or as it is read)
    "not_json": Kind((415, "invalid_request_error"), (415, "invalid_request_error")),  # a POST body that is not JSON
    "timeout": TABLE[ErrorCode.DEADLINE_EXCEEDED],  # a wait on the router given up
    "internal": INTERNAL,
}


def prompt_too_long(o: Overflow) -> str:
    """Anthropic's words for a context overflow, which Claude Code recognizes and answers by compacting."""
    return f"prompt is too long: {o.prompt_tokens + (o.max_tokens or 0)} tokens > {o.context} maximum"


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's error code for a context overflow, which its clients (Codex: then it compacts) and many others match."""


def maximum_context_length(o: Overflow, detail: str) -> str:
    """OpenAI's words for a context overflow ("maximum context length", which clients match), then the router's."""
    asked = o.prompt_tokens + (o.max_tokens or 0)
    return (
        f"This model's maximum context length is {o.context} tokens. However, you requested {asked} tokens "
        f"({o.prompt_tokens} in the messages, {o.max_tokens or 0} in the completion). Please reduce the length of the "
        f"messages or completion. ({detail})"
    )


@dataclass(frozen=True)
class Errors:
    """An API family's errors: OpenAI's or Anthropic's."""

    anthropic: bool

    def status_of(self, code: str) -> tuple[int, str]:
        """A protocol error code's (HTTP status, error type)."""
        kind = TABLE.get(code, INTERNAL)
        return kind.anthropic if self.anthropic else kind.openai

    def message(self, message: str, code: str, overflow: Overflow | None = None) -> str:
        """What a client of this family reads: the router's words, or the family's own for a context overflow."""
        if code == ErrorCode.CONTEXT_OVERFLOW and overflow is not None:
            return prompt_too_long(overflow) if self.anthropic else maximum_context_length(overflow, message)
        return message

    def code(self, code: str) -> str:
        """A protocol error code as this family's bodies name it (OpenAI's own code for a context overflow)."""
        return CONTEXT_LENGTH_EXCEEDED if code == ErrorCode.CONTEXT_OVERFLOW and not self.anthropic else code

    def body(self, message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, object]:
        if self.anthropic:
            return {"type": "error", "error": {"type": type_, "message": message}}
        return {"error": {"message": message, "type": type_, "param": param, "code": code}}

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
        return JSONResponse(self.body(message, type_, code, param), status, headers=headers)

    def of(self, kind: str, message: str, *, code: str | None = None, param: str | None = None) -> JSONResponse:
        """An error the gateway makes itself, of a kind in `OWN`: its status and this family's type and words."""
        status, type_ = OWN[kind].anthropic if self.anthropic else OWN[kind].openai
        return self.response(message, status, type_=type_, code=code, param=param)


OPENAI_ERRORS = Errors(anthropic=False)
ANTHROPIC_ERRORS = Errors(anthropic=True)


def errors_for(path: str) -> Errors:
    """The error shape of the API a path belongs to (the one place that decides it)."""
    return ANTHROPIC_ERRORS if path.startswith("/v1/messages") else OPENAI_ERRORS


# ---- an error in the middle of a stream, and the end of it: one for each API's events ----


def chat_stream_error(message: str, code: str, overflow: Overflow | None = None) -> bytes:
    """Chat Completions and Completions: an `error` chunk, then `[DONE]`."""
    errors = OPENAI_ERRORS
    body = errors.body(errors.message(message, code, overflow), errors.status_of(code)[1], errors.code(code))
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def responses_stream_error(message: str, code: str, overflow: Overflow | None = None) -> bytes:
    """Responses: an `error` event."""
    errors = OPENAI_ERRORS
    data = {"type": "error", "code": errors.code(code), "message": errors.message(message, code, overflow), "param": None}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def messages_stream_error(message: str, code: str, overflow: Overflow | None = None) -> bytes:
    """Anthropic Messages: an `error` event."""
    errors = ANTHROPIC_ERRORS
    return sse("error", errors.body(errors.message(message, code, overflow), errors.status_of(code)[1]))
