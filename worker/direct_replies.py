"""Direct replies: the worker's sockets to the clients that read their jobs' output themselves (Job.reply_to), so that
a streamed token does not pass through the router (PROTOCOL.md 4.3).

One PUSH per client endpoint, opened when a job names it and closed after it has been idle IDLE_S; owned by the I/O
thread; at most MAX_OPEN at once. A client that stops reading (or an endpoint that never answers) does not stall this
worker, nor fill its memory: its messages wait in its socket's queue, of at most QUEUE_MAX messages; one more and the
endpoint is stalled: its socket closes, what waited there is dropped, and `send` says so (the caller cancels the jobs
writing there). An endpoint with a CURVE key is reached with CURVE (this process's own key pair: the client's socket
takes any peer, the job ids it reads are what it trusts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from common import logs

log = logs.get(__name__)

IDLE_S = 300.0  # an endpoint unused this long is closed (its client is gone, or idle)
MAX_OPEN = 256  # endpoints open at once; past it the least recently used closes
QUEUE_MAX = 4096  # messages waiting for one endpoint (a step's deltas are one): about a minute of a stream
LINGER_MS = 500  # the last replies leave when the worker exits right after a job (a connected client takes them at once)


@dataclass(eq=False)
class ReplySocket:
    sock: zmq.Socket
    used: float


class ReplySockets:
    """PUSH sockets to clients' reply endpoints, by (endpoint, key)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.open: dict[tuple[str, str], ReplySocket] = {}
        self._keys: tuple[bytes, bytes] | None = None
        self.sent = 0
        self.stalled = 0  # endpoints closed because QUEUE_MAX messages waited for them

    def send(self, endpoint: str, key: str, frame: bytes) -> bool:
        """Send a frame to a client's endpoint; False when that endpoint is stalled (QUEUE_MAX messages wait for it:
        its socket is closed, what waited is dropped)."""
        target = self._socket(endpoint, key)
        target.used = time.monotonic()
        try:
            target.sock.send(frame, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            log.warning("reply_endpoint_stalled", endpoint=endpoint, waiting=QUEUE_MAX, effect="its jobs are cancelled")
            self.open.pop((endpoint, key)).sock.close(0)
            self.stalled += 1
            return False
        except zmq.ZMQError as exc:
            log.error("reply_not_sent", endpoint=endpoint, error=str(exc))
        return True

    def _socket(self, endpoint: str, key: str) -> ReplySocket:
        found = self.open.get((endpoint, key))
        if found is not None:
            return found
        if len(self.open) >= MAX_OPEN:
            oldest = min(self.open, key=lambda k: self.open[k].used)
            self.open.pop(oldest).sock.close(LINGER_MS)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, QUEUE_MAX)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if key:
            if self._keys is None:
                self._keys = zmq.curve_keypair()
            public, secret = self._keys
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, key.encode())
        sock.connect(endpoint)
        log.info("reply_endpoint_opened", endpoint=endpoint, curve=bool(key))
        found = self.open[(endpoint, key)] = ReplySocket(sock, time.monotonic())
        return found

    def sweep(self, now: float) -> None:
        """Close the endpoints idle for IDLE_S."""
        for k in [k for k, s in self.open.items() if now - s.used > IDLE_S]:
            self.open.pop(k).sock.close(LINGER_MS)
            log.info("reply_endpoint_closed", endpoint=k[0], reason=f"idle {IDLE_S:g} s")

    def close(self) -> None:
        for s in self.open.values():
            s.sock.close(LINGER_MS)
        self.open.clear()
