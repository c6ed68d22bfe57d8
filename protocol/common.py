"""Pieces shared by both sockets: version, error codes, sampling, usage, timings, token packing."""

from __future__ import annotations

import enum
import functools
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

PROTOCOL_VERSION = 1
"""Integer major version carried as `v` in every message; see PROTOCOL.md, "Versioning"."""

MAX_FRAME_BYTES = 8 * 1024 * 1024
"""Default cap on one message frame; larger frames get `too_large` without being decoded."""

MAX_STATE_BYTES = 256 * 1024 * 1024
"""The largest saved state copied between workers (`state_copy`, `job.state`); a frame between router and workers may
be this much larger than MAX_FRAME_BYTES."""

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
    PREEMPTED = "preempted"  # worker to router: a job handed back, before its first token, for one of higher priority
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
SessionId = Annotated[str, Meta(min_length=1, max_length=256)]
Priority = Annotated[int, Meta(ge=-1, le=1)]  # 1 interactive, 0 normal, -1 background
NonNegFloat = Annotated[float, Meta(ge=0.0)]
TokenBytes = bytes
"""Token ids as little-endian int32, packed back to back (msgpack `bin`)."""


# The bounds of each sampling field, in one place: `Sampling` (the wire) decodes with them, and the gateway's request
# types read the same ones for each API's fields (temperature aside: each API has its own range, gateway/). The router
# checks an operator's defaults against `Sampling`'s (router/sampling_defaults.py).
MaxTokens = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopK = NonNeg  # 0 = off
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=0, le=2**32 - 2)]
LogitBias = dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # presence_penalty, frequency_penalty
RepeatPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
RepeatLastN = Annotated[int, Meta(ge=-1)]  # -1 = all generated
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]

# Where each default of `max_tokens` is decided (what a request that sets no output cap may generate), in one place:
DEFAULT_MAX_TOKENS = 256
"""A protocol `submit` (or `job`) whose `sampling` leaves `max_tokens` out; `nil` sent explicitly is no limit."""
COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's legacy Completions API (`/v1/completions`) without `max_tokens`: OpenAI's documented default (gateway/)."""
OPEN_MAX_TOKENS = 8192
"""A request that asks for no limit (`max_tokens` nil: Chat's without max_tokens, Responses' without
max_output_tokens) gets at most this many when its slot has more room: the router's `--default-max-tokens` default
(0 there: until the slot's context is full, llama-server's). `--max-tokens` (default 0: none) caps every request."""


class Sampling(Struct, kw_only=True):
    """How to pick tokens and when to stop. Defaults follow the OpenAI API."""

    max_tokens: MaxTokens | None = DEFAULT_MAX_TOKENS  # None: until the slot's context is full
    temperature: Temperature = 1.0
    top_k: TopK = 0  # 0 = off
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Seed | None = None  # None = random
    logit_bias: LogitBias = {}
    stop: list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LEN)]] = []
    ignore_eos: bool = False
    # penalties over the generated tokens (llama.cpp's formulas): 0 / 1 = off
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repeat_penalty: RepeatPenalty = 1.0
    repeat_last_n: RepeatLastN = 64  # tokens the penalties look back over; -1 = all generated
    logprobs: TopLogprobs | None = None  # None: none; k: each token's logprob and the top k

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


@functools.cache
def sampling_bounds(name: str) -> tuple[float | None, float | None, bool]:
    """The values `Sampling.<name>` (a number) takes, read from its type above: (the lowest, the highest, whether the
    lowest is itself left out); None where there is no bound. What checks an operator's default reads it."""
    struct = msgspec.inspect.type_info(Sampling)
    assert isinstance(struct, msgspec.inspect.StructType)
    (info,) = [f for f in struct.fields if f.name == name]
    kind = info.type
    if isinstance(kind, msgspec.inspect.UnionType):  # (`X | None`)
        kind = next(t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType))
    assert isinstance(kind, msgspec.inspect.IntType | msgspec.inspect.FloatType), name
    return (kind.gt if kind.ge is None else kind.ge), kind.le, kind.ge is None and kind.gt is not None


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


def fits(prompt_tokens: int, max_tokens: int | None, context: int) -> bool:
    """Whether a prompt and its max_tokens fit a slot of `context` tokens (without max_tokens, one token at least): the
    one rule of the router (before a request is queued, and --context-shift's) and of a worker (before any work)."""
    return prompt_tokens < context and prompt_tokens + (max_tokens or 0) <= context


class Overflow(Struct, kw_only=True):
    """A `context_overflow`'s numbers, so that each API words its own message from them (Anthropic's clients read
    "prompt is too long: N tokens > M maximum")."""

    prompt_tokens: NonNeg
    max_tokens: NonNeg | None = None  # what the request asked to generate, when it asked
    context: NonNeg  # the largest slot's context, in tokens

    @classmethod
    def of(cls, prompt_tokens: int, max_tokens: int | None, context: int) -> Overflow | None:
        """The numbers of a prompt that does not fit a slot of `context` tokens (`fits`), or None when it fits."""
        if fits(prompt_tokens, max_tokens, context):
            return None
        return cls(prompt_tokens=prompt_tokens, max_tokens=max_tokens, context=context)

    def message(self, shifted: str = "") -> str:
        """Its words, made from its numbers, as the router says them (the largest slot of its workers); `shifted`:
        what --context-shift dropped, when it tried."""
        asked = "" if self.max_tokens is None else f" + max_tokens {self.max_tokens}"
        return f"prompt of {self.prompt_tokens} tokens{shifted}{asked} does not fit a slot of {self.context} tokens"

    def slot_message(self) -> str:
        """Its words, made from its numbers, as a worker says them (its own slot's context, and the sum that is over)."""
        n, mt, ctx = self.prompt_tokens, self.max_tokens, self.context
        if n >= ctx or mt is None:
            return f"prompt of {n} tokens does not fit a slot's context of {ctx} tokens"
        return f"prompt of {n} tokens + max_tokens {mt} = {n + mt} is over a slot's context of {ctx} tokens"


class Timings(Struct, kw_only=True):
    """Milliseconds spent in each phase of one request."""

    queue_ms: NonNegFloat = 0.0  # waiting for a slot (router queue + worker queue)
    prefill_ms: NonNegFloat = 0.0  # from first prefill step to first sampled token
    decode_ms: NonNegFloat = 0.0  # from first sampled token to the end
    ttft_ms: NonNegFloat = 0.0  # from arrival to first token
    total_ms: NonNegFloat = 0.0
