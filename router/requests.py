"""The router's bookkeeping records: one per client request, one per connected worker."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from protocol import Hello, Sampling
from router.mirror import Slot
from router.select import WorkerLoad


class ReqState(enum.Enum):
    TOKENIZING = "tokenizing"  # a long text being tokenized off the event loop
    QUEUED = "queued"  # waiting in the router's queue
    RUNNING = "running"  # sent to a worker as a job
    DONE = "done"


@dataclass(eq=False)
class Req:
    client: bytes  # ZMQ identity of the client connection
    envelope: list[bytes]  # [b""] for REQ clients, echoed back; [] for DEALER
    rid: str  # the client's request id
    tokens: np.ndarray
    sampling: Sampling
    stream: bool
    deadline: float | None  # monotonic
    arrived: float = field(default_factory=time.monotonic)
    state: ReqState = ReqState.QUEUED
    queued_at: float = field(default_factory=time.monotonic)
    wait_since: float | None = None  # when it started waiting for a busy slot
    job: str | None = None
    worker: str | None = None
    slot: Slot | None = None
    predicted: int = 0
    prefill_pending: int = 0  # counted in the worker's queued_prefill until the first token
    streamed: list[int] = field(default_factory=list)  # token ids received from the worker
    started: bool = False  # a delta reached the client: it can no longer be re-dispatched
    cancelled: bool = False
    gone: bool = False  # the client disconnected: nothing more is sent
    attempts: int = 0
    queue_ms: float = 0.0

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.rid)


class WorkerState(enum.Enum):
    READY = "ready"
    DRAINING = "draining"


@dataclass(eq=False)
class WorkerConn:
    hello: Hello
    slots: list[Slot]
    last_seen: float = field(default_factory=time.monotonic)
    state: WorkerState = WorkerState.READY
    queue: int = 0  # jobs waiting inside the worker (from its heartbeat)
    jobs: dict[str, Req] = field(default_factory=dict)
    load: WorkerLoad = field(init=False)

    def __post_init__(self) -> None:
        self.load = WorkerLoad(self.hello.worker_id, self.slots)

    @property
    def id(self) -> str:
        return self.hello.worker_id

    @property
    def identity(self) -> bytes:
        return self.hello.worker_id.encode()
