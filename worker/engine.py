"""The engine: one compute thread owns the llama context and runs the step loop over the slots.

Each step is one `llama_decode`: one decode row for every generating slot first, then prefill chunks of
the slots still reading their prompt, up to `n_batch` prompt tokens (chunked prefill), the prompt with the least
left to compute first (one passed over PREFILL_PATIENCE_STEPS steps in a row before all). Logits are asked
only for rows that are sampled. Jobs join and leave between steps; with nothing to do the thread blocks.

Other threads talk to the engine only through `submit`, `cancel`, `drain`, `reset` and `call` (a queue to the
compute thread); results come back as protocol messages (JobDelta, then one JobDone or JobError) passed to the
job's sink, on the compute thread.

Deterministic mode (measured on CPU, see DESIGN.md): a token's KV and logits are bit-reproducible only if they
are computed the same way every time. Measured with flash attention off (it is: its result depends on how much
of the KV came from earlier ubatches): llama.cpp computes a ubatch of fewer than EXACT_ROWS rows, or with a single
row of some sequence, with other kernels; from EXACT_ROWS rows with at least 2 of each sequence on, a row's result
does not depend on its ubatch. With one KV stream per slot, llama.cpp splits a batch into ubatches of consecutive
seq ids with equal rows per sequence. So in this mode the generating slots decode together in one batch in which
every slot from the first generating one to the last, idle ones between them too, has the same number of rows (at
least 2, and at least EXACT_ROWS in all): a slot's decode row, its guesses, then padding at the positions after them,
removed again right after the decode. The fewer slots that span, the more rows each gets for guesses. Prefill
chunks of at least EXACT_ROWS tokens get a `llama_decode` of their own. Every token's KV is then what a prompt pass computes, so a
slot reuses its generated tokens too (`Slot.n_exact`, which covers everything but a prompt's too-short tail).
Logits have a threshold of their own: llama.cpp computes the last layer and the output only for the rows that ask
for logits, and from EXACT_ROWS such rows in a ubatch on it computes a token's logits otherwise (measured: a row
4 of 8 verified guesses differed from the same token decoded alone, by 1e-2 in every logit, while with 7 rows
asking, whichever, nothing differed). A prompt chunk asks for one; so a decode batch asks for at most
EXACT_OUTPUTS: guesses stop there, and more generating slots than that decode in several batches.

Seeded jobs without deterministic mode: a seed asks for the same tokens every time the same job comes, as
llama-server gives them (issue 30), whatever else the worker runs and whatever its cache holds. The default kernels
compute a row otherwise by the shape of its batch (measured: bench/exact_shapes.py), so a seeded job's rows keep to
shapes that do not change: (1) no guesses (rows verified together are computed with other kernels than one row
alone: up to 1 in a logit, 1-5 % of the next token's probability mass at temperature 1, and what is guessed depends
on earlier jobs' outputs and on step timings); (2) its rows go in llama_decodes of their own, never beside another
slot's (a row leading a batch of several slots, in a slot holding 256+ cells, takes another flash attention path
than one row alone); (3) its prompt but the last token in chunks padded as worker/llama.py `alone_rows` says, whose
KV does not depend on where a chunk starts or ends; the last token alone, then one decode row a step. Only KV so
computed is reused for a seeded job (`Slot.n_exact`: the seeded prompts' tokens, not their last token nor the
reply), from its slot, another slot, host RAM or disk. What it costs the seeded job and the others beside it:
bench/README.md "What a seed costs". A chunk within a padded chunk's length of the end of its slot's context has no
room for its padding and is computed without (and not counted in `n_exact`): such a prompt's tokens may differ from
run to run. Deterministic mode gives the same with other kernels (its
padding costs every generating step, not only seeded jobs').

Speculation (`--spec auto|ngram`, worker/speculate.py): a generating slot's row may be followed by rows of guessed
tokens; its sampler takes the rows in order while they agree with the guess, and the KV of the guessed tokens it
did not take is removed before anything else happens (so the invariant below holds after every step).

Invariant (checked after every decode, and before building a batch): for every slot,
`llama_memory_seq_pos_max(slot) + 1 == len(slot.tokens)`. A violation is counted, logged with an id, reported
to the slot's job as an `internal` error carrying that id, and the slot is cleared.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvroute import logs
from kvroute.model import resolve_model
from kvroute.slots import COPY_MIN, EXACT_ROWS, SlotPhase, common_prefix, restore_keep, reused, worth_copy
from kvroute.weights import GGUFError, weights_fingerprint
from protocol import (
    MAX_FRAME_BYTES,
    CacheEntry,
    EngineCounters,
    ErrorCode,
    FinishReason,
    Job,
    JobDelta,
    JobDone,
    JobError,
    Message,
    SlotHeld,
    SlotState,
    Timings,
    TokenLogprob,
    pack_tokens,
    token_hash,
    unpack_tokens,
)
from worker.config import WorkerConfig
from worker.disk_cache import Added, DiskCache, DiskEntry, llama_state_version
from worker.faults import Faults
from worker.guide import Guide, GuideError, GuideTokenizer
from worker.host_cache import Entry, HostCache
from worker.llama import ALONE_ROWS_MIN, Llama, alone_rows
from worker.sampling import Sampler, SamplingError
from worker.slots import Slot, SlotTable, Snapshot
from worker.speculate import Drafter, OutputPool, StepCost
from worker.stopping import TextStream

log = logs.get(__name__)

Sink = Callable[[Message], None]
MS = 1000.0
PAD_TOKEN = 0  # token of padding rows (deterministic mode's, seeded jobs'; any id: their KV is removed after the decode)
# deterministic mode: most rows with logits in one llama_decode (llama.cpp computes a token's logits otherwise from
# EXACT_ROWS output rows on; a prompt chunk has one, see the module docstring)
EXACT_OUTPUTS = EXACT_ROWS - 1
SAVE_MIN = COPY_MIN  # an eviction losing fewer tokens than a restore must gain is not worth a host-RAM copy
# a prompt that got no prefill budget this many steps in a row takes it before prompts with less left to compute
PREFILL_PATIENCE_STEPS = 4
# A hello lists saved states with their tokens; the router refuses a frame over MAX_FRAME_BYTES, and a worker it
# refuses would repeat that hello forever. A large disk tier lists its most recently used states up to this much.
HELLO_LISTING_BYTES = MAX_FRAME_BYTES // 2
ENTRY_OVERHEAD_BYTES = 160  # a listed entry's fields besides its tokens, about


Counters = EngineCounters  # (protocol/worker_messages.py: they cross to the router with every heartbeat)


@dataclass(frozen=True)
class Source:
    """Where a prompt's prefix can be copied from: another slot's KV or a host-RAM entry."""

    lcp: int  # prompt tokens it would give (after the reuse rules)
    slot: Slot | None = None
    entry: Entry | None = None
    disk: DiskEntry | None = None


@dataclass(eq=False)
class Request:
    """One job inside the worker. Progress is derived: prefilling while nothing is sampled, then decoding."""

    id: str
    job: Job
    prompt: list[int]
    sink: Sink
    max_gen: int
    t_arrival: float
    deadline: float | None
    slot: int = -1
    reused: int = 0
    restored: int = 0  # of `reused`: copied in from another slot or host RAM
    sampler: Sampler | None = None
    stream: TextStream = field(default_factory=TextStream)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    silent: bool = False  # reset by a router restart: the new router does not know this job
    t_assigned: float = 0.0
    passed_over: int = 0  # steps in a row in which its prompt got no prefill budget
    drafter: Drafter | None = None  # speculation: guesses from this job's history
    draft: list[int] = field(default_factory=list)  # the guessed tokens in the batch being decoded
    withheld: bool = False  # no guess in that batch: its guesses were taken too rarely to pay there
    exact_chunk: bool = False  # its prompt chunk in that batch is padded as a seeded job's is (see `_build`)
    t_first: float = 0.0

    @property
    def seeded(self) -> bool:
        """A seed asks for the same tokens every time the same job comes (see the module docstring)."""
        return self.job.sampling.seed is not None


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
        self.cfg = cfg
        self.llama = llama or Llama(
            resolve_model(cfg.model),
            slots=cfg.slots,
            ctx_per_slot=cfg.ctx_per_slot,
            n_batch=cfg.n_batch,
            threads=cfg.threads,
            gpu=cfg.gpu,
            deterministic=cfg.deterministic,
            kv_types=(cfg.cache_type_k, cfg.cache_type_v),
            flash_attn=cfg.flash_attn,
            kv_budget_mb=cfg.kv_budget_mb,
            n_gpu_layers=cfg.n_gpu_layers,
        )
        self.vocab = self.llama.vocab
        self.guide_tokenizer = GuideTokenizer(self.vocab)  # built on its own thread, ready long before a grammar is
        self.n_ctx = self.llama.ctx_per_slot
        self.n_batch = cfg.n_batch
        self.snapshots = cfg.snapshots or self.llama.info.recurrent  # trim by restoring, not by seq_rm
        # prefixes move between slots and host RAM by state copy + trim, so only where KV can be trimmed
        self.copies = not self.snapshots
        self.disk = self._disk_tier(cfg) if self.copies else None
        if cfg.cache_dir and not self.copies:
            log.warning("disk_tier_off", reason="this model's memory cannot be trimmed (--snapshots): no saved states")
        self.host = HostCache(cfg.host_cache_mb * 2**20 if self.copies else 0, spill=self._spill)
        self.exact = cfg.deterministic
        if self.exact:
            self.n_ctx -= EXACT_ROWS  # room for the most rows a slot takes in a decode batch (see _build_padded)
        # guesses are verified in the slot's own rows and the rejected ones' KV removed (needs seq_rm); in
        # deterministic mode they take a slot's padding rows
        self.spec = cfg.spec != "none" and not self.snapshots
        self.step_cost = StepCost()  # what a guessed row costs in a step: whether a job's guesses pay
        self.pool = OutputPool(cfg.spec_ngram) if self.spec else None  # recent outputs, guesses across requests
        if cfg.spec == "ngram" and not self.spec:
            log.warning("speculation_off", reason="this model's memory cannot be trimmed (recurrent or hybrid)")
        self.table = SlotTable(cfg.slots)
        self.counters = Counters()
        self.draining = False
        self.waiting: collections.deque[Request] = collections.deque()
        self._by_id: dict[str, Request] = {}
        self._copying: set[int] = set()  # slots whose stream copy (seq_cp) llama.cpp does at the next decode
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._running = False
        self._decode = self.llama.decode  # tests replace this to inject failures
        self.faults = Faults.from_env()  # failpoints of the fault tests; none unless KVROUTE_FAULTS is set
        if self.faults:
            log.warning("fault_injection_on", faults=self.faults.rules)
        self.progress = 0  # steps completed; a worker whose progress stops while it has jobs is hung

    # ---- any thread ----

    def start(self) -> Engine:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvroute-engine", daemon=True)
        self._thread.start()
        return self

    def _disk_tier(self, cfg: WorkerConfig) -> DiskCache | None:
        """The disk tier (--cache-dir), loaded: what a previous run left there is restorable at once."""
        if not cfg.cache_dir or cfg.disk_cache_gb <= 0:
            return None
        # the files are only good for this model and the same KV layout, so both are in what each file must match
        try:
            fingerprint = f"{self.vocab.fingerprint}:{weights_fingerprint(self.vocab.path)}"
        except (GGUFError, OSError) as exc:
            log.warning("disk_tier_off", reason=f"the model's weights cannot be fingerprinted: {exc}")
            return None
        layout = llama_state_version(
            f"k={cfg.cache_type_k}", f"v={cfg.cache_type_v}", f"fa={cfg.flash_attn}", f"det={cfg.deterministic}"
        )
        disk = DiskCache(Path(cfg.cache_dir), int(cfg.disk_cache_gb * 2**30), fingerprint, layout)
        loaded = disk.load()
        disk.drain_events()  # what it found goes to the router in the hello (`held`), not again with a JobDone
        log.info("disk_tier", directory=cfg.cache_dir, entries=len(loaded), nbytes=disk.nbytes, enabled=disk.enabled)
        return disk

    def _spill(self, entry: Entry) -> None:
        """A host-RAM entry dropped to make room goes to disk (written off this thread)."""
        if self.disk is not None:
            self.disk.put(entry.tokens, entry.n_exact, entry.pos_min, entry.data, entry.salt)

    def persist(self, timeout_s: float) -> int:
        """On a graceful stop: every slot's state and every host-RAM entry to the disk tier, waiting up to `timeout_s`
        for the writes. Returns how many were queued (0 without a disk tier). Any thread."""
        if self.disk is None:
            return 0
        queued = self.call(lambda e: e._persist()).result()
        if not self.disk.flush(timeout_s):
            log.warning("persist_timeout", timeout_s=timeout_s, queued=queued)
        return int(queued)

    def stop(self, close: bool = True) -> None:
        """Stop the compute thread (running jobs are dropped) and free the context when `close`."""
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join()
            self._thread = None
        if self.disk is not None:
            self.disk.close()
        if close:
            self.guide_tokenizer.close()
            self.llama.close()

    def submit(self, job: Job, sink: Sink | None = None) -> JobStream | None:
        """Queue a job. Its messages go to `sink`, or, without one, to the returned JobStream."""
        stream = None
        if sink is None:
            stream = JobStream(job.id)
            sink = stream.put
        self._inbox.put(("job", (job, sink, time.monotonic())))
        return stream

    def cancel(self, job_id: str) -> None:
        self._inbox.put(("cancel", job_id))

    def drain(self) -> None:
        self._inbox.put(("drain", None))

    def reset(self) -> None:
        """Forget every job without reporting and clear every slot (the router restarted with an empty mirror)."""
        self._inbox.put(("reset", None))

    def forget_jobs(self) -> Future[int]:
        """End every job without a word, keeping what the slots hold (the router forgot this worker: it restarted,
        or it declared this worker dead and already answered for those jobs). The future gives how many."""
        return self.call(lambda e: e._forget_jobs())

    def held(self) -> Future[tuple[list[SlotHeld], list[CacheEntry]]]:
        """What every slot and every saved state holds, read on the compute thread (for the hello to a router that does
        not know this worker). Changes not yet reported stay pending: a router that knows the worker already
        ignores this hello and needs them."""

        def read(e: Engine) -> tuple[list[SlotHeld], list[CacheEntry]]:
            slots = [
                SlotHeld(slot=s.id, tokens=pack_tokens(s.tokens), n_exact=s.n_exact, salt=s.salt, min_keep=e._min_keep(s))
                for s in e.table.slots
            ]
            disk = e.disk.entries if e.disk is not None else []
            listed, left_out = most_recent_within(e.host.entries, disk, HELLO_LISTING_BYTES)
            if left_out:
                log.warning(
                    "saved_states_not_listed",
                    listed=len(listed),
                    left_out=left_out,
                    reason="more than the hello can carry: the router routes to the listed ones; this worker still "
                    "restores any of them for a request sent here",
                )
            return slots, [e._described(x, with_tokens=True) for x in listed]

        return self.call(read)

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run `fn(engine)` on the compute thread between two steps."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    def hand_back(self, running: bool) -> Future[int]:
        """End waiting jobs (and running ones when `running`) with JobError `draining`, which the router
        re-dispatches when the client saw no output yet. The future gives how many were handed back."""
        return self.call(lambda e: e._hand_back(running))

    def has_work(self) -> Future[bool]:
        """Whether any job is waiting or running (read on the compute thread)."""
        return self.call(lambda e: bool(e.waiting or e.table.busy()))

    def slot_states(self) -> list[SlotState]:
        """Heartbeat view (plain reads of compute-thread state; good enough for a once-a-second report)."""
        busy = SlotPhase.BUSY
        return [SlotState(slot=s.id, busy=s.phase is busy, n_tokens=s.n_tokens, job_id=s.job_id) for s in self.table.slots]

    def figures(self) -> Counters:
        """The counters, the host-RAM cache's size and the snapshots' bytes, for the heartbeat (plain reads of
        compute-thread state)."""
        snapshots = sum(len(s.snapshot.data) for s in list(self.table.slots) if s.snapshot is not None)
        return msgspec.structs.replace(
            self.counters, host_cache_bytes=self.host.nbytes, host_cache_entries=len(self.host), snapshot_bytes=snapshots
        )

    def working(self) -> bool:
        """Whether any job waits or runs (a plain read, for the watchdog: progress is expected only then)."""
        return bool(self.waiting) or any(s.phase is SlotPhase.BUSY for s in self.table.slots)

    @property
    def queue_len(self) -> int:
        return len(self.waiting)

    # ---- compute thread ----

    def _loop(self) -> None:
        while self._running:
            idle = not self.waiting and not self.table.busy()
            with contextlib.suppress(queue.Empty):  # block only when there is nothing to compute
                self._handle(*self._inbox.get() if idle else self._inbox.get_nowait())
            while True:  # take every command that arrived during the last step
                try:
                    self._handle(*self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not self._running:
                break
            try:
                self._step()
            except Exception as exc:  # a bug: fail the running jobs, keep the worker alive
                self._fail_all(exc)
            self.progress += 1

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "job":
            try:
                self._accept(*arg)
            except Exception as exc:  # a bug met by one job: that job fails with an id, the worker goes on
                job, sink, _ = arg
                error_id = uuid.uuid4().hex[:16]
                log.exception("job_accept_failed", error_id=error_id, request_id=job.id)
                self._forget_id(job.id)
                message = f"the worker could not start this job: {type(exc).__name__}: {exc} (error {error_id})"
                self._send(sink, JobError(id=job.id, code=ErrorCode.INTERNAL, message=message, error_id=error_id))
                self.counters.jobs_failed += 1
        elif kind == "cancel":
            req = self._by_id.get(arg)
            if req is not None:
                req.cancelled = True
        elif kind == "drain":
            self.draining = True
        elif kind == "reset":
            self._reset()
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self))
            except Exception as exc:
                fut.set_exception(exc)
        elif kind == "stop":
            self._running = False

    def _accept(self, job: Job, sink: Sink, t_arrival: float) -> None:
        """Validate a job and queue it, or answer with an error before any work."""
        prompt = unpack_tokens(job.tokens)
        err = self._refusal(job, prompt)
        if err is not None:
            code, message = err
            self._send(sink, JobError(id=job.id, code=code, message=message))
            self.counters.jobs_failed += 1
            return
        max_tokens = job.sampling.max_tokens
        max_gen = self.n_ctx - len(prompt) if max_tokens is None else max_tokens
        deadline = t_arrival + job.deadline_ms / MS if job.deadline_ms else None
        req = Request(id=job.id, job=job, prompt=prompt, sink=sink, max_gen=max_gen, t_arrival=t_arrival, deadline=deadline)
        req.stream = TextStream(job.sampling.stop)
        try:
            guide = None if job.constraint is None else Guide(job.constraint, self.guide_tokenizer)
            req.sampler = Sampler(job.sampling, self.vocab.n_vocab, guide=guide, max_gen=max_gen, piece=self.vocab.piece)
        except (SamplingError, GuideError) as exc:
            self._send(sink, JobError(id=job.id, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            self.counters.jobs_failed += 1
            return
        self._by_id[job.id] = req
        self.waiting.append(req)

    def _refusal(self, job: Job, prompt: list[int]) -> tuple[ErrorCode, str] | None:
        if self.draining:
            return ErrorCode.DRAINING, "this worker is draining and takes no new jobs"
        if job.id in self._by_id:
            return ErrorCode.BAD_REQUEST, f"job id {job.id!r} is already running on this worker"
        if job.slot >= len(self.table):
            return ErrorCode.BAD_REQUEST, f"slot {job.slot} does not exist (this worker has slots 0..{len(self.table) - 1})"
        n_vocab = self.vocab.n_vocab
        if any(t < 0 or t >= n_vocab for t in prompt):
            bad = next(t for t in prompt if t < 0 or t >= n_vocab)
            return ErrorCode.BAD_REQUEST, f"prompt token id {bad} is outside the vocabulary (0..{n_vocab - 1})"
        n, ctx = len(prompt), self.n_ctx
        if n >= ctx:
            return ErrorCode.CONTEXT_OVERFLOW, f"prompt of {n} tokens does not fit a slot's context of {ctx} tokens"
        mt = job.sampling.max_tokens
        if mt is not None and n + mt > ctx:
            return (
                ErrorCode.CONTEXT_OVERFLOW,
                f"prompt of {n} tokens + max_tokens {mt} = {n + mt} is over a slot's context of {ctx} tokens",
            )
        return None

    # -- admission --

    def _admit(self) -> None:
        """Give idle slots to waiting jobs, in arrival order; a job naming a busy slot waits for it (FIFO)."""
        if not self.waiting:
            return
        claimed: set[int] = set()
        still: collections.deque[Request] = collections.deque()
        for req in self.waiting:
            if req.cancelled or (req.deadline is not None and time.monotonic() >= req.deadline):
                code = ErrorCode.CANCELLED if req.cancelled else ErrorCode.DEADLINE_EXCEEDED
                self._error(req, code, f"job {code.value} while waiting for a slot")
                continue
            if req.job.slot >= 0:
                slot = self.table[req.job.slot]
                if slot.phase is SlotPhase.BUSY or slot.id in claimed or self._awaits_prefill(req):
                    claimed.add(slot.id)
                    still.append(req)
                    continue
            elif self._awaits_prefill(req):
                still.append(req)
                continue
            else:
                picked = self.table.pick(req.prompt, claimed, req.job.cache_salt)
                if picked is None:
                    still.append(req)
                    continue
                slot = picked
            claimed.add(slot.id)
            self._assign(req, slot)
        self.waiting = still

    def _assign(self, req: Request, slot: Slot) -> None:
        """Reuse the slot's longest common prefix with the prompt (minus one on a full match); trim the rest."""
        self.table.assign(slot, req)
        req.slot, req.t_assigned = slot.id, time.monotonic()
        prompt, salt = req.prompt, req.job.cache_salt
        if not req.job.prefix_cache or slot.salt != salt:  # (another tenant's KV is never reused: its timing would tell)
            self._save(slot, 0)
            self._clear(slot)
        slot.salt = salt
        seeded = req.seeded
        lcp = self._reusable(slot.tokens, slot.n_exact, prompt, self.llama.seq_pos_min(slot.id), seeded)
        src = self._source(slot, prompt, lcp, seeded) if req.job.prefix_cache else None
        if src is not None:
            self._save(slot, 0)
            lcp = self._copy(slot, src)
            req.restored = lcp
        if lcp < slot.n_tokens:
            self._save(slot, lcp)
            self._trim(slot, lcp)
        req.reused = slot.n_tokens
        req.restored = min(req.restored, req.reused)
        self.counters.reused_tokens += req.reused
        self.counters.restored_tokens += req.restored
        if src is not None and src.slot is not None:
            self.counters.restored_from_slots += req.restored
        elif src is not None:
            self.counters.restored_from_host += req.restored
        self.counters.prefilled_tokens += len(prompt) - req.reused
        log.debug(
            "slot_assigned",
            request_id=req.id,
            slot=slot.id,
            reused=req.reused,
            restored=req.restored,
            prefilled=len(prompt) - req.reused,
            predicted_reuse=req.job.predicted_reuse,
        )

    def _reusable(self, tokens: list[int], n_exact: int, prompt: list[int], pos_min: int, seeded: bool = False) -> int:
        """Prompt tokens a sequence holding `tokens` can give: their LCP, minus one on a full match (logits are not
        cached: the last prompt token must be computed again); in deterministic mode only KV computed as prompt,
        leaving a full-size chunk to compute, and to a seeded job otherwise only KV computed as a seeded job's prompt
        (`n_exact` both); none when its sliding-window layers start at `pos_min`, too late for the cut (a state
        restored from host RAM can only be extended, not cut far back)."""
        lcp = reused(common_prefix(tokens, prompt), len(prompt), n_exact, self.exact, seeded)
        return lcp if self.llama.can_keep(pos_min, len(tokens), lcp) else 0

    def _min_keep(self, slot: Slot) -> int:
        """The shortest prefix `slot` can be cut to (`_reusable`'s rule, for the router's mirror): above 0 only while it
        holds a state restored from host RAM or disk."""
        return self.llama.min_keep(self.llama.seq_pos_min(slot.id)) if slot.n_tokens else 0

    def _restorable(self, entry: Entry | DiskEntry, prompt: list[int], seeded: bool = False) -> int:
        """Prompt tokens a saved state gives (the rule the router predicts with: kvroute/slots.py)."""
        lcp = reused(common_prefix(entry.tokens, prompt), len(prompt), entry.n_exact, self.exact, seeded)
        return restore_keep(lcp, len(entry.tokens), self.llama.min_keep(entry.pos_min))

    def _source(self, slot: Slot, prompt: list[int], have: int, seeded: bool) -> Source | None:
        """Another slot (idle or busy: its KV is committed) or a saved state of the same tenant (`slot.salt`) that gives
        enough more of the prompt than the `have` tokens `slot` gives itself to be worth a copy; the one giving most."""
        if not self.copies:
            return None
        best: Source | None = None
        salt = slot.salt
        for other in self.table.slots:
            if other is slot or not other.tokens or other.salt != salt:
                continue
            lcp = self._reusable(other.tokens, other.n_exact, prompt, self.llama.seq_pos_min(other.id), seeded)
            if worth_copy(lcp - have, self.n_ctx) and (best is None or lcp > best.lcp):
                best = Source(lcp, slot=other)
        entry, _ = self.host.best(prompt, salt)
        # a restore writes the slot's cells now, and a stream copy still pending into it would overwrite them
        if entry is not None and slot.id not in self._copying:
            lcp = self._restorable(entry, prompt, seeded)
            if worth_copy(lcp - have, len(entry.tokens)) and (best is None or lcp > best.lcp):
                best = Source(lcp, entry=entry)
        on_disk, _ = self.disk.best(prompt, salt) if self.disk is not None else (None, 0)
        if on_disk is not None and slot.id not in self._copying:
            lcp = self._restorable(on_disk, prompt, seeded)
            if worth_copy(lcp - have, len(on_disk.tokens)) and (best is None or lcp > best.lcp):
                best = Source(lcp, disk=on_disk)
        return best

    def _copy(self, slot: Slot, src: Source) -> int:
        """Replace what `slot` holds by the source's; returns how many of its tokens to keep (0 on failure).

        From another slot, llama.cpp copies the whole stream (every layer in full, so any cut is valid). From host
        RAM, the state comes back with only the last window of its sliding-window layers (`Entry.pos_min`)."""
        if src.slot is not None:
            self.llama.seq_cp(src.slot.id, slot.id)
            self._copying.add(slot.id)
            slot.tokens, slot.n_exact, slot.snapshot = list(src.slot.tokens), src.slot.n_exact, None
            self.counters.slot_copies += 1
            return src.lcp
        if src.disk is not None:
            return self._restore_from_disk(slot, src.disk, src.lcp)
        entry = src.entry
        assert entry is not None
        t0 = time.perf_counter()
        if not self.llama.state_set(slot.id, entry.data):
            self.counters.copy_failures += 1
            log.warning("state_restore_refused", slot=slot.id, tokens=len(entry.tokens))
            self.host.drop(entry)  # it would fail again
            self._clear(slot)
            return 0
        slot.tokens, slot.n_exact, slot.snapshot = list(entry.tokens), entry.n_exact, None
        self.host.used(entry)
        self.counters.host_restores += 1
        self.counters.host_restore_bytes += entry.nbytes
        self.counters.host_restore_s += time.perf_counter() - t0
        return src.lcp

    def _restore_from_disk(self, slot: Slot, entry: DiskEntry, lcp: int) -> int:
        """Read a disk-tier entry (checked against its checksum) into the slot; 0 (slot cleared) when it fails."""
        assert self.disk is not None
        t0 = time.perf_counter()
        data = self.disk.read(entry)  # a file that does not check out is removed: the prompt is computed instead
        if data is None or not self.llama.state_set(slot.id, data):
            self.counters.disk_restore_failures += 1
            log.warning("disk_restore_failed", slot=slot.id, tokens=len(entry.tokens), read=data is not None)
            if data is not None:
                self.disk.drop(entry)
            self._clear(slot)
            return 0
        slot.tokens, slot.n_exact, slot.snapshot = list(entry.tokens), entry.n_exact, None
        self.disk.used(entry)
        self.counters.disk_restores += 1
        self.counters.disk_restore_bytes += len(data)
        self.counters.disk_restore_s += time.perf_counter() - t0
        return lcp

    def _persist(self) -> int:
        """Queue every slot's contents and every host-RAM entry for the disk tier (compute thread)."""
        assert self.disk is not None
        queued = 0
        for slot in self.table.slots:
            if slot.n_tokens < SAVE_MIN or slot.id in self._copying or self.disk.covers(slot.tokens, slot.salt):
                continue
            try:
                pos_min = self.llama.state_pos_min(slot.id, slot.n_tokens)
                data = self.llama.state_get(slot.id)
            except (RuntimeError, MemoryError) as exc:
                log.warning("persist_failed", slot=slot.id, error=str(exc))
                continue
            queued += self.disk.put(list(slot.tokens), slot.n_exact, pos_min, data, slot.salt) is not None
        for entry in sorted(self.host.entries, key=lambda e: -e.last_used):  # most recently used first
            queued += self.disk.put(entry.tokens, entry.n_exact, entry.pos_min, entry.data, entry.salt) is not None
        log.info("persisting", queued=queued)
        return queued

    def _save(self, slot: Slot, keep: int) -> None:
        """`slot` is about to keep only `keep` of its tokens: copy it to host RAM first when what it loses is worth
        it and no other slot or entry holds it."""
        if not self.host.capacity or slot.n_tokens - keep < SAVE_MIN or slot.id in self._copying:
            return  # (a slot whose stream copy is still pending has no KV to read yet)
        tokens, n, salt = slot.tokens, slot.n_tokens, slot.salt
        if self.host.covers(tokens, salt) or any(
            o is not slot and o.salt == salt and o.tokens[:n] == tokens for o in self.table.slots
        ):
            return
        if not self.host.make_room(self.llama.state_size(slot.id)):
            return  # over the whole budget: nothing is allocated
        try:
            pos_min = self.llama.state_pos_min(slot.id, n)
            data = self.llama.state_get(slot.id)
        except (RuntimeError, MemoryError) as exc:  # the copy is a nicety: the job goes on without it
            self.counters.host_save_failures += 1
            log.warning("host_save_failed", slot=slot.id, tokens=n, error=str(exc))
            return
        if self.host.put(tokens, slot.n_exact, data, pos_min, slot.id, salt):
            self.counters.host_saves += 1

    def _awaits_prefill(self, req: Request) -> bool:
        """Whether a busy slot is computing a prefix of this prompt longer (by a copy's worth) than any KV held now:
        then the job waits for it and copies it, instead of computing the same tokens a second time alongside."""
        if not self.copies or not req.job.prefix_cache:
            return False
        prompt, salt, seeded = req.prompt, req.job.cache_salt, req.seeded
        computing = [s for s in self.table.busy() if s.job is not None and not s.job.generated and s.salt == salt]
        if seeded and not self.exact:  # (a seeded job reuses only what a seeded job computes)
            computing = [s for s in computing if s.job.seeded]
        if not computing:
            return False
        mine = [s for s in self.table.slots if s.salt == salt]
        pos_min = self.llama.seq_pos_min
        have = max([self._reusable(s.tokens, s.n_exact, prompt, pos_min(s.id), seeded) for s in mine] + [0])
        disk = self.disk.best(prompt, salt)[0] if self.disk is not None else None
        for saved in (self.host.best(prompt, salt)[0], disk):
            if saved is not None:
                have = max(have, self._restorable(saved, prompt, seeded))
        for s in computing:
            shared = min(common_prefix(s.job.prompt, prompt), len(prompt) - 1)
            if s.n_tokens < shared and shared - have >= COPY_MIN:
                return True
        return False

    def _trim(self, slot: Slot, n: int) -> None:
        """Make the slot hold only its first n tokens, or fewer if its memory cannot be cut there."""
        if not self.snapshots:
            if self.llama.seq_rm(slot.id, n, -1):
                slot.keep(n)
                return
            log.warning("seq_rm_refused", slot=slot.id, keep=n, held=slot.n_tokens)
            self._clear(slot)
            return
        snap = slot.snapshot
        if snap is not None and snap.n_tokens <= n and self.llama.state_set(slot.id, snap.data):
            slot.keep(snap.n_tokens)
            self.counters.snapshot_restores += 1
            return
        self._clear(slot)

    def _clear(self, slot: Slot) -> None:
        self.llama.seq_clear(slot.id)
        slot.keep(0)
        slot.snapshot = None

    # -- the step --

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._expire()
        self._admit()
        busy = self.table.busy()
        if not busy:
            return
        self._check(busy)
        budget = self.n_batch
        # one llama_decode for all slots but seeded jobs', each of which has one of its own; in deterministic mode
        # one for the generating slots and one per prompt chunk (see the module docstring), taking the prefill
        # budget in the same order as one batch does
        busy = self._prefill_order(self.table.busy())
        if not self.exact:
            shared = [s for s in busy if not s.job.seeded]
            starved = [s for s in busy if s.job.seeded and s.job.passed_over >= PREFILL_PATIENCE_STEPS]
            rest = [s for s in busy if s.job.seeded and s not in starved]
            for group in [*([s] for s in starved), shared, *([s] for s in rest)]:
                budget = self._run(group, budget)
        else:  # the generating slots together, padded; then each prompt chunk alone (see the module docstring)
            generating = sorted((s for s in busy if s.job.generated), key=lambda s: s.id)
            for i in range(0, len(generating), EXACT_OUTPUTS):  # (at most EXACT_OUTPUTS decode rows in a batch)
                self._run(generating[i : i + EXACT_OUTPUTS], budget)
            for slot in busy:
                if slot.job is not None and not slot.job.generated:
                    budget = self._run([slot], budget)
        self.counters.step_s += time.perf_counter() - t0

    def _run(self, group: list[Slot], budget: int) -> int:
        """Build, decode and commit one batch for `group`. Returns the prefill budget left."""
        group = [s for s in group if s.job is not None]
        while True:
            t0 = time.perf_counter()
            plan = self._build(group, budget)
            if not plan:
                return budget
            if self.faults:
                self.faults.before_decode([slot.job.id for slot, _, _ in plan])
            t1 = time.perf_counter()
            ret = self._decode()
            self._copying.clear()  # llama_decode does the pending stream copies before anything else
            self.counters.decode_s += time.perf_counter() - t1
            if self.llama.batch.n > sum(n for _, n, _ in plan):  # padding rows (see _build and _build_padded)
                self._unpad(plan)
            if ret == 1 and budget > 1 and any(n > 1 for _, n, _ in plan):
                self.counters.decode_retries += 1
                budget //= 2  # no KV room for this batch: retry with a smaller prefill chunk (memory is unchanged)
                continue
            break
        c = self.counters  # (counted for the batch decoded, not for one built again after a KV-full retry)
        c.steps += 1
        c.batch_rows += self.llama.batch.n
        c.decode_rows += sum(1 for slot, _, _ in plan if slot.job.generated)
        c.prefill_rows += sum(n for slot, n, _ in plan if not slot.job.generated)
        c.spec_withheld += sum(1 for slot, _, _ in plan if slot.job.withheld)
        used = sum(n - 1 if slot.job.generated else n for slot, n, _ in plan)  # prompt and guessed rows
        if ret != 0:
            self._decode_failed(plan, ret)
            return budget - used
        rows, decode_only = self.llama.batch.n, not self.exact and all(slot.job.generated for slot, _, _ in plan)
        self._commit(plan)
        if decode_only:  # every row has logits and is sampled: what a guessed row adds to a step
            self.step_cost.observe(rows, time.perf_counter() - t0)
        return budget - used

    @staticmethod
    def _prefill_order(slots: list[Slot]) -> list[Slot]:
        """Who gets the step's prefill budget first: the prompt with the least left to compute (an agent's 50-token
        turn does not wait behind a cold 800-token prompt), except that one passed over PREFILL_PATIENCE_STEPS
        steps in a row goes before all of those, so that a stream of short prompts never starves a long one."""

        def key(slot: Slot) -> tuple[bool, int]:
            req: Request = slot.job
            return req.passed_over < PREFILL_PATIENCE_STEPS, len(req.prompt) - slot.n_tokens

        return sorted(slots, key=key)

    def _build(self, busy: list[Slot], budget: int) -> list[tuple[Slot, int, int]]:
        """Fill the batch: decode rows first, then prefill chunks. Returns (slot, tokens added, sampled row or -1)."""
        batch = self.llama.batch
        batch.clear()
        if self.exact and busy and busy[0].job.generated:  # (the generating group; see _step)
            return self._build_padded(busy)
        plan: list[tuple[Slot, int, int]] = []
        prefilling: list[Slot] = []
        decoding = sum(1 for slot in busy if slot.job.generated)
        rows = decoding  # decode rows and the guesses taken so far: a guess's cost depends on the step it joins
        for slot in busy:
            req: Request = slot.job
            if not req.generated:
                prefilling.append(slot)
                continue
            pos = slot.n_tokens
            row = batch.add(req.generated[-1], pos, slot.id, True)
            # (a seeded job takes no guesses here: rows verified together compute other numbers than one row alone)
            req.draft = self._guess(req, slot, budget, decoding, rows) if self.spec and not req.seeded else []
            for i, tok in enumerate(req.draft, 1):
                batch.add(tok, pos + i, slot.id, True)
            budget -= len(req.draft)
            rows += len(req.draft)
            plan.append((slot, 1 + len(req.draft), row))
        for slot in prefilling:  # (in _prefill_order)
            req = slot.job
            req.passed_over += 1  # (back to 0 below when it gets a chunk)
            if budget <= 0:
                continue
            start, end = slot.n_tokens, len(req.prompt)
            take = min(end - start, budget)
            if self.exact and 0 < end - start - take < EXACT_ROWS:
                take = end - start - EXACT_ROWS  # never leave a remainder too small to compute exactly
                if take < EXACT_ROWS:
                    continue  # not enough budget left this step for an exact chunk
            alone = req.seeded and not self.exact  # (its batch has no other slot's rows: _step)
            if (self.snapshots or alone) and start < end - 1:
                # stop one short of the end: so that a snapshot can be taken there; a seeded job's last prompt token is
                # then computed on its own, as it is when the rest of its prompt was cached (see the module docstring)
                take = min(take, end - 1 - start)
                if alone and take < min(end - 1 - start, ALONE_ROWS_MIN):
                    continue  # too little budget left this step to be worth a padded chunk
            last = start + take == end
            row = batch.add_run(req.prompt[start : start + take], start, slot.id, last)
            # a seeded job's chunk, padded: its KV is then what every such chunk computes (worker/llama.py); not at
            # the end of the slot's context, where the padding has no room
            rows = alone_rows(take)
            req.exact_chunk = alone and not last and self.copies and start + rows <= self.n_ctx
            for pos in range(start + take, start + rows) if req.exact_chunk else ():
                batch.add(PAD_TOKEN, pos, slot.id, False)
            plan.append((slot, take, row if last else -1))
            req.passed_over = 0
            budget -= take
        return plan

    def _build_padded(self, generating: list[Slot]) -> list[tuple[Slot, int, int]]:
        """Deterministic mode's decode batch: the slots from the first generating one to the last, in seq id order
        (llama.cpp puts only consecutive seq ids in one ubatch), have `pad` rows each: a generating slot its decode row,
        then guesses, then padding; any other slot padding after the tokens it holds."""
        batch = self.llama.batch
        plan: list[tuple[Slot, int, int]] = []
        mine = {s.id for s in generating}
        span = self.table.slots[min(mine) : max(mine) + 1]
        pad = max(2, -(-EXACT_ROWS // len(span)))
        guesses = EXACT_OUTPUTS - len(mine)  # rows with logits the batch has left for guesses
        for slot in span:
            pos, rows = slot.n_tokens, 0
            if slot.id in mine:
                req: Request = slot.job
                row = batch.add(req.generated[-1], pos, slot.id, True)
                req.draft = self._guess(req, slot, min(pad - 1, guesses)) if self.spec and guesses > 0 else []
                guesses -= len(req.draft)
                for i, tok in enumerate(req.draft, 1):
                    batch.add(tok, pos + i, slot.id, True)
                rows = 1 + len(req.draft)
                plan.append((slot, rows, row))
            for i in range(rows, pad):
                batch.add(PAD_TOKEN, pos + i, slot.id, False)
        return plan

    def _unpad(self, plan: list[tuple[Slot, int, int]]) -> None:
        """Remove the padding rows' KV: the positions after the real rows of every slot from the plan's first to its
        last (`_build_padded` pads the idle ones between too; `_build` pads a seeded job's chunk)."""
        rows = {slot.id: n for slot, n, _ in plan}
        for slot in self.table.slots[min(rows) : max(rows) + 1]:
            self.llama.seq_rm(slot.id, slot.n_tokens + rows.get(slot.id, 0), -1)  # (checked by the invariant)

    def _guess(self, req: Request, slot: Slot, budget: int, decoding: int = 0, rows: int = 0) -> list[int]:
        """Tokens to verify after the slot's decode row: within the step's budget, the slot's context, and what the
        job may still produce; none while the job's guesses are taken too rarely to pay in a step of `decoding`
        decode rows and `rows` rows so far (decoding 0: rows that cost nothing, deterministic mode's padding)."""
        if req.drafter is None:
            pool = self.pool.lookup(req.job.cache_salt) if self.pool else None
            req.drafter = Drafter(slot.tokens + req.generated[-1:], self.n_ctx + 1, self.cfg.spec_ngram, self.cfg.spec_max, pool)
        drafter = req.drafter
        limit = min(budget, self.n_ctx - 1 - slot.n_tokens, req.max_gen - len(req.generated) - 1)
        pays = not decoding or self.step_cost.pays(drafter.rate, decoding, rows, min(drafter.k, limit))
        req.withheld = not pays and drafter.shadow(limit)
        return [] if req.withheld else drafter.propose(limit)

    def _commit(self, plan: list[tuple[Slot, int, int]]) -> None:
        """The decode succeeded: record the tokens now in KV, check the invariant, sample the output rows."""
        for slot, n, _ in plan:
            req: Request = slot.job
            if req.generated:
                start = slot.n_tokens
                slot.tokens.append(req.generated[-1])
                slot.tokens.extend(req.draft)  # in KV now; the part the sampler does not take is removed below
                if self.exact and slot.n_exact == start:
                    slot.n_exact = slot.n_tokens  # computed in a padded batch: as a prompt pass would
            else:
                start = slot.n_tokens
                slot.tokens.extend(req.prompt[start : start + n])
                if (req.exact_chunk or (self.exact and n >= EXACT_ROWS)) and slot.n_exact == start:
                    slot.n_exact = slot.n_tokens
                if self.snapshots and slot.n_tokens == len(req.prompt) - 1:
                    slot.snapshot = Snapshot(slot.n_tokens, self.llama.state_get(slot.id))
        self._check([slot for slot, _, _ in plan])
        ctx = self.llama.ctx
        now = time.monotonic()
        for slot, _, row in plan:
            req = slot.job
            if row < 0 or req is None:  # mid-prompt chunk, or the job was ended by the invariant check
                continue
            assert req.sampler is not None  # freed only when the job ends
            if req.draft:
                self._verify(req, slot, row, now)
                continue
            tok, logprob = req.sampler.sample(ctx, row)
            self._on_token(req, slot, tok, now, logprob)

    def _verify(self, req: Request, slot: Slot, row: int, now: float) -> None:
        """The sampler takes the slot's rows in order while they agree with the guess (row i's logits follow the
        guess's first i tokens); the guessed tokens' KV after the first disagreement is removed."""
        draft, req.draft = req.draft, []
        assert req.sampler is not None and req.drafter is not None
        guide = req.sampler.guide
        picked: list[tuple[int, TokenLogprob | None, bool]] = []  # token, its log-probability, grammar complete after it
        for i in range(len(draft) + 1):
            tok, logprob = req.sampler.sample(self.llama.ctx, row + i)
            complete = guide is not None and guide.done  # the grammar allows nothing after this token
            picked.append((tok, logprob, complete))
            if complete or i == len(draft) or tok != draft[i]:
                break
        taken = len(picked) - 1
        keep = slot.n_tokens - (len(draft) - taken)
        self.counters.spec_proposed += len(draft)
        self.counters.spec_accepted += taken
        req.drafter.verified(len(draft), taken)
        if keep < slot.n_tokens:
            self._trim(slot, keep)
            if slot.n_tokens != keep:  # the trim failed and cleared the slot: this job's KV is gone
                error_id = uuid.uuid4().hex[:16]
                log.error("spec_trim_failed", error_id=error_id, slot=slot.id, keep=keep)
                message = f"could not remove rejected guesses from slot {slot.id} (error {error_id})"
                self._error(req, ErrorCode.INTERNAL, message, error_id)
                return
        for tok, logprob, complete in picked:
            self._on_token(req, slot, tok, now, logprob, complete)
            if slot.job is not req:  # the job ended (end of generation, a stop, its length)
                return

    def _on_token(
        self, req: Request, slot: Slot, tok: int, now: float, logprob: TokenLogprob | None = None, complete: bool | None = None
    ) -> None:
        """Take one sampled token. `complete`: whether the grammar was complete right after it (given by `_verify`,
        whose sampler has already gone through the later rows; otherwise read from the guide now)."""
        if not req.generated:
            req.t_first = now
        req.generated.append(tok)
        if req.drafter is not None:
            req.drafter.push(tok)
        self.counters.generated_tokens += 1
        if tok in self.vocab.eog_tokens and not req.job.sampling.ignore_eos:
            self._done(req, slot, FinishReason.STOP)
            return
        stream = req.stream
        text = stream.push(self.vocab.piece(tok))
        assert req.sampler is not None
        if complete is None:
            guide = req.sampler.guide
            complete = guide is not None and guide.done  # the grammar allows nothing more
        delta = JobDelta(id=req.id, text=text, tokens=pack_tokens([tok]), logprobs=[] if logprob is None else [logprob])
        if len(req.generated) == 1:
            delta.reused_tokens = req.reused
        if stream.stop is not None:
            self._send(req.sink, delta)
            self._done(req, slot, FinishReason.STOP)
        elif complete or len(req.generated) >= req.max_gen:
            delta.text += stream.flush()
            self._send(req.sink, delta)
            self._done(req, slot, FinishReason.STOP if complete else FinishReason.LENGTH)
        else:
            self._send(req.sink, delta)

    def _expire(self) -> None:
        """End running jobs that were cancelled or ran past their deadline; their slots keep the valid KV."""
        now = time.monotonic()
        for slot in self.table.busy():
            req: Request = slot.job
            if req.cancelled:
                self._flush_and_done(req, slot, FinishReason.CANCELLED)
            elif req.deadline is not None and now >= req.deadline:
                self._flush_and_done(req, slot, FinishReason.DEADLINE_EXCEEDED)

    def _flush_and_done(self, req: Request, slot: Slot, reason: FinishReason) -> None:
        text = req.stream.flush()
        if text:
            self._send(req.sink, JobDelta(id=req.id, text=text, tokens=b""))
        self._done(req, slot, reason)

    # -- endings --

    def _done(self, req: Request, slot: Slot, reason: FinishReason) -> None:
        now = time.monotonic()
        held = len(req.prompt) + len(req.generated)
        if slot.n_tokens > held:  # guessed tokens past where the job ended (it stopped mid-guess)
            self._trim(slot, held)
        t_first = req.t_first or now
        timings = Timings(
            queue_ms=(req.t_assigned - req.t_arrival) * MS,
            prefill_ms=(t_first - req.t_assigned) * MS,
            decode_ms=(now - t_first) * MS,
            ttft_ms=(t_first - req.t_arrival) * MS,
            total_ms=(now - req.t_arrival) * MS,
        )
        done = JobDone(
            id=req.id,
            slot=slot.id,
            finish_reason=reason.value,
            text=req.stream.full_text(),
            tokens=pack_tokens(req.generated),
            prompt_tokens=len(req.prompt),
            reused_tokens=req.reused,
            restored_tokens=req.restored,
            prefilled_tokens=len(req.prompt) - req.reused,
            generated_tokens=len(req.generated),
            slot_tokens=slot.n_tokens,
            slot_hash=token_hash(slot.tokens),
            slot_min_keep=self._min_keep(slot),
            slot_n_exact=slot.n_exact,
            timings=timings,
            stop=req.stream.stop,
        )
        if not req.silent:
            done.cache_added, done.cache_dropped, done.disk_dropped = self._cache_changes()
        if self.pool is not None:
            self.pool.add(req.job.cache_salt, req.generated)
        self._release(req, slot)
        self.counters.jobs_done += 1
        log.debug("job_done", request_id=req.id, slot=slot.id, finish=reason.value, generated=len(req.generated))
        self._send(req.sink, done, req.silent)

    def _error(self, req: Request, code: ErrorCode, message: str, error_id: str | None = None) -> None:
        """End a job with an error, reporting what its slot (if any) holds now."""
        slot = self.table[req.slot] if req.slot >= 0 else None
        msg = JobError(id=req.id, code=code, message=message, error_id=error_id)
        if not req.silent:
            msg.cache_added, msg.cache_dropped, msg.disk_dropped = self._cache_changes()
        if slot is not None:
            msg.slot, msg.slot_tokens, msg.slot_hash = slot.id, slot.n_tokens, token_hash(slot.tokens)
            msg.slot_min_keep, msg.slot_n_exact = self._min_keep(slot), slot.n_exact
            self._release(req, slot)
        else:
            self._forget(req)
        self.counters.jobs_failed += 1
        self._send(req.sink, msg, req.silent)

    def _cache_changes(self) -> tuple[list[CacheEntry], list[int], list[int]]:
        """The saved states added and dropped since the last report, for the router's index: added, dropped from host
        RAM, dropped from disk (an entry both added and dropped since then is left out)."""
        added, dropped = self.host.take_changes()
        gone, new = set(dropped), {e.id for e in added}
        out = [self._described(e) for e in added if e.id not in gone]
        dropped = [i for i in dropped if i not in new]
        events = self.disk.drain_events() if self.disk is not None else []
        disk_gone = {ev.entry_id for ev in events if not isinstance(ev, Added)}
        disk_new = {ev.entry_id for ev in events if isinstance(ev, Added)}
        out += [self._described(ev) for ev in events if isinstance(ev, Added) and ev.entry_id not in disk_gone]
        return out, dropped, sorted(disk_gone - disk_new)

    def _described(self, entry: Entry | DiskEntry | Added, with_tokens: bool = False) -> CacheEntry:
        """A saved state as the router is told of it: a host-RAM entry's tokens by reference to the slot they came
        from, or in full (a disk entry's always: its tokens may be from before this process)."""
        slot = entry.slot if isinstance(entry, Entry) and not with_tokens else -1
        return CacheEntry(
            id=entry.entry_id if isinstance(entry, Added) else entry.id,
            tier="ram" if isinstance(entry, Entry) else "disk",
            n_tokens=len(entry.tokens),
            hash=token_hash(entry.tokens),
            nbytes=entry.nbytes,
            n_exact=entry.n_exact,
            min_keep=self.llama.min_keep(entry.pos_min),
            slot=slot,
            tokens=pack_tokens(entry.tokens) if slot < 0 else b"",
            salt=entry.salt,
        )

    def _release(self, req: Request, slot: Slot) -> None:
        self.table.release(slot)
        self._forget(req)

    def _forget_id(self, job_id: str) -> None:
        req = self._by_id.get(job_id)
        if req is not None and req in self.waiting:
            self.waiting.remove(req)
        if req is not None:
            self._forget(req)

    def _forget(self, req: Request) -> None:
        self._by_id.pop(req.id, None)
        if req.sampler is not None:
            req.sampler.free()
            req.sampler = None

    def _send(self, sink: Sink, msg: Message, silent: bool = False) -> None:
        if silent:
            return
        try:
            sink(msg)
        except Exception:
            log.exception("sink_failed", message=type(msg).__name__)

    # -- failures --

    def _check(self, slots: list[Slot]) -> None:
        """The invariant: each slot's KV holds exactly len(slot.tokens) positions, and its sliding-window layers
        hold the whole window before the next one. A violation is a bug."""
        n_swa = self.llama.info.n_swa
        for slot in slots:
            held, floor = self.llama.seq_len(slot.id), self.llama.seq_pos_min(slot.id)
            if held == slot.n_tokens and floor <= max(0, held - n_swa + 1):
                continue
            error_id = uuid.uuid4().hex[:16]
            self.counters.invariant_violations += 1
            log.error("slot_invariant_violated", error_id=error_id, slot=slot.id, believed=slot.n_tokens, kv=held, kv_from=floor)
            believed = slot.n_tokens
            self._clear(slot)
            if slot.job is not None:
                self._error(
                    slot.job,
                    ErrorCode.INTERNAL,
                    f"slot {slot.id} believed it held {believed} tokens but its KV holds positions {floor}..{held - 1}; "
                    f"slot cleared (error {error_id})",
                    error_id,
                )

    def _decode_failed(self, plan: list[tuple[Slot, int, int]], ret: int) -> None:
        """llama_decode failed: put each affected slot back to what it held before, end its job with an error."""
        self.counters.decode_errors += 1
        error_id = uuid.uuid4().hex[:16]
        log.error("decode_failed", error_id=error_id, ret=ret, rows=self.llama.batch.n, slots=[s.id for s, _, _ in plan])
        for slot, _, _ in plan:
            if self.llama.seq_len(slot.id) != slot.n_tokens:  # ubatches processed before the failure are kept
                trimmed = not self.snapshots and self.llama.seq_rm(slot.id, slot.n_tokens, -1)
                if not trimmed or self.llama.seq_len(slot.id) != slot.n_tokens:
                    self._clear(slot)
            if slot.job is not None:
                self._error(slot.job, ErrorCode.INTERNAL, f"llama_decode failed with code {ret} (error {error_id})", error_id)

    def _fail_all(self, exc: Exception) -> None:
        error_id = uuid.uuid4().hex[:16]
        log.exception("engine_step_failed", error_id=error_id)
        for slot in self.table.busy():
            self._clear(slot)
            if slot.job is not None:
                message = f"engine error {type(exc).__name__}: {exc} (error {error_id})"
                self._error(slot.job, ErrorCode.INTERNAL, message, error_id)

    def _hand_back(self, running: bool) -> int:
        reqs = list(self.waiting)
        self.waiting.clear()
        if running:
            reqs += [slot.job for slot in self.table.busy() if slot.job is not None]
        for req in reqs:
            self._error(req, ErrorCode.DRAINING, "the worker is shutting down; this job was handed back")
        return len(reqs)

    def _forget_jobs(self) -> int:
        reqs = [*self.waiting, *(slot.job for slot in self.table.busy() if slot.job is not None)]
        for req in self.waiting:
            self._forget(req)
        self.waiting.clear()
        for slot in self.table.busy():
            if slot.job is not None:
                self._release(slot.job, slot)  # the slot keeps the KV its job computed
        for req in reqs:
            req.silent = True
        if reqs:
            log.info("jobs_forgotten", jobs=len(reqs), reason="the router does not know this worker any more")
        return len(reqs)

    def _reset(self) -> None:
        for req in list(self.waiting):
            req.silent = True
            self._forget(req)
        self.waiting.clear()
        for slot in self.table.slots:
            if slot.job is not None:
                slot.job.silent = True
                self._release(slot.job, slot)
            self._clear(slot)
        self.host.clear()
        log.info("slots_reset", slots=len(self.table))


def most_recent_within(host: list[Entry], disk: list[DiskEntry], budget: int) -> tuple[list[Entry | DiskEntry], int]:
    """The saved states a hello lists: host RAM's then the disk tier's, each most recently used first, while their
    tokens fit in `budget` bytes; and how many were left out."""
    ordered: list[Entry | DiskEntry] = [
        *sorted(host, key=lambda x: x.last_used, reverse=True),
        *sorted(disk, key=lambda x: x.last_used, reverse=True),
    ]
    listed: list[Entry | DiskEntry] = []
    for x in ordered:
        budget -= 4 * len(x.tokens) + ENTRY_OVERHEAD_BYTES
        if budget < 0:
            break
        listed.append(x)
    return listed, len(ordered) - len(listed)
