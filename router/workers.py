"""The worker table: the workers the router knows, from their hello to their death, and what it knows of them.

A worker joins with a hello (router/handshake.py says whether it is taken and what its slots hold; the mirror starts
from that); its heartbeats carry its counters, its state (ready or draining) and its idle slots' lengths (checked
against the mirror); a JobDone or JobError carries the saved states it added or dropped. It leaves when it is dead:
silent for `heartbeat_timeout_s`, or hung (jobs, and no engine progress for `hung_after_s`), or its process exited,
or a new incarnation said hello. A hung worker, and one still silent `hung_after_s` after it was declared dead, is
also to be killed (`kills`: the shell hands them to the supervisor). What becomes of a dead worker's requests is the
scheduler's (router/scheduler.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from common import logs
from protocol import Heartbeat, Hello, JobDone, JobError, SlotTaken, SlotUpdate, token_array
from router import handshake
from router.config import RouterConfig
from router.metrics import Metrics
from router.mirror import Mirror
from router.requests import Req, WorkerConn, WorkerState

log = logs.get(__name__)

# the default bound on waiting requests (--queue-size 0): agents arrive in bursts of dozens and should wait their
# turn, as llama-server lets them, while a flood still gets queue_full instead of memory growing without bound
DEFAULT_QUEUE = 256


@dataclass(frozen=True)
class Kill:
    """A worker process to kill (hung, or silent for too long); the supervisor restarts it."""

    worker: str
    incarnation: int
    pid: int
    reason: str


class WorkerTable:
    """The connected workers by id, and what the router remembers of the ones it lost or never got."""

    def __init__(self, cfg: RouterConfig, mirror: Mirror, metrics: Metrics) -> None:
        self.cfg, self.mirror, self.metrics = cfg, mirror, metrics
        self.workers: dict[str, WorkerConn] = {}
        self.seen: set[tuple[str, int]] = set()  # (worker id, incarnation) ever accepted
        self.restarts: dict[str, int] = {}  # filled by the supervisor
        self.expected: set[str] = set()  # the local workers a supervisor runs
        self.failed: dict[str, str] = {}  # worker id -> why its supervisor gave up on it (crashes at start, restarts)
        self.silent: dict[tuple[str, int], tuple[float, int]] = {}  # declared dead for silence: (when, pid)
        self.kills: list[Kill] = []  # taken by the shell
        self.no_workers_since: float | None = time.monotonic()
        self.starting_until = 0.0  # workers are being started (a model loaded on demand): none missing before then

    def __iter__(self) -> Iterator[WorkerConn]:
        return iter(self.workers.values())

    def get(self, worker: str | None) -> WorkerConn | None:
        return self.workers.get(worker or "")

    def ready(self) -> list[WorkerConn]:
        return [w for w in self.workers.values() if w.state is WorkerState.READY]

    # ---- joining and leaving ----------------------------------------------------------------------

    def repeated(self, msg: Hello) -> WorkerConn | None:
        """The worker, when this hello repeats the one of the incarnation known (the router's accept crossed it)."""
        self.silent.pop((msg.worker_id, msg.incarnation), None)  # it came back
        self.failed.pop(msg.worker_id, None)
        old = self.workers.get(msg.worker_id)
        if old is not None and old.hello.incarnation == msg.incarnation:
            old.last_seen = time.monotonic()
            return old
        return None

    def join(self, msg: Hello) -> WorkerConn:
        """Take a worker whose hello the router accepts (a previous incarnation is gone already): its slots go in the
        mirror as it reports them."""
        held = handshake.held(msg)
        # without a report, a fresh process starts empty; one seen before may hold anything
        known = held is not None or (msg.worker_id, msg.incarnation) not in self.seen
        self.seen.add((msg.worker_id, msg.incarnation))
        cached = msg.cached if held is not None else ()  # (a worker that cannot say what its slots hold clears all)
        slots = self.mirror.add_worker(
            msg.worker_id, msg.slots, contents_known=known, exact=msg.deterministic, held=held, cached=cached
        )
        conn = WorkerConn(msg, slots)
        conn.load.saved = self.mirror.saved[msg.worker_id]
        self.workers[msg.worker_id] = conn
        self.no_workers_since = None
        log.info(
            "worker_accepted",
            worker=msg.worker_id,
            incarnation=msg.incarnation,
            slots=msg.slots,
            ctx_per_slot=msg.ctx_per_slot,
            device=msg.device,
            pid=msg.pid,
            held_tokens=sum(s.n_tokens for s in slots),
        )
        return conn

    def remove(self, worker: str, reason: str) -> WorkerConn | None:
        """A worker is dead: out of the table and its slots out of the mirror, now. Its jobs are the caller's."""
        conn = self.workers.pop(worker, None)
        if conn is None:
            return None
        self.mirror.remove_worker(worker)
        self.metrics.dead_workers += 1
        log.warning("worker_dead", worker=worker, incarnation=conn.hello.incarnation, reason=reason, jobs=len(conn.jobs))
        if not self.ready() and self.no_workers_since is None:
            self.no_workers_since = time.monotonic()
        return conn

    def overdue(self, now: float) -> list[tuple[str, str]]:
        """The workers to declare dead now, with why: silent too long, or hung (those are also to be killed). A worker
        declared dead for silence and still silent `hung_after_s` later is to be killed too."""
        dead = []
        for conn in self.workers.values():
            if now - conn.last_seen > self.cfg.heartbeat_timeout_s:
                self.silent[(conn.id, conn.hello.incarnation)] = (now, conn.hello.pid)
                dead.append((conn.id, f"no heartbeat for {now - conn.last_seen:.1f} s"))
            elif conn.jobs and now - conn.progress_at > self.cfg.hung_after_s:
                reason = f"hung: {len(conn.jobs)} jobs and no engine progress for {now - conn.progress_at:.1f} s"
                self.kills.append(Kill(conn.id, conn.hello.incarnation, conn.hello.pid, reason))
                dead.append((conn.id, reason))
        for (worker, incarnation), (since, pid) in list(self.silent.items()):
            if now - since > self.cfg.hung_after_s:  # declared dead for silence, and never came back
                del self.silent[(worker, incarnation)]
                self.kills.append(Kill(worker, incarnation, pid, f"silent for {now - since:.1f} s after it was declared dead"))
        return dead

    def take_kills(self) -> list[Kill]:
        kills, self.kills = self.kills, []
        return kills

    def none_can_come(self) -> str | None:
        """Why no worker will serve: none is connected and every local worker failed at start. None otherwise."""
        if self.workers or not self.expected or not self.expected <= self.failed.keys():
            return None
        return "; ".join(f"worker {w}: {r}" for w, r in sorted(self.failed.items()))

    def none_for(self, grace_s: float) -> bool:
        """Whether no worker has been ready for `grace_s` (and none is being started)."""
        now = time.monotonic()
        return self.no_workers_since is not None and now - self.no_workers_since >= grace_s and now >= self.starting_until

    def starting(self, within_s: float) -> None:
        """Workers are being started and should say hello within `within_s`: until then none is missing."""
        self.starting_until = time.monotonic() + within_s
        self.failed.clear()

    # ---- what workers report ----------------------------------------------------------------------

    def heartbeat(self, conn: WorkerConn, msg: Heartbeat) -> None:
        """Its counters, its state, and its idle slots' lengths checked against the mirror."""
        now = time.monotonic()
        conn.queue = msg.queue
        conn.counted(msg.counters, now)
        if msg.progress != conn.progress:
            conn.progress, conn.progress_at = msg.progress, now
        conn.state = WorkerState.DRAINING if msg.draining else WorkerState.READY
        for st in msg.slots:
            if st.slot >= len(conn.slots) or st.busy:
                continue
            if not self.mirror.check_idle(conn.slots[st.slot], st.n_tokens):
                self.metrics.mirror_mismatches += 1
                log.error(
                    "mirror_mismatch",
                    error_id=uuid.uuid4().hex[:12],
                    worker=conn.id,
                    slot=st.slot,
                    mirror=0,
                    reported=st.n_tokens,
                    via="heartbeat",
                )

    def slot_taken(self, conn: WorkerConn, msg: SlotTaken) -> None:
        """Another router's job took one of this worker's slots."""
        if msg.slot < len(conn.slots):
            self.mirror.taken(conn.slots[msg.slot], msg.epoch)
            conn.refresh()

    def slot_update(self, conn: WorkerConn, msg: SlotUpdate) -> None:
        """Another router's jobs on a slot ended: the saved states that changed, then what the slot holds."""
        self.cache_changed(conn, msg)
        if 0 <= msg.slot < len(conn.slots):
            tokens = token_array(msg.tokens)
            slot = conn.slots[msg.slot]
            self.mirror.updated_by_other(slot, msg.epoch, tokens, msg.n_exact, msg.salt, msg.min_keep, msg.cuts)
            conn.refresh()

    def cache_changed(self, conn: WorkerConn, msg: JobDone | JobError | SlotUpdate) -> None:
        """The saved states a JobDone/JobError (or another router's, in a SlotUpdate) reports, before its job is settled
        (an entry may name the slot whose previous contents it holds)."""
        if not msg.cache_added and not msg.cache_dropped and not msg.disk_dropped:
            return
        for problem in self.mirror.cache_changed(conn.id, msg.cache_added, msg.cache_dropped, msg.disk_dropped):
            self.metrics.mirror_mismatches += 1
            log.error("mirror_mismatch", error_id=uuid.uuid4().hex[:12], worker=conn.id, problem=problem, via="cache_added")

    # ---- capacity ---------------------------------------------------------------------------------

    def slot_context(self) -> int | None:
        """The largest slot of the ready workers, in tokens (what a prompt must fit); None when none is ready."""
        return max((w.hello.ctx_per_slot for w in self.ready()), default=None)

    def idle_slot(self) -> bool:
        return any(w.state is WorkerState.READY and w.load.busy < len(w.slots) for w in self.workers.values())

    def free_slots(self) -> int:
        """Slots of ready workers with no job: a request being prepared now may take one instead of a queue place."""
        return sum(max(0, len(w.slots) - w.load.busy) for w in self.workers.values() if w.state is WorkerState.READY)

    def slot_count(self) -> int:
        """Slots of every worker the table knows."""
        return sum(len(w.slots) for w in self.workers.values())

    def owner_share(self) -> int:
        """How many requests (choices) one owner may have in flight, waiting and running: its --queue-share of the
        queue and of the slots."""
        return max(1, int(self.queue_limit() * self.cfg.queue_share)) + self.running_share()

    def running_share(self) -> int:
        """How many slots one owner's requests may hold while another owner's wait: its --queue-share of them."""
        return max(1, int(self.slot_count() * self.cfg.queue_share))

    def queue_limit(self) -> int:
        """How many requests may wait (--queue-size; 0: DEFAULT_QUEUE, or four per slot when that is more)."""
        if self.cfg.queue_size > 0:
            return self.cfg.queue_size
        return max(DEFAULT_QUEUE, 4 * self.slot_count())

    def loads_for(self, req: Req) -> list[WorkerConn]:
        """The ready workers this request may go to: their slots hold it, and, for a request that was on a worker that
        died, no other such request runs there."""
        return [w for w in self.ready() if w.fits(req) and not (req.deaths and w.has_suspect)]
