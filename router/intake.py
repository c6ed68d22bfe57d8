"""A client's frames -> its messages, in the order it sent them, without the loop decoding a large one.

A frame over DECODE_INLINE_BYTES is decoded on a preparing thread (a 7 MB submit of 100,000 messages takes 50-100 ms
to decode; router/preparing.py shares the threads fairly, the client being the decode's owner); that client's next
frames wait behind it, so that a cancel right after its submit still finds it, up to
DECODING_MAX of them (one more is refused with `queue_full`). A frame the decoder cannot read becomes an `Invalid`
message (it names the problem, and the request id when it can be read), which the router answers as an error.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from protocol import Error, ErrorCode, Invalid, client_request_decoder
from router.admission import Busy
from router.metrics import Metrics

DECODE_INLINE_BYTES = 1 << 20  # a larger client frame is decoded on a preparing thread (10 ms a megabyte, and more)
DECODING_MAX = 64  # frames of one client kept waiting behind its large frame being decoded

Envelope = tuple[bytes, ...]


class ClientIntake:
    """`frames(...)` for each multipart message read from the client socket; each decoded message goes to
    `handle(identity, envelope, msg, size)` (`size`: its frame's bytes). `off_loop(identity, size, work, then)` runs
    `work` on a preparing thread and `then(its result or exception)` back on the loop; `reply(identity, envelope, msg)`
    answers a frame that is refused here."""

    def __init__(
        self,
        max_frame_bytes: int,
        handle: Callable[[bytes, Envelope, Any, int], None],
        off_loop: Callable[[bytes, int, Callable[[], Any], Callable[[Any], None]], None],
        reply: Callable[[bytes, Envelope, Any], None],
        metrics: Metrics,
    ) -> None:
        self.decoder = client_request_decoder(max_frame_bytes)
        self.handle, self.off_loop, self.reply, self.metrics = handle, off_loop, reply, metrics
        # clients with a large frame being decoded off the loop -> their frames that came after it, in order
        self._decoding: dict[bytes, collections.deque[tuple[Envelope, bytes]]] = {}

    def frames(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        envelope: Envelope
        if len(rest) == 2 and rest[0] == b"":
            envelope, payload = (b"",), rest[1]
        elif len(rest) == 1:
            envelope, payload = (), rest[0]
        else:
            self.metrics.bad_frames += 1
            message = f"expected one message frame, got {len(rest)}"
            self.reply(identity, (), Error(code=ErrorCode.BAD_REQUEST, message=message))
            return
        waiting = self._decoding.get(identity)
        if waiting is not None:  # (behind a large frame of the same client being decoded: its order is kept)
            if len(waiting) >= DECODING_MAX:
                self._too_many_large(identity, envelope, payload)
            else:
                waiting.append((envelope, payload))
        elif len(payload) > DECODE_INLINE_BYTES:
            self._decoding[identity] = collections.deque()
            self._decode_off_loop(identity, envelope, payload)
        else:
            self.handle(identity, envelope, self.decoder.decode(payload), len(payload))

    def _decode_off_loop(self, identity: bytes, envelope: Envelope, payload: bytes) -> None:
        def then(msg: Any) -> None:
            if isinstance(msg, Busy):  # (no preparing thread for it: the client is told to come back)
                self.reply(identity, envelope, msg.refusal.error(self.decoder.request_id(payload)))
            elif isinstance(msg, BaseException):  # (the decoder answers Invalid for anything it cannot read)
                self.handle(identity, envelope, Invalid(ErrorCode.INTERNAL, f"frame could not be decoded: {msg!r}"), len(payload))
            else:
                self.handle(identity, envelope, msg, len(payload))
            waiting = self._decoding.get(identity)
            while waiting:
                env, frame = waiting.popleft()
                if len(frame) > DECODE_INLINE_BYTES:
                    self._decode_off_loop(identity, env, frame)
                    return
                self.handle(identity, env, self.decoder.decode(frame), len(frame))
            self._decoding.pop(identity, None)

        self.off_loop(identity, len(payload), lambda: self.decoder.decode(payload), then)

    def _too_many_large(self, identity: bytes, envelope: Envelope, payload: bytes) -> None:
        self.metrics.requests[ErrorCode.QUEUE_FULL] += 1
        rid = self.decoder.request_id(payload)
        text = f"{DECODING_MAX} frames of this client already wait behind a large one being decoded"
        self.reply(identity, envelope, Error(id=rid, code=ErrorCode.QUEUE_FULL, message=text, retry_after_ms=1000))
