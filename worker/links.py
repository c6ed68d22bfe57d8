"""The worker's connections to its routers: one DEALER per router (`--connect A,B`: routers side by side over one fleet).

Each router places jobs on this worker's slots from its own mirror. The worker is the truth and keeps every mirror
exact: a job's messages go to the router that sent it; when a job of one router takes a slot, every other router is
told (`SlotTaken`), and when the slot's last job of that router ends, every other router gets what the slot holds
now and the saved states that changed (`SlotUpdate`). A job naming a slot that another router's job holds is refused
at once with `slot_busy` (the router places it again, elsewhere or later): the worker never runs a job on contents
its router did not expect. With one router (the usual case) nothing of this is sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from kvroute import logs
from kvroute.client import secure_client_socket
from protocol import JobDelta

log = logs.get(__name__)


@dataclass(eq=False)
class RouterLink:
    """One router this worker reports to: its socket and what it said when it accepted this worker."""

    index: int
    endpoint: str
    dealer: zmq.Socket
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
        dealer.setsockopt(zmq.LINGER, 2000)  # the last results leave even when the worker exits right after
        secure_client_socket(dealer, curve_key, router_key)
        dealer.connect(endpoint)
        return cls(index, endpoint, dealer)

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


@dataclass
class Claim:
    link: int  # the router whose jobs own the slot
    epoch: int  # this claim's number for the slot (SlotTaken and the SlotUpdate that ends it carry it)
    jobs: set[str] = field(default_factory=set)


class SlotClaims:
    """Which router's jobs own each slot (taken on the I/O thread, released on the compute thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[int, Claim] = {}
        self._epochs: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}

    def claim(self, link: int, job: str, slot: int) -> tuple[bool, int | None]:
        """(taken, epoch of a new claim or None). Not taken: another router's jobs own the slot."""
        with self._lock:
            c = self._claims.get(slot)
            if c is not None and c.link != link:
                return False, None
            self._slot_of[job] = slot
            if c is not None:
                c.jobs.add(job)
                return True, None
            epoch = self._epochs[slot] = self._epochs.get(slot, 0) + 1
            self._claims[slot] = Claim(link, epoch, {job})
            return True, epoch

    def release(self, job: str) -> tuple[int, int, int] | None:
        """The job ended: (slot, epoch, owning link) when it was its claim's last job, else None."""
        with self._lock:
            slot = self._slot_of.pop(job, None)
            c = self._claims.get(slot) if slot is not None else None
            if c is None or slot is None:
                return None
            c.jobs.discard(job)
            if c.jobs:
                return None
            del self._claims[slot]
            return slot, c.epoch, c.link

    def claimed(self) -> set[int]:
        """The slots some router's jobs hold now."""
        with self._lock:
            return set(self._claims)
