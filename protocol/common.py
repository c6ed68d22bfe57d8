"""Pieces shared by both sockets: version, error codes, sampling, usage, timings, token packing."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 1
"""Integer major version carried as `v` in every message; see PROTOCOL.md, "Versioning"."""

MAX_FRAME_BYTES = 8 * 1024 * 1024
"""Default cap on one message frame; larger frames get `too_large` without being decoded."""

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256

MAX_DEADLINE_MS = 2**31 - 1
"""Largest `deadline_ms` (about 24.8 days): an int32 in every language, and far from any clock overflow."""
DeadlineMs = Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)]


class ErrorCode(enum.StrEnum):
    """Stable error codes. Clients may switch on these; the message text is for humans."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    TOO_LARGE = "too_large"
    CONTEXT_OVERFLOW = "context_overflow"
    QUEUE_FULL = "queue_full"
    NO_WORKERS = "no_workers"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"
    MODEL_MISMATCH = "model_mismatch"
    DRAINING = "draining"
    UNAUTHORIZED = "unauthorized"
    TOO_SLOW = "too_slow"  # client side: the reader fell too far behind its replies; the request was cancelled
    SLOT_BUSY = "slot_busy"  # worker to router: another router's job holds the slot named (placed again, retryable)
    ROUTER_LOST = "router_lost"  # client side: its router's connection dropped after the request's output began
    REPLY_UNREACHABLE = "reply_unreachable"  # client side: the worker placed to run it never reached its reply_to


class FinishReason(enum.StrEnum):
    """Why a generation ended."""

    STOP = "stop"  # end-of-generation token, a stop string, or the end of what a grammar allows
    LENGTH = "length"  # max_tokens reached, or the slot's context is full
    TOOL_CALLS = "tool_calls"  # the reply ended with tool calls (set by the router, which parses them)
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"


class Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base for nested (untagged) structures."""


class Message(Struct, tag_field="type"):
    """Base for every top-level message: a `type` tag and the protocol version `v`."""

    v: int = PROTOCOL_VERSION


NonNeg = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
TokenBytes = bytes
"""Token ids as little-endian int32, packed back to back (msgpack `bin`)."""


class Sampling(Struct, kw_only=True):
    """How to pick tokens and when to stop. Defaults follow the OpenAI API."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = 256  # None: until the slot's context is full
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_k: NonNeg = 0  # 0 = off
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=2**32 - 2)] | None = None  # None = random
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] = {}
    stop: list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LEN)]] = []
    ignore_eos: bool = False
    # penalties over the generated tokens (llama.cpp's formulas): 0 / 1 = off
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repeat_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    repeat_last_n: Annotated[int, Meta(ge=-1)] = 64  # tokens the penalties look back over; -1 = all generated
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # None: none; k: each token's logprob and the top k

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0) and self.repeat_last_n != 0

    def __post_init__(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for key in self.logit_bias:
            # isascii: str.isdigit() also accepts digits like "²" that int() refuses
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise ValueError(f"logit_bias keys are token ids as decimal strings, got {key!r}")

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in self.logit_bias.items()}


# the sampling fields a server may default for requests that leave them out (the router's: its flags, else the model's
# GGUF general.sampling.*, else llama-server's)
Defaultable = Literal["temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n"]
DEFAULTABLE: tuple[Defaultable, ...] = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n")


def sampling_of(fields: dict[str, Any]) -> tuple[Sampling, list[Defaultable]]:
    """A request's `Sampling` from the fields it set, by `Sampling`'s names (None: not set), and the DEFAULTABLE ones it
    left to the server (Submit.sampling_unset). A field not set gets `Sampling`'s value, except `max_tokens`, which
    is taken as given (None: no limit). Raises msgspec.ValidationError (naming the field) or ValueError."""
    given = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    return msgspec.convert(given, Sampling), [k for k in DEFAULTABLE if fields.get(k) is None]


class Usage(Struct, kw_only=True, omit_defaults=True):
    """Token counts of one request."""

    prompt_tokens: NonNeg
    cached_tokens: NonNeg  # prompt tokens whose KV was reused, not computed
    completion_tokens: NonNeg
    reasoning_tokens: NonNeg = 0  # of the completion tokens, those of the model's thinking (its tags included)


class Overflow(Struct, kw_only=True):
    """A `context_overflow`'s numbers, so that each API words its own message from them (Anthropic's clients read
    "prompt is too long: N tokens > M maximum")."""

    prompt_tokens: NonNeg
    max_tokens: NonNeg | None = None  # what the request asked to generate, when it asked
    context: NonNeg  # the largest slot's context, in tokens


class Timings(Struct, kw_only=True):
    """Milliseconds spent in each phase of one request."""

    queue_ms: NonNegFloat = 0.0  # waiting for a slot (router queue + worker queue)
    prefill_ms: NonNegFloat = 0.0  # from first prefill step to first sampled token
    decode_ms: NonNegFloat = 0.0  # from first sampled token to the end
    ttft_ms: NonNegFloat = 0.0  # from arrival to first token
    total_ms: NonNegFloat = 0.0
