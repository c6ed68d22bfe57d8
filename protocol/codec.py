"""Encoding and total decoding: every decoder returns a message or an `Invalid`, never raises."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
import msgspec

from protocol.client_messages import ClientRequest, Error, RouterReply
from protocol.common import MAX_FRAME_BYTES, MAX_STATE_BYTES, PROTOCOL_VERSION, ErrorCode, Message
from protocol.worker_messages import JobDelta, JobDeltas, JobDone, JobStart, RouterToWorker, WorkerToRouter

DirectReply = JobStart | JobDelta | JobDeltas | JobDone | Error  # what a client's reply_to receives from workers

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


def kind_of(msg: Any) -> str:
    """A message's `type` on the wire (its tag); the class name for anything else."""
    config = getattr(type(msg), "__struct_config__", None)
    tag = getattr(config, "tag", None)
    return tag if isinstance(tag, str) else type(msg).__name__


def encode(msg: Message) -> bytes:
    """A message -> one msgpack frame."""
    return _encoder.encode(msg)


@dataclass(frozen=True, slots=True)
class Invalid:
    """Why a frame was refused. `id` is the request id when one could be read."""

    code: ErrorCode
    reason: str
    id: str | None = None


class Decoder(Generic[M]):
    """Decodes the union of messages that one socket may receive.

    `decode(frame)` returns a message of the union or an `Invalid` naming the problem: frame over the
    size cap, bytes that are not msgpack, not a map, missing/ill-typed `v` or `type`, a version other
    than PROTOCOL_VERSION, a type this socket does not take, or a missing/ill-typed field (with its path).
    """

    def __init__(self, union: Any, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_bytes = max_bytes
        self.by_tag: dict[str, type[M]] = {cls.__struct_config__.tag: cls for cls in typing.get_args(union)}
        self._raw = msgspec.msgpack.Decoder()
        self._head = msgspec.msgpack.Decoder(_Head)
        self._typed = msgspec.msgpack.Decoder(union)

    def request_id(self, frame: bytes | memoryview) -> str | None:
        """The frame's request id, read without decoding the rest (None when it has none that can be read)."""
        return _request_id(frame)

    def _fast(self, frame: bytes | memoryview) -> M | None:
        """A frame with the right `v` and a known `type`, decoded in one pass (a 7 MB submit: 50 ms, where the two
        passes below take 300 ms); None for anything else, which the two passes then explain."""
        try:
            head = self._head.decode(frame)
            if type(head.v) is not int or head.v != PROTOCOL_VERSION or head.type not in self.by_tag:
                return None
            msg: M = self._typed.decode(frame)
        except Exception:  # (validation, recursion, anything: the slow path says what)
            return None
        return msg

    @property
    def types(self) -> list[str]:
        return sorted(self.by_tag)

    def decode(self, frame: bytes | memoryview) -> M | Invalid:
        if len(frame) > self.max_bytes:
            reason = f"frame of {len(frame)} bytes is over the {self.max_bytes}-byte cap"
            return Invalid(ErrorCode.TOO_LARGE, reason, _request_id(frame))
        fast = self._fast(frame)
        if fast is not None:
            return fast
        try:
            raw = self._raw.decode(frame)
        except RecursionError:  # (msgspec follows nesting as deep as Python's stack allows)
            reason = "frame is not valid msgpack here: it nests values too deeply to be decoded"
            return Invalid(ErrorCode.BAD_REQUEST, reason, _request_id(frame))
        except Exception as exc:  # msgspec.DecodeError, or anything a hostile frame provokes
            return Invalid(ErrorCode.BAD_REQUEST, f"frame is not valid msgpack: {exc}")
        if not isinstance(raw, dict):
            return Invalid(ErrorCode.BAD_REQUEST, f"message must be a msgpack map, got {type(raw).__name__}")
        rid = raw.get("id")
        rid = rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None
        version = raw.get("v")
        if version is None:
            return Invalid(ErrorCode.BAD_REQUEST, "missing field `v` (protocol version)", rid)
        if type(version) is not int:
            return Invalid(ErrorCode.BAD_REQUEST, f"field `v` must be an integer, got {type(version).__name__}", rid)
        if version != PROTOCOL_VERSION:
            return Invalid(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})",
                rid,
            )
        tag = raw.get("type")
        if tag is None:
            return Invalid(ErrorCode.BAD_REQUEST, "missing field `type`", rid)
        if not isinstance(tag, str):
            return Invalid(ErrorCode.BAD_REQUEST, f"field `type` must be a string, got {type(tag).__name__}", rid)
        cls = self.by_tag.get(tag)
        if cls is None:
            return Invalid(ErrorCode.BAD_REQUEST, f"unknown message type {tag!r} here; expected one of {self.types}", rid)
        try:
            # builtin_types=(bytes,): a `bin` field takes msgpack bin only, not a str (convert would base64-decode it)
            return msgspec.convert(raw, cls, builtin_types=(bytes, bytearray))
        except msgspec.ValidationError as exc:
            return Invalid(ErrorCode.BAD_REQUEST, f"{tag}: {exc}", rid)
        except Exception as exc:  # a validator hit something unforeseen: still an answer, not a crash
            return Invalid(ErrorCode.BAD_REQUEST, f"{tag}: {type(exc).__name__}: {exc}", rid)


class _Head(msgspec.Struct):
    v: Any
    type: Any


class _OnlyId(msgspec.Struct):
    id: Any = None


_id_decoder = msgspec.msgpack.Decoder(_OnlyId)


def _request_id(frame: bytes | memoryview) -> str | None:
    """The `id` of a frame too large to decode, so that the refusal reaches the request that caused it: the
    other fields are skipped, not built (a 40 MB prompt costs a pointer move)."""
    try:
        rid = _id_decoder.decode(frame).id
    except Exception:  # (a value nested deeper than msgspec follows: the keys before it are read one by one)
        rid = _id_before_the_rest(frame)
    return rid if isinstance(rid, str) and 0 < len(rid) <= 128 else None


def _id_before_the_rest(frame: bytes | memoryview) -> Any:
    """The `id` of a map frame read key by key, each other value skipped without recursion (msgpack's unpacker has a
    stack of its own: a value nested too deeply is a StackError, not a crash); None if `id` is not found before."""
    unpacker = msgpack.Unpacker(max_buffer_size=len(frame))
    unpacker.feed(frame)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                return unpacker.unpack()
            unpacker.skip()
    except Exception:
        return None
    return None


def client_request_decoder(max_bytes: int = MAX_FRAME_BYTES) -> Decoder[Any]:
    """What the router's client socket receives."""
    return Decoder(ClientRequest, max_bytes)


def router_reply_decoder(max_bytes: int = MAX_FRAME_BYTES) -> Decoder[Any]:
    """What a client receives."""
    return Decoder(RouterReply, max_bytes)


def direct_reply_decoder(max_bytes: int = MAX_FRAME_BYTES) -> Decoder[Any]:
    """What a client's reply_to socket receives (direct replies)."""
    return Decoder(DirectReply, max_bytes)


def worker_to_router_decoder(max_bytes: int = MAX_FRAME_BYTES + MAX_STATE_BYTES) -> Decoder[Any]:
    """What the router's worker socket receives."""
    return Decoder(WorkerToRouter, max_bytes)


def router_to_worker_decoder(max_bytes: int = MAX_FRAME_BYTES + MAX_STATE_BYTES) -> Decoder[Any]:
    """What a worker receives."""
    return Decoder(RouterToWorker, max_bytes)
