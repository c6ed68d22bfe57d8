"""The router's bookkeeping records: one per choice of a client request, one per dispatch of it to a worker, one per
connected worker."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from chat.output import OutputSpec
from chat.output_parser import OutputParser
from protocol import Choice, Constraint, EngineCounters, Hello, JobImage, Sampling, Timings, TokenLogprob, Usage, fits
from router.mirror import Conversation, Slot
from router.prepare import Shift
from router.prepare import tenant_of as tenant  # noqa: F401 (read from here by the scheduler and views)
from router.select import WorkerLoad

NO_TOKENS = np.zeros(0, dtype=np.int32)


PREFILL_SAMPLE_MIN = 64  # a job prefilling fewer tokens says little about the worker's prefill speed


class ReqState(enum.Enum):
    """Changed only by the core's transitions (router/lifecycle.py)."""

    TOKENIZING = "tokenizing"  # accepted; its prompt is being rendered and tokenized
    QUEUED = "queued"  # waiting in the router's queue
    RUNNING = "running"  # sent to a worker as a job
    CANCELLING = "cancelling"  # running, and told to stop: its job's end finishes it
    DONE = "done"


@dataclass(eq=False)
class Attempt:
    """One dispatch of a choice to a worker's slot: what a requeue drops whole (the next dispatch makes a new one)."""

    job: str
    worker: str
    slot: Slot
    predicted: int  # prompt tokens the router expects the slot to reuse
    prefill_pending: int  # prompt tokens its worker has still to compute (until the first token)
    parser: OutputParser  # reads this attempt's reply
    streamed: list[int] = field(default_factory=list)  # token ids received from the worker
    logprobs: list[TokenLogprob] = field(default_factory=list)
    delivered: int = 0  # deltas sent to the client: once any is, the choice cannot be dispatched again
    resumed: int = 0  # a suspended job's going on (Job.resume): the tokens of its earlier output its prompt holds


