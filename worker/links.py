"""The worker's connections to its routers: one DEALER per router (`--connect A,B`: routers side by side over one fleet).

Each router places jobs on this worker's slots from its own mirror. The worker is the truth and keeps every mirror
exact: a job's messages go to the router that sent it; when a job of one router takes a slot, every other router is
told (`SlotTaken`, with the job's number on that slot: its epoch), and when the job ends, every other router gets what
the slot holds now and the saved states that changed (`SlotUpdate`, same epoch). A job naming a slot that another
router's jobs hold is refused at once with `slot_busy` (the router places it again, elsewhere or later): the worker
never runs a job on contents its router did not expect. With one router (the usual case) nothing of this is sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import logs
from common.socket_security import secure_client_socket
from protocol import JobDelta

log = logs.get(__name__)

# The last results and heartbeat leave even when the worker exits right after: a connected router takes them in
# milliseconds. One that is gone (it stopped first, as `kvroute serve`'s does) never will: its link closes at once.
LINGER_MS = 500


@dataclass(eq=False)
class RouterLink:
    """One router this worker reports to: its socket and what it said when it accepted this worker."""

    index: int
    endpoint: str
    dealer: zmq.Socket
    events: zmq.Socket | None = None  # the dealer's connects and disconnects (`reachable`)
    gone: bool = False  # the router's connection closed and did not come back (unknown, inproc too: not gone)
    accepted: bool = False
    router_id: str | None = None
    step_deltas: bool = False  # it reads job_deltas (its accept said so)
    notices: bool = False  # it reads slot_taken / slot_update (its accept said so)
    told_held: bool = False  # the last hello said what the slots hold (else a new router means clearing them)
    jobs: set[str] = field(default_factory=set)  # its jobs this worker holds (I/O thread adds, compute thread ends)
    deltas: list[JobDelta] = field(default_factory=list)  # this step's, until the step ends
    dropping: bool = False  # its queue is full: messages to it are dropped

    @classmethod
    def open(
        cls, index: int, endpoint: str, ctx: zmq.Context, worker_id: str, curve_key: str | None, router_key: str | None
    ) -> RouterLink:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, worker_id.encode())
        dealer.setsockopt(zmq.LINGER, LINGER_MS)
        secure_client_socket(dealer, curve_key, router_key)
        events = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(endpoint)
        return cls(index, endpoint, dealer, events)

    def reachable(self) -> bool:
        """Whether the router may still take what is sent (not known gone), from the dealer's events so far."""
        while self.events is not None:
            try:
                event = recv_monitor_message(self.events, zmq.NOBLOCK)
            except zmq.Again:
                break
            self.gone = event["event"] == zmq.EVENT_DISCONNECTED
        return not self.gone

    def close(self) -> None:
        """Close; what waits to be sent gets LINGER_MS to leave, unless the router is gone."""
        self.dealer.close(LINGER_MS if self.reachable() else 0)
        if self.events is not None:
            self.events.close(0)

    def send(self, frame: bytes, *, may_drop: bool) -> None:
        """Send a message. With routers side by side (`may_drop`) a router that does not read (killed, or stalled: about
        1000 messages wait for it) loses messages instead of stalling this worker for the others. A restarted router
        does not know this worker and makes it say hello anew; one that was only stalled finds its mirror wrong where it
        missed a change, which its checks catch (a mismatch, counted and repaired)."""
        if not may_drop:
            self.dealer.send(frame)
            return
        try:
            self.dealer.send(frame, zmq.NOBLOCK)
            self.dropping = False
        except zmq.Again:
            if not self.dropping:
                log.warning("router_not_reading", endpoint=self.endpoint, router_id=self.router_id)
            self.dropping = True

    def accept(self, router_id: str, features: list[str]) -> bool:
        """Record an accept; True when this link's router restarted (another router id than before)."""
        restarted = self.router_id is not None and router_id != self.router_id
        self.router_id, self.accepted = router_id, True
        self.step_deltas = "job_deltas" in features
        self.notices = "slot_notices" in features
        return restarted


class SlotClaims:
    """Which router's jobs own each slot (taken on the I/O thread, released on the compute thread). Every job has its
    own claim number (epoch) on its slot, so the other routers hear of each job's end, also of a job that waited
    behind another job of its router on the same slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[int, tuple[int, set[str]]] = {}  # slot -> (link, its jobs there)
        self._epochs: dict[int, int] = {}
        self._of_job: dict[str, tuple[int, int]] = {}  # job -> (slot, epoch)

    def claim(self, link: int, job: str, slot: int) -> int | None:
        """The job's epoch on the slot; None when another router's jobs own the slot."""
        with self._lock:
            owner = self._owner.get(slot)
            if owner is not None and owner[0] != link:
                return None
            if owner is None:
                owner = self._owner[slot] = (link, set())
            owner[1].add(job)
            epoch = self._epochs[slot] = self._epochs.get(slot, 0) + 1
            self._of_job[job] = (slot, epoch)
            return epoch

    def release(self, job: str) -> tuple[int, int, int] | None:
        """The job ended: (slot, epoch, owning link), or None for a job that claimed nothing."""
        with self._lock:
            claimed = self._of_job.pop(job, None)
            if claimed is None:
                return None
            slot, epoch = claimed
            link, jobs = self._owner[slot]
            jobs.discard(job)
            if not jobs:
                del self._owner[slot]
            return slot, epoch, link

    def claimed(self) -> set[int]:
        """The slots some router's jobs hold now."""
        with self._lock:
            return set(self._owner)
