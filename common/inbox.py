"""Reading a ZMQ socket from an asyncio loop without pyzmq's asyncio layer, whose future per message cost more than half
of the router's CPU per streamed token (the router's sockets, a client's direct-reply socket)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq


class Inbox:
    """A ROUTER socket read from the event loop without pyzmq's asyncio wrapper (a future per message was more than half
    of the router's CPU per streamed token): the loop watches the socket's file descriptor, and each wake reads every
    message waiting, a batch at a time. That descriptor is edge-triggered and any operation on the socket may take its
    edge (a send included), so after each batch and each burst of sends (`rearm`) the socket's own events are checked
    and a read is scheduled when messages wait: without that the loop would sleep with messages queued."""

    BATCH = 256  # messages read before other callbacks get a turn

    def __init__(self, sock: zmq.Socket[bytes], on_frames: Callable[[list[bytes]], None], after: Callable[[], None]) -> None:
        self.sock, self.on_frames, self.after = sock, on_frames, after
        self._scheduled = False
        self._loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._read)
        self.rearm()

    def _read(self) -> None:
        """Up to BATCH messages, each to `on_frames`, then `after` once (it sends what they produced, and rearms)."""
        self._scheduled = False
        try:
            for _ in range(self.BATCH):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_frames(frames)
        finally:
            self.after()
        self.rearm()

    def rearm(self) -> None:
        """Read soon if messages wait (after anything that may have taken the descriptor's edge)."""
        if not self._scheduled and int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._read)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