@dataclass(eq=False)
class Req:
    client: bytes  # ZMQ identity of the client connection
    envelope: list[bytes]  # [b""] for REQ clients, echoed back; [] for DEALER
    rid: str  # the client's request id
    sampling: Sampling
    stream: bool
    deadline: float | None  # monotonic
    n: int = 1  # choices the client asked for
    tokens: np.ndarray = field(default_factory=lambda: NO_TOKENS)
    arrived: float = field(default_factory=time.monotonic)
    state: ReqState = ReqState.TOKENIZING
    reply_to: bytes | None = None  # where replies go; None: nothing more is sent (the client left, or it was answered)
    queued_at: float = field(default_factory=time.monotonic)
    wait_since: float | None = None  # when it started waiting for a busy slot
    attempt: Attempt | None = None  # its current (or last) dispatch; None while queued
    attempts: int = 0
    deaths: int = 0  # workers that died while running it: a poison request kills every worker it reaches
    ended: bool = False  # its outcome is counted and answered (an error) though a choice may still be cancelling
    unfit_since: float | None = None  # queued while no ready worker's slots could hold it
    queue_ms: float = 0.0
    constraint: Constraint | None = None
    output: OutputSpec = field(default_factory=OutputSpec)
    prompt_text: str = ""  # a chat prompt's text, whose reply the prompt tokenizer remembers (add_bos with it)
    images: tuple[JobImage, ...] = ()  # its prompt's images (their ids in `tokens`: common/media.py)
    prompt_bos: bool = False
    index: int = 0  # which choice, when the client asked for n > 1
    group: list[Req] | None = None  # every choice of the request when n > 1 (one list, shared by all of them)
    choice: Choice | None = None  # this choice's reply, kept until every choice of the request has one
    usage: Usage | None = None
    timings: Timings | None = None
    shift: Shift | None = None  # what --context-shift dropped from its messages (the result says so)
    pinned: str | None = None  # --policy round-robin: the worker it was sent to when it arrived
    salt: str = ""  # its tenant: a digest of its cache_salt (prefixes are shared only within a tenant)
    owner: str = ""  # whose share of the queue it counts against (Submit.owner; "": none)
    batch_deltas: bool = False  # its client reads `deltas` messages (Submit.batch_deltas)
    direct: str = ""  # its output goes from the worker to this endpoint of its client (Submit.reply_to), not through here
    direct_key: str = ""  # that endpoint's CURVE public key
    session: str | None = None  # the conversation or agent session it continues (Submit.session, a hint)
    # a sub-agent's parent session: Submit.parent_session, else, for a conversation of a session other than its first
    # (another prompt head: router/mirror.py `Sessions.conv`), that session
    parent_session: str | None = None
    priority: int = 0  # 1 interactive, 0 normal, -1 background: higher takes free slots first
    conv: Conversation | None = None  # its conversation (router/mirror.py `conversation_of`), once its prompt is known
    preempting: bool = False  # its worker was asked to hand its job back for one of higher priority (JobCancel.preempt)
    preempted: int = 0  # times it was handed back so: once is all (router/lifecycle.py `_preempt`)
    took_slot: bool = False  # it had a job of lower priority handed back for it (once is all)
    # its job, suspended on that attempt's worker after its output began (JobError.suspended), waits to go on there
    # (Job.resume): queued meanwhile, its output so far in the attempt (`place_tokens`)
    suspended: Attempt | None = None

    def __post_init__(self) -> None:
        self.reply_to = self.client

    @property
    def key(self) -> tuple[bytes, str, int]:
        return (self.client, self.rid, self.index)

    @property
    def job(self) -> str | None:
        return self.attempt.job if self.attempt else None

    @property
    def worker(self) -> str | None:
        return self.attempt.worker if self.attempt else None

    @property
    def slot(self) -> Slot | None:
        return self.attempt.slot if self.attempt else None

    @property
    def started(self) -> bool:
        """Output reached the client: the request can no longer be sent to another worker."""
        attempt = self.attempt or self.suspended
        return attempt is not None and attempt.delivered > 0

    @property
    def place_tokens(self) -> np.ndarray:
        """The prompt its next job computes: its prompt, and for a suspended job the output it has generated too."""
        s = self.suspended
        return self.tokens if s is None else np.concatenate([self.tokens, np.asarray(s.streamed, dtype=np.int32)])

    @property
    def choices(self) -> list[Req]:
        return self.group or [self]

    def sibling(self, index: int) -> Req:
        """Choice `index` of the same request: its own state, the same prompt and settings, seed + index."""
        sampling = self.sampling
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + index) % (2**32 - 1))
        twin = Req(self.client, self.envelope, self.rid, sampling, self.stream, self.deadline, self.n, self.tokens, self.arrived)
        twin.constraint, twin.output, twin.index, twin.group = self.constraint, self.output, index, self.group
        twin.salt, twin.owner, twin.batch_deltas = self.salt, self.owner, self.batch_deltas
        twin.session, twin.parent_session, twin.priority, twin.conv = self.session, self.parent_session, self.priority, self.conv
        return twin


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
    counters: EngineCounters | None = None  # the engine's, from its last heartbeat
    rates: dict[str, float] = field(default_factory=dict)  # per second, between its last two heartbeats
    counted_at: float = 0.0
    progress: int = 0  # the engine's step count, from its last heartbeat
    progress_at: float = field(default_factory=time.monotonic)  # when it last moved (or the worker got work)
    prefill_tps: float = 0.0  # prompt tokens computed per second, from its JobDone timings (moving average)
    load: WorkerLoad = field(init=False)

    def __post_init__(self) -> None:
        h = self.hello
        self.load = WorkerLoad(h.worker_id, self.slots, host_cache_bytes=h.host_cache_bytes, ctx_per_slot=h.ctx_per_slot)
        self.load.deterministic = h.deterministic
        self._evict_share()

    def counted(self, counters: EngineCounters, now: float) -> None:
        """A heartbeat's counters: kept, and their rates since the previous heartbeat."""
        if self.counters is not None and now > self.counted_at:
            dt = now - self.counted_at
            before = msgspec.structs.asdict(self.counters)
            self.rates = {k: max(0.0, (v - before[k]) / dt) for k, v in msgspec.structs.asdict(counters).items()}
        self.counters, self.counted_at = counters, now
        self._restore_cost()

    def prefilled(self, tokens: int, ms: float) -> None:
        """A job's prefill: its speed, when long enough to tell, goes into the moving average."""
        if tokens >= PREFILL_SAMPLE_MIN and ms > 0:
            tps = tokens / (ms / 1000)
            self.prefill_tps = tps if not self.prefill_tps else 0.8 * self.prefill_tps + 0.2 * tps
            self.load.prefill_tps = self.prefill_tps
            self._restore_cost()

    def _restore_cost(self) -> None:
        """Selection's cost of restoring a byte, in prompt tokens: prefill speed / restore speed, once both are known."""
        c = self.counters
        if not self.prefill_tps or c is None:
            return
        nbytes, seconds = c.host_restore_bytes, c.host_restore_s
        if nbytes and seconds > 0:
            self.load.restore_cost = self.prefill_tps / (nbytes / seconds)
        nbytes, seconds = c.disk_restore_bytes, c.disk_restore_s
        if nbytes and seconds > 0:
            self.load.disk_restore_cost = self.prefill_tps / (nbytes / seconds)
        self._evict_share()

    def _evict_share(self) -> None:
        """What overwriting a cached token costs selection, in prompt tokens: all of it, unless the worker saves what a
        job overwrites in host RAM (Hello.host_cache_bytes): then restoring its KV bytes later."""
        h = self.hello
        if h.host_cache_bytes:
            per_token = h.kv_bytes / max(1, h.slots * h.ctx_per_slot)
            self.load.evict_share = min(1.0, per_token * self.load.restore_cost)

    def fits(self, req: Req) -> bool:
        """Whether one of this worker's slots can hold the request's prompt and its max_tokens."""
        return fits(len(req.tokens), req.sampling.max_tokens, self.hello.ctx_per_slot)

    @property
    def has_suspect(self) -> bool:
        """Whether it runs a request that was running on a worker that died (at most one such per worker, so that
        the next death tells which request caused it)."""
        return any(r.deaths for r in self.jobs.values())

    def refresh(self) -> None:
        """Recompute the load selection sees from what it derives from: the mirror's slots and the running jobs."""
        self.load.busy = sum(s.busy for s in self.slots)
        self.load.queued_prefill = sum(r.attempt.prefill_pending for r in self.jobs.values() if r.attempt)
        self.load.frees_at = self._frees_at()

    def _frees_at(self) -> float | None:
        """When the first of its running jobs should end (monotonic seconds), from what each has left at the worker's
        measured speeds: its prompt still to compute, the rest of its max_tokens (an upper bound: it may stop
        sooner); None until both speeds are measured."""
        running = [r.attempt for r in self.jobs.values() if r.attempt]
        decode = self.rates.get("generated_tokens", 0.0) / max(1, len(running))  # (each running job's share)
        if not running or not self.prefill_tps or decode <= 0:
            return None
        left = min(
            (
                a.prefill_pending / self.prefill_tps + max(0, cap - len(a.streamed)) / decode
                for r in self.jobs.values()
                if (a := r.attempt) is not None and (cap := r.sampling.max_tokens) is not None  # (no cap: no end known)
            ),
            default=math.inf,
        )
        return time.monotonic() + left if left < math.inf else None

    @property
    def id(self) -> str:
        return self.hello.worker_id

    @property
    def identity(self) -> bytes:
        return self.hello.worker_id.encode()
