"""What the router sends to its peers (clients and workers), without ever blocking the loop.

A send goes out at once unless the peer's pipe is full (ZMQ's high-water mark): then it waits in that peer's backlog,
in order, and whatever comes for the peer later queues behind it. `catch_up` (each tick) sends what waits as the peer
reads again; a peer that stays behind for BACKLOG_TIMEOUT_S, or lets BACKLOG_MAX messages pile up, is cut. A peer that
is gone (ZMQ's EHOSTUNREACH) or cut is reported through `lost`, so that its requests end (a client) or its jobs move
(a worker). Nothing is dropped without a log line.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import zmq

from common import logs
from protocol import encode
from router.lifecycle import Out

log = logs.get(__name__)

BACKLOG_MAX = 100_000  # messages kept for one peer that does not read
BACKLOG_TIMEOUT_S = 30.0  # how long a peer may stay behind

Peer = tuple[bool, bytes]  # (a worker?, its ZMQ identity)


class Outbox:
    """Sends on the client socket and the worker socket (plain ZMQ sockets; the loop's Inboxes read them).
    `lost(worker, identity, reason, cut)`: that peer is unreachable (`cut`: it stayed behind and was cut)."""

    def __init__(
        self, clients: zmq.Socket[bytes], workers: zmq.Socket[bytes], lost: Callable[[bool, bytes, str, bool], None]
    ) -> None:
        self.sockets = (clients, workers)
        self.lost = lost
        self.backlog: dict[Peer, collections.deque[Out]] = {}  # messages waiting while a peer's pipe is full
        self._behind_since: dict[Peer, float] = {}

    def put(self, o: Out) -> None:
        """Send `o`, or keep it behind what already waits for its peer."""
        key = (o.worker, o.to)
        if key in self.backlog:
            self.backlog[key].append(o)
        else:
            self._send(o)

    def _send(self, o: Out) -> bool:
        """Send one message; False when the peer's pipe is full (the message then waits in its backlog)."""
        sock = self.sockets[1] if o.worker else self.sockets[0]
        try:
            sock.send_multipart([o.to, *o.envelope, encode(o.msg)], zmq.NOBLOCK)
        except zmq.Again:
            key = (o.worker, o.to)
            self.backlog.setdefault(key, collections.deque()).appendleft(o)
            self._behind_since.setdefault(key, time.monotonic())
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                log.warning("send_failed", worker=o.worker, error=str(exc), message=type(o.msg).__name__)
            else:
                self.lost(o.worker, o.to, "unreachable", False)
        return True

    def catch_up(self, now: float) -> None:
        """Send what waits for peers whose pipes were full; cut the peers that stay behind too long."""
        for key, backlog in list(self.backlog.items()):
            del self.backlog[key]  # (so that `_send` puts a refused message back in a fresh one)
            while backlog and self._send(backlog.popleft()):
                pass
            if key in self.backlog:  # still full: what was left goes behind the refused message
                self.backlog[key].extend(backlog)
                backlog = self.backlog[key]
                since = self._behind_since[key]
                if len(backlog) > BACKLOG_MAX or now - since > BACKLOG_TIMEOUT_S:
                    self._cut(key, len(backlog), now - since)
            else:
                self._behind_since.pop(key, None)

    def _cut(self, key: Peer, waiting: int, behind_s: float) -> None:
        worker, identity = key
        del self.backlog[key], self._behind_since[key]
        peer = identity.decode("utf-8", "replace") if worker else identity.hex()
        log.warning("peer_cut", worker=worker, peer=peer, unsent=waiting, behind_s=round(behind_s, 1),
                    reason="it did not read its messages")  # fmt: skip
        self.lost(worker, identity, f"did not read its messages for {behind_s:.0f} s", True)
