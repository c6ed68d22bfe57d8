"""The engine's thread: the one compute thread, which owns the llama context, takes the commands of the process's
other threads (worker/main.py) and runs the compute core (worker/core.py) between them.

Other threads talk to the engine only through this class: `submit`, `embed`, `cancel`, `drain`, `reset` and `call`
put a command in a queue that the compute thread takes between two steps; results come back as protocol messages
(JobDelta, then one JobDone or JobError; an embed job's EmbedDone or JobError) passed to the job's sink, on the compute
thread. Between two steps the thread also computes a chunk of the embed jobs' inputs (worker/embed_jobs.py): a request
of many long inputs delays the slots' next token by one chunk at most, and the commands that came meanwhile (a cancel)
are taken before the next chunk. With nothing to compute the thread blocks on that queue.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec

from common import logs
from common.slots import SlotPhase
from protocol import (
    CacheEntry,
    EmbedJob,
    EngineCounters,
    Job,
    JobDone,
    JobError,
    Message,
    SlotHeld,
    SlotState,
    pack_tokens,
)
from worker.checkpoints import cuts
from worker.config import WorkerConfig
from worker.core import EngineCore
from worker.embed_jobs import EmbedSink
from worker.images import ENCODE_POLL_S
from worker.llama import Llama
from worker.task import Sink

log = logs.get(__name__)


class JobStream:
    """In-process view of one job's messages: iterate for JobDelta..., then JobDone or JobError."""

    def __init__(self, job_id: str) -> None:
        self.id = job_id
        self._q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.final: JobDone | JobError | None = None

    def put(self, msg: Message) -> None:
        self._q.put(msg)

    def __iter__(self) -> Iterator[Message]:
        while self.final is None:
            msg = self._q.get()
            if isinstance(msg, JobDone | JobError):
                self.final = msg
            yield msg

    def result(self, timeout: float | None = None) -> JobDone | JobError:
        """Wait for the end; returns the JobDone or JobError (deltas are dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.final is None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                msg = self._q.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"job {self.id} did not finish in {timeout} s") from None
            if isinstance(msg, JobDone | JobError):
                self.final = msg
        return self.final


class Engine:
    """Continuous batching over the slots of one llama context. Start with `start()`, stop with `stop()`."""

    def __init__(self, cfg: WorkerConfig, llama: Llama | None = None) -> None:
        self.core = core = EngineCore(cfg, llama)
        self.cfg, self.llama, self.vocab, self.guide_tokenizer = cfg, core.llama, core.vocab, core.guide_tokenizer
        self.n_ctx, self.n_batch, self.counters = core.n_ctx, core.n_batch, core.counters
        self.host, self.disk = core.host, core.disk
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running = False
        self.after_step: Callable[[], None] | None = None  # called on the compute thread after every step
        core.wake = lambda: self._inbox.put(("wake", None))  # (an image's encode ended, an embedder was made)

    @property
    def progress(self) -> int:
        """Steps completed and embedding inputs computed; a worker whose progress stops while it has jobs is hung."""
        return self.core.progress + self.core.embeds.computed

    def start(self) -> Engine:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvroute-engine", daemon=True)
        self._thread.start()
        return self

    def persist(self, timeout_s: float) -> int:
        """On a graceful stop: every slot's state and every host-RAM entry to the disk tier, waiting up to `timeout_s`
        for the writes. Returns how many were queued (0 without a disk tier)."""
        if self.disk is None:
            return 0
        queued = self.call(lambda e: e.saved.persist(e.table.slots, e.llama, e.prefixes.copying)).result()
        if not self.disk.flush(timeout_s):
            log.warning("persist_timeout", timeout_s=timeout_s, queued=queued)
        return int(queued)

    def stop(self, close: bool = True) -> None:
        """Stop the compute thread (running jobs are dropped) and free the context when `close`."""
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join()
            self._thread = None
        settled = self.core.close()  # (the image encoder's thread: not waited for past a moment)
        if self.disk is not None:
            self.disk.close()
        if close:
            self.guide_tokenizer.close()
            self.core.embeds.close()  # (their contexts before the model)
            if settled:
                self.llama.close()
            else:  # an image's encode is still running and reads the model: it is left to the process's exit
                log.warning("image_encode_left_running", reason="the worker stops; the model is not freed under it")

    def submit(self, job: Job, sink: Sink | None = None) -> JobStream | None:
        """Queue a job. Its messages go to `sink`, or, without one, to the returned JobStream."""
        stream = None
        if sink is None:
            stream = JobStream(job.id)
            sink = stream.put
        t_arrival = time.monotonic()
        if job.constraint is not None:  # compiled here (the I/O thread), once per grammar: the compute thread clones it
            self.guide_tokenizer.grammars.compile_ahead(job.constraint.grammar)
        self._inbox.put(("job", (job, sink, t_arrival)))
        return stream

    def cancel(self, job_id: str, preempt: bool = False) -> None:
        self._inbox.put(("preempt" if preempt else "cancel", job_id))

    def drain(self) -> None:
        self._inbox.put(("drain", None))

    def reset(self) -> None:
        """Forget every job without reporting and clear every slot (the router restarted with an empty mirror)."""
        self._inbox.put(("reset", None))

    def forget_jobs(self) -> Future[int]:
        """End every job without a word, keeping what the slots hold (the router forgot this worker: it restarted,
        or it declared this worker dead and already answered for those jobs). The future gives how many."""
        return self.call(lambda e: e.forget_jobs())

    def held(self) -> Future[tuple[list[SlotHeld], list[CacheEntry]]]:
        """What every slot and every saved state holds, read on the compute thread (for the hello to a router that does
        not know this worker). Changes not yet reported stay pending: a router that knows the worker already
        ignores this hello and needs them."""

        def read(e: EngineCore) -> tuple[list[SlotHeld], list[CacheEntry]]:
            slots = [
                SlotHeld(
                    slot=s.id,
                    tokens=pack_tokens(s.tokens),
                    n_exact=s.n_exact,
                    salt=s.salt,
                    min_keep=e.prefixes.min_keep(s),
                    cuts=cuts(s.checkpoints),
                )
                for s in e.table.slots
            ]
            return slots, e.saved.listing()

        return self.call(read)

    def embed(self, job: EmbedJob, sink: EmbedSink) -> None:
        """Queue an embed job: computed one input between two engine steps (worker/embed_jobs.py); its end to `sink`."""
        self._inbox.put(("embed", (job, sink)))

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run `fn(core)` on the compute thread between two steps."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def hand_back(self, running: bool) -> Future[int]:
        """End waiting jobs (and running ones when `running`) with JobError `draining`, which the router
        re-dispatches when the client saw no output yet. The future gives how many were handed back."""
        return self.call(lambda e: e._hand_back(running))

    def has_work(self) -> Future[bool]:
        """Whether any job is waiting or running (read on the compute thread)."""
        return self.call(lambda e: not e.idle())

    # plain reads of compute-thread state, good enough for a once-a-second report

    def slot_states(self) -> list[SlotState]:
        busy = SlotPhase.BUSY
        slots = self.core.table.slots
        return [SlotState(slot=s.id, busy=s.phase is busy, n_tokens=s.n_tokens, job_id=s.job_id) for s in slots]

    def figures(self) -> EngineCounters:
        """The counters, the host-RAM cache's size, the context checkpoints' bytes and the state buffers' counts, for
        the heartbeat."""
        snapshots = sum(c.nbytes for s in list(self.core.table.slots) for c in list(s.checkpoints))
        buffers = self.core.llama.buffers
        return msgspec.structs.replace(
            self.counters,
            host_cache_bytes=self.host.nbytes,
            host_cache_entries=len(self.host),
            snapshot_bytes=snapshots,
            state_buffers_mapped=buffers.mapped,
            state_buffers_reused=buffers.reused,
        )

    def working(self) -> bool:
        """Whether any job waits or runs, embed jobs too (for the watchdog: progress is expected only then)."""
        core = self.core
        return bool(core.admission.waiting or core.embeds) or any(s.phase is SlotPhase.BUSY for s in core.table.slots)

    @property
    def queue_len(self) -> int:
        return len(self.core.admission.waiting)

    @property
    def draining(self) -> bool:
        return self.core.admission.draining

    # ---- compute thread ----

    def _loop(self) -> None:
        core = self.core
        while self._running:
            with contextlib.suppress(queue.Empty):  # block only when there is nothing to compute
                if core.idle():
                    self._handle(*self._inbox.get())
                elif core.waiting_for_images() or core.waiting_for_embedder():
                    # (an encode that ends, or an embedder made, wakes it; cancels and deadlines are looked at)
                    self._handle(*self._inbox.get(timeout=ENCODE_POLL_S))
                else:
                    self._handle(*self._inbox.get_nowait())
            while True:  # take every command that arrived during the last step
                try:
                    self._handle(*self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not self._running:
                break
            # a chunk of embedding at most between two steps, smaller while slots generate (worker/embed_jobs.py)
            core.embeds.run_one(beside=bool(core.admission.waiting or core.table.busy()))
            core.step()
            if self.after_step is not None:
                self.after_step()

    def _handle(self, kind: str, arg: Any) -> None:
        core = self.core
        if kind == "job":
            core.take(*arg)
        elif kind == "embed":
            core.embeds.add(*arg)
        elif kind == "cancel":
            core.cancel(arg)
        elif kind == "preempt":
            core.cancel(arg, preempt=True)
        elif kind == "drain":
            core.admission.draining = True
        elif kind == "reset":
            core._reset()
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(core))
            except Exception as exc:
                fut.set_exception(exc)
        elif kind == "wake":
            pass  # (an image's encode ended, or an embedder was made: worker/images.py, worker/embed_jobs.py)
        elif kind == "stop":
            self._running = False
