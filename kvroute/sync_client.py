"""The synchronous client (`Client`) and the iterator of one request's deltas (`Stream`)."""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterator
from typing import Any

import zmq

from common import logs
from kvroute.errors import KvrouteError, error_from
from kvroute.requests import DEFAULT_ENDPOINT, build_submit, dealer, encode_checked
from protocol import (
    MAX_FRAME_BYTES,
    Cancel,
    Delta,
    Error,
    ErrorCode,
    Invalid,
    Result,
    StatusReply,
    StatusRequest,
    router_reply_decoder,
)

log = logs.get(__name__)


class Stream:
    """Iterates the deltas of one request; `result` is set once iteration ends."""

    def __init__(self, client: Client, request_id: str) -> None:
        self.client, self.id = client, request_id
        self.result: Result | None = None

    def __iter__(self) -> Iterator[Delta]:
        while True:
            msg = self.client._next_for(self.id)
            if isinstance(msg, Delta):
                yield msg
            elif isinstance(msg, Result):
                self.result = msg
                return

    def cancel(self) -> None:
        self.client.cancel(self.id)


class Client:
    """Synchronous client. Not thread safe: use one per thread."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout_s: float = 300.0,
        context: zmq.Context[Any] | None = None,
        curve_key: str | None = None,
        router_key: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        """`curve_key` (this client's key file) and `router_key` (the router's .pub): CURVE, see `kvroute keys`."""
        self.endpoint = endpoint
        self.curve = (curve_key, router_key)
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._waiting: set[str] = set()  # request ids whose final reply has not come
        self.ctx = context or zmq.Context.instance()
        self._decoder = router_reply_decoder()
        self._inbox: dict[str, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._sock: zmq.Socket[Any] = self._connect()

    def _connect(self) -> zmq.Socket[Any]:
        return dealer(self.ctx, self.endpoint, self.curve)

    def reconnect(self) -> None:
        """Drop the socket and every buffered reply, and connect afresh."""
        self._sock.close(0)
        self._inbox.clear()
        self._sock = self._connect()

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, msg: Any) -> None:
        self._sock.send(encode_checked(msg, self.max_frame_bytes))
        if not isinstance(msg, Cancel) and msg.id is not None:
            self._waiting.add(msg.id)

    def _next_for(self, request_id: str) -> Any:
        """Next reply for `request_id`, buffering replies for other ids. Raises on error or timeout."""
        box = self._inbox[request_id]
        deadline = time.monotonic() + self.timeout_s
        while not box:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    self.reconnect()
                    raise TimeoutError(f"no reply from the router at {self.endpoint} in {self.timeout_s:g} s")
                continue
            msg = self._decoder.decode(self._sock.recv())
            if isinstance(msg, Invalid):
                raise KvrouteError(f"unreadable reply from router: {msg.reason}", code=ErrorCode.INTERNAL)
            if msg.id is None and isinstance(msg, Error):
                if self._waiting != {request_id}:  # cannot tell whose frame it was: fail none
                    log.warning("unattributed_error", code=msg.code, message=msg.message, waiting=len(self._waiting))
                    continue
                msg.id = request_id  # the router could not read the frame of the one request waiting
            self._inbox[msg.id or ""].append(msg)
        msg = box.popleft()
        if isinstance(msg, Error | Result | StatusReply):
            self._inbox.pop(request_id, None)
            self._waiting.discard(request_id)
        if isinstance(msg, Error):
            raise error_from(msg)
        return msg

    def stream(self, **kwargs: Any) -> Stream:
        """Submit and return a Stream of deltas (see build_submit for the keywords)."""
        sub = build_submit(stream=True, **kwargs)
        self.send(sub)
        assert sub.id is not None
        return Stream(self, sub.id)

    def submit(self, **kwargs: Any) -> Result:
        """Submit and wait for the result (no deltas)."""
        sub = build_submit(stream=False, **kwargs)
        self.send(sub)
        assert sub.id is not None
        while True:
            msg = self._next_for(sub.id)
            if isinstance(msg, Result):
                return msg

    def cancel(self, request_id: str) -> None:
        self.send(Cancel(id=request_id))
        self._waiting.discard(request_id)

    def status(self, cache_salt: str | None = None) -> StatusReply:
        """Every worker and slot; slots holding another tenant's prompts than `cache_salt`'s show only busy/idle."""
        rid = "status-" + uuid.uuid4().hex[:8]
        self.send(StatusRequest(id=rid, cache_salt=cache_salt))
        msg = self._next_for(rid)
        assert isinstance(msg, StatusReply)
        return msg
