"""A bare test client: one DEALER (or REQ) socket, raw frames in, decoded replies out."""

from __future__ import annotations

from typing import Any

import zmq

from protocol import Invalid, encode, router_reply_decoder


class RawClient:
    def __init__(self, endpoint: str, *, kind: int = zmq.DEALER) -> None:
        self.sock = zmq.Context.instance().socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.dec = router_reply_decoder()

    def send(self, msg: Any) -> None:
        self.sock.send(encode(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 10.0) -> Any:
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply in {timeout_s} s"
        msg = self.dec.decode(self.sock.recv())
        assert not isinstance(msg, Invalid), msg
        return msg

    def recv_until_end(self, rid: str, timeout_s: float = 60.0) -> tuple[list[Any], Any]:
        """(deltas, final result or error) for request `rid`; replies for other ids are ignored."""
        deltas = []
        while True:
            msg = self.recv(timeout_s)
            if getattr(msg, "id", None) != rid:
                continue
            if msg.__class__.__name__ == "Delta":
                deltas.append(msg)
            else:
                return deltas, msg

    def close(self) -> None:
        self.sock.close(0)
