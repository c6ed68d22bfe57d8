"""Messages between clients and the router's client socket (ROUTER, bound; clients connect DEALER)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol.common import DeadlineMs, Message, Sampling, Struct, Timings, TokenBytes, Usage, check_token_bytes

RequestId = Annotated[str, Meta(min_length=1, max_length=128)]


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


# ---- client -> router -------------------------------------------------------------------------


class Submit(Message, tag="submit", kw_only=True):
    """Start a generation. Exactly one of `prompt`, `messages`, `tokens` is set."""

    id: RequestId | None = None  # client's id, echoed on every reply; the router assigns one if absent
    prompt: str | None = None  # raw text, tokenized as is (BOS added by the model's rule)
    messages: list[ChatMessage] | None = None  # chat, rendered with the router's chat format
    tokens: TokenBytes | None = None  # token ids, used as given
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    stream: bool = True  # send `delta` messages; the `result` comes either way
    deadline_ms: DeadlineMs | None = None  # relative to the router's receipt

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.tokens))
        if given != 1:
            raise ValueError(f"exactly one of prompt, messages, tokens must be set, got {given}")
        check_token_bytes("tokens", self.tokens, empty_ok=False)
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")


class Cancel(Message, tag="cancel", kw_only=True):
    """Stop a request this client submitted. Its `result` follows with finish_reason `cancelled`."""

    id: RequestId


class StatusRequest(Message, tag="status", kw_only=True):
    """Ask for the router's view of workers and slots."""

    id: RequestId | None = None


ClientRequest = Submit | Cancel | StatusRequest


# ---- router -> client -------------------------------------------------------------------------


class Delta(Message, tag="delta", kw_only=True):
    """New generated text. `text` is valid UTF-8; a token may carry an empty string until its bytes complete."""

    id: RequestId
    text: str
    tokens: TokenBytes

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class Result(Message, tag="result", kw_only=True):
    """The end of a request: always the last message for its id (unless an `error` is)."""

    id: RequestId
    finish_reason: str
    text: str  # the whole generated text (stop string excluded)
    tokens: TokenBytes  # every generated token id
    usage: Usage
    timings: Timings
    worker: str = ""
    slot: int = -1
    stop: str | None = None  # the stop string that ended it, if any

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class Error(Message, tag="error", kw_only=True):
    """A request failed, or a frame could not be served. `id` is null when no id could be read."""

    id: str | None = None
    code: str
    message: str
    error_id: str | None = None  # unique id for `internal` errors, also in the logs
    retry_after_ms: int | None = None  # set with `queue_full`


class SlotStatus(Struct, kw_only=True):
    slot: int
    busy: bool
    n_tokens: int  # tokens whose KV the slot holds
    request_id: str | None = None
    reused_total: int = 0  # tokens reused on this slot so far
    last_used_s: float = 0.0  # seconds since the slot last finished a job


class WorkerStatus(Struct, kw_only=True):
    worker: str
    incarnation: int
    device: str
    state: str  # "ready", "draining"
    queue: int
    slots: list[SlotStatus]
    restarts: int = 0


class StatusReply(Message, tag="status_reply", kw_only=True):
    id: str | None = None
    model: str
    policy: str
    queued: int
    workers: list[WorkerStatus]


RouterReply = Delta | Result | Error | StatusReply
