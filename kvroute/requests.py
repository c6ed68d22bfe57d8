"""What both clients send, made the same way: a `submit` from keyword arguments, any message as a frame checked
against the frame cap, and the DEALER socket to a router (CURVE when keys are given)."""

from __future__ import annotations

import os
import uuid
from typing import Any

import msgspec
import zmq

from common.socket_security import secure_client_socket
from kvroute.errors import BadRequest, TooLarge
from protocol import ChatMessage, Sampling, Submit, encode, pack_tokens, sampling_of

DEFAULT_ENDPOINT = os.environ.get("KVROUTE_ENDPOINT", "tcp://127.0.0.1:5555")


def dealer(ctx: Any, endpoint: str, curve: tuple[str | None, str | None]) -> Any:
    """A DEALER socket of `ctx` (zmq's or zmq.asyncio's) connected to a router: no linger, CURVE with `curve`'s
    (this client's key file, the router's public key file) when given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client_socket(sock, *curve)
    sock.connect(endpoint)
    return sock


def encode_checked(msg: Any, max_frame_bytes: int) -> bytes:
    """The message's frame; TooLarge when it is over the cap (checked here: far over it, the router would drop
    the connection, taking every other request on the socket with it), BadRequest when a string in it is not Unicode
    msgpack can carry (a lone surrogate, which JSON's `\\ud800` escape makes) or an integer is outside its range."""
    try:
        frame = encode(msg)
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end] if isinstance(exc.object, str) else ""
        raise BadRequest(
            f"a string of this request holds {bad.encode('unicode_escape').decode()!r}, which is not a character (a lone"
            " UTF-16 surrogate): send text as UTF-8",
            request_id=getattr(msg, "id", None),
        ) from None
    except OverflowError:  # (JSON integers have no bound; msgpack's go from -2^63 to 2^64 - 1)
        raise BadRequest(
            "an integer of this request is outside -2^63 .. 2^64 - 1, which the protocol (msgpack) cannot carry",
            request_id=getattr(msg, "id", None),
        ) from None
    if len(frame) > max_frame_bytes:
        raise TooLarge(
            f"request of {len(frame)} bytes is over the {max_frame_bytes}-byte frame cap; send less",
            request_id=getattr(msg, "id", None),
        )
    return frame


# the Submit fields a caller may give beside the prompt and sampling
SUBMIT_FIELDS = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "grammar",
    "chat_template_kwargs",
    "n",
    "cache_salt",
    "model",
    "keep_alive_s",
    "session",  # hints (PROTOCOL.md `submit`): the conversation or agent session this request continues,
    "parent_session",  # the session of the agent that started it (a sub-agent's),
    "priority",  # 1 interactive, 0 normal, -1 background
)


def build_submit(
    *,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | list[ChatMessage] | None = None,
    tokens: list[int] | None = None,
    stream: bool = True,
    deadline_ms: int | None = None,
    request_id: str | None = None,
    **kwargs: Any,
) -> Submit:
    """A `submit` from keyword arguments: those of protocol.Submit (tools, tool_choice, response_format, grammar,
    n, session, parent_session, priority, ...; as dicts or structs) and of protocol.Sampling (temperature, max_tokens,
    logprobs, ...). Sampling fields not given are the router's to default (--temp, --seed, ...), as for an HTTP request
    that leaves them out."""
    extra = {k: kwargs.pop(k) for k in SUBMIT_FIELDS if k in kwargs}
    try:
        params, unset = sampling_of({"max_tokens": Sampling().max_tokens, **kwargs})
        return msgspec.convert(
            {
                **msgspec.to_builtins(extra),
                "id": request_id or uuid.uuid4().hex[:16],
                "prompt": prompt,
                "messages": None if messages is None else msgspec.to_builtins(messages),
                "tokens": None if tokens is None else pack_tokens(tokens),
                "sampling": params,
                "sampling_unset": unset,
                "stream": stream,
                "deadline_ms": deadline_ms,
            },
            Submit,
            from_attributes=True,
        )
    except (msgspec.ValidationError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
