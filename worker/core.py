"""The compute core: the engine's work itself (admission, the step, commit, ends), run on the engine's thread
(worker/engine.py) and never touching the process's sockets (worker/main.py).

A step places waiting jobs on slots (worker/admission.py; their prefixes: worker/prefix.py), builds the step's
batches (worker/batching.py: one decode row for every generating slot first, then prefill chunks of the slots still
reading their prompt, up to `n_batch` prompt tokens, the prompt with the least left to compute first), decodes each,
commits what it computed and samples the rows that ask for it. Jobs join and leave between steps. Results go out
as protocol messages (JobDelta, then one JobDone or JobError: worker/job_ends.py) passed to the job's sink.

Priority (worker/batching.py `runnable`): while a job of higher priority runs, a step leaves the jobs of lower
priority out entirely, so that an interactive session is not slowed by background work on a small box. A paused job
keeps its slot and KV as they are (its padding rows, like an idle slot's, are removed after the decode), and its
cancel or deadline still ends it at the next step (`_expire` looks at every busy slot); the steps go on for the job
that runs, so the worker's progress does not stop. It is logged when it pauses and when it goes on (`job_paused`,
`job_resumed`). Paused PRIORITY_MAX_PAUSE_S in all, it is computed beside them until it ends (`Task.aged`).

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
llama-server gives them (issue 30), whatever its cache holds: cold, found whole or in part, in any slot, with `--spec`
on or off. The default kernels compute a row otherwise by the shape of its batch (measured: bench/exact_shapes.py),
so a seeded job keeps to shapes that do not change: (1) no guesses (rows verified together are computed with other
kernels than one row alone: up to 1 in a logit, 1-5 % of the next token's probability mass at temperature 1, and what
is guessed depends on earlier jobs' outputs and on step timings); (2) its prompt in llama_decodes of its own (a few
rows of another prompt beside a chunk changed its KV), in chunks padded as worker/llama.py `alone_rows` says, whose
KV does not depend on where a chunk starts or ends; (3) its last prompt token alone, or beside other slots' decode rows
only (as its own decode rows are: see below). Only KV so computed is reused for
a seeded job (`Slot.n_exact`: the seeded prompts' tokens, not their last token nor the reply), from its slot, another
slot, host RAM or disk. Its decode rows then go in the step's batch beside the other slots' rows: with other jobs
generating at the same time its tokens may differ (a row leading a batch of several slots, in a slot holding 256+
cells, takes another flash attention path than one row alone); deterministic mode gives the same tokens then too,
its kernels costing every job and its padding every generating step. What the seed path costs: bench/README.md "What
a seed costs". A chunk within a padded chunk's length of the end of its slot's context has no room for its padding
and is computed without (and not counted in `n_exact`): such a prompt's tokens may differ from run to run.

Speculation (`--spec auto|ngram`, worker/speculate.py): a generating slot's row may be followed by rows of guessed
tokens; its sampler takes the rows in order while they agree with the guess, and the KV of the guessed tokens it
did not take is removed before anything else happens (so the invariant below holds after every step).

A memory that cannot be cut back to any prefix (recurrent, hybrid; a window cache of its window alone): its slots take
context checkpoints (worker/checkpoints.py) once a prompt chunk, which ends there, is committed (a full window cache's
slots take a few too, for the states they save: worker/checkpoints.py `for_saves`); nothing of such a
slot is padded (padding could not be removed), so in deterministic mode each of its generating rows is decoded alone
and only its prompt tokens count in `n_exact`; guesses are verified only where llama.cpp can take a recurrent state
back (ROLLBACK positions).

Invariant (checked after every decode, and before building a batch): for every slot,
`llama_memory_seq_pos_max(slot) + 1 == len(slot.tokens)` (fewer after an M-RoPE image, whose rows share a position:
worker/slots.py `held_end`), and its memory's lowest position is what it keeps
(worker/llama.py `holds`). A violation is counted, logged with an id, reported to the slot's job as an `internal`
error carrying that id, and the slot is cleared (worker/failures.py, as a failed decode and a bug in a step are).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import msgspec

from common import logs
from common.media import image_n_pos
from common.model import resolve_model
from common.projector import EncodedImage, Projector, ProjectorError
from common.slots import EXACT_ROWS
from protocol import (
    EngineCounters,
    ErrorCode,
    FinishReason,
    Job,
    JobDelta,
    JobError,
    TokenLogprob,
    pack_tokens,
)
from worker import state_copies
from worker.admission import Admission
from worker.batching import Batcher, Planned
from worker.checkpoints import FOR_SAVES_MAX, Budget
from worker.config import WorkerConfig
from worker.context_size import host_tier_mb
from worker.embed_jobs import EmbedJobs
from worker.embedder import Embedder
from worker.failures import Failures, new_error_id
from worker.faults import Faults
from worker.guide import GuideTokenizer
from worker.images import Encoder, Encodings, ImageRows
from worker.job_ends import JobEnds, send
from worker.llama import Llama
from worker.pace import PrefillPace, Urgency
from worker.prefix import Prefixes
from worker.saved_states import SavedStates, open_disk_tier
from worker.slots import Slot, SlotTable
from worker.speculate import Drafter, OutputPool, StepCost
from worker.task import PRIORITY_MAX_PAUSE_S, Sink, Task, runnable, top_priority

log = logs.get(__name__)

# speculation on a recurrent or hybrid model: guesses per step at most, as llama.cpp keeps that many more copies of each
# slot's recurrent state to take rejected ones back (n_rs_seq; qwen35, nemotron_h, lfm2 and their MoE forms)
ROLLBACK = 4

Counters = EngineCounters  # (protocol/worker_messages.py: they cross to the router with every heartbeat)


class EngineCore:
    """Continuous batching over the slots of one llama context; every method on the compute thread."""

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
            swa_full=cfg.swa_full,
            rollback=ROLLBACK if cfg.spec != "none" and not cfg.deterministic else 0,
        )
        self.vocab = self.llama.vocab
        # images: encoded with the model's projector on a thread of its own, their rows decoded on their own (`_images`)
        self.projector = (
            Projector(cfg.mmproj, self.llama.model, threads=cfg.threads, use_gpu=cfg.gpu is not None) if cfg.mmproj else None
        )
        if self.projector is not None and self.projector.mrope and self.llama.info.n_swa > 0:
            self.projector.close()  # (where a sliding window's cut meets positions lagging behind indexes: not built)
            raise ProjectorError(
                f"--mmproj {cfg.mmproj}: this model has sliding-window layers and places image rows with M-RoPE; "
                "kvroute does not serve the two together"
            )
        # an image's encode ended, or an embedder was made, on their threads (worker/engine.py wakes its thread)
        self.wake: Callable[[], None] = lambda: None
        self.encodings = (
            Encodings(Encoder(self.projector, self.llama.rows, lambda: self.wake())) if self.projector is not None else None
        )
        self.guide_tokenizer = GuideTokenizer(self.vocab)  # built on its own thread, ready long before a grammar is
        self.n_ctx = self.llama.ctx_per_slot
        self.n_batch = cfg.n_batch
        self.pace = PrefillPace(cfg.n_batch, cfg.step_target_ms / 1000)
        self.urgency = Urgency()
        info = self.llama.info
        self.uncut = cfg.snapshots or info.recurrent  # the memory cannot be cut back: only to a context checkpoint
        # slots take context checkpoints where their memory cannot be cut back to any prefix (worker/checkpoints.py);
        # with a full window cache only for the states they save: those hold their window layers' last window alone
        checkpointed = self.uncut or (info.n_swa > 0 and not info.swa_full)
        host_mb = host_tier_mb() if cfg.host_cache_mb is None else cfg.host_cache_mb  # (`serve` shares it among its workers)
        for_saves = not checkpointed and info.n_swa > 0 and host_mb > 0
        budget = None
        if (checkpointed or for_saves) and cfg.ctx_checkpoints > 0:
            count = min(cfg.ctx_checkpoints, FOR_SAVES_MAX) if for_saves else cfg.ctx_checkpoints
            budget = Budget(count, cfg.checkpoint_slot_mb * 2**20, cfg.checkpoint_mb * 2**20)
        memory = f"swa_full={info.swa_full};uncut={self.uncut}"  # (what saved states hold: files must match it)
        disk = open_disk_tier(cfg, self.vocab, memory, self.entry_min_keep)
        self.saved = SavedStates(host_mb * 2**20, disk, self.entry_min_keep)
        self.host, self.disk = self.saved.host, self.saved.disk
        self.exact = cfg.deterministic
        if self.exact:
            self.n_ctx -= EXACT_ROWS  # room for the most rows a slot takes in a decode batch (worker/batching.py)
        # guesses are verified in the slot's own rows and the rejected ones' KV removed (needs seq_rm); in
        # deterministic mode they take a slot's padding rows. A recurrent state is taken back by `rollback` positions at
        # most, where llama.cpp keeps that many copies of it (not in deterministic mode: no padding there)
        self.rollback = self.llama.rollback if self.uncut and not cfg.snapshots else 0
        self.spec = cfg.spec != "none" and (not self.uncut or (self.rollback > 0 and not self.exact))
        self.step_cost = StepCost()  # what a guessed row costs in a step: whether a job's guesses pay
        self.pool = OutputPool(cfg.spec_ngram) if self.spec else None  # recent outputs, guesses across requests
        if cfg.spec == "ngram" and not self.spec:
            log.warning("speculation_off", reason="this model's memory cannot be trimmed (recurrent or hybrid)")
        self.table = SlotTable(cfg.slots, mrope=self.projector is not None and self.projector.mrope)
        self.counters = Counters()
        self.prefixes = Prefixes(
            self.llama,
            self.table,
            self.saved,
            self.counters,
            exact=self.exact,
            uncut=self.uncut,
            budget=budget,
            for_saves=for_saves,
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            every=cfg.checkpoint_every,
        )
        self.prefixes.rollback = self.rollback
        self.admission = Admission(self.vocab, self.guide_tokenizer, self.table, self.prefixes, self.counters, self.n_ctx)
        self.admission.vision = self.projector is not None
        self.batcher = Batcher(self.llama.batch, self.table.slots, self.n_ctx, self.exact, self.uncut, self._guess)
        self._decode = self.llama.decode  # tests replace this to inject failures
        self.faults = Faults.from_env()  # failpoints of the fault tests; none unless KVROUTE_FAULTS is set
        if self.faults:
            log.warning("fault_injection_on", faults=self.faults.rules)
        self.progress = 0  # steps completed; a worker whose progress stops while it has jobs is hung
        llama = self.llama  # embed jobs, one input between two steps (worker/engine.py's loop runs them)
        self.embeds = EmbedJobs(
            lambda pooling: Embedder(llama.model, pooling, cfg.threads, llama.n_ctx_train), wake=lambda: self.wake()
        )
        self.ends = JobEnds(self.table, self.admission, self.prefixes, self.saved, self.embeds, self.counters)
        self.failures = Failures(self.llama, self.table, self.prefixes, self.ends, self.counters, self.uncut)

    def entry_min_keep(self, pos_min: int, n: int) -> int:
        """The shortest prefix a saved state of `n` tokens can be cut to (worker/prefix.py)."""
        return n if self.uncut else self.llama.min_keep(pos_min, n)

    def take(self, job: Job, sink: Sink, t_arrival: float) -> None:
        """A job arrived: queue it, or answer it with an error. A state another worker saved that comes with it goes to
        this worker's host-RAM tier first (worker/state_copies.py)."""
        copied, job = job.state, msgspec.structs.replace(job, state=None) if job.state is not None else job
        try:
            refused = self.admission.accept(job, sink, t_arrival)
            if refused is None and copied is not None and not state_copies.keep(self.host, copied):
                log.info("state_copy_not_kept", request_id=job.id, nbytes=len(copied.data))
        except Exception as exc:  # a bug met by one job: that job fails with an id, the worker goes on
            error_id = new_error_id()
            log.exception("job_accept_failed", error_id=error_id, request_id=job.id)
            self.admission.forget_id(job.id)
            message = f"the worker could not start this job: {type(exc).__name__}: {exc} (error {error_id})"
            refused = JobError(id=job.id, code=ErrorCode.INTERNAL, message=message, error_id=error_id)
        if refused is not None:
            send(sink, refused)
            self.counters.jobs_failed += 1

    def cancel(self, job_id: str, preempt: bool = False) -> None:
        """Stop a job; `preempt`: hand it back if it has not sampled a token yet, else suspend it where it can be resumed
        exactly (`_expire`; not in deterministic mode, whose exactness a prompt pass over its output would not keep), or
        let it run on."""
        if preempt:
            self.admission.preempt(job_id, suspend=not self.exact)
        elif (parked := self.admission.parked.get(job_id)) is not None:  # (no step may come for it: it ends now)
            self.ends.error(parked, ErrorCode.CANCELLED, "job cancelled while suspended")
        elif not self.embeds.cancel(job_id):
            self.admission.cancel(job_id)

    def step(self) -> None:
        """One step; a bug fails the running jobs and keeps the worker alive."""
        try:
            self._step()
        except Exception as exc:
            self.failures.step_failed(exc)
        self.progress += 1

    def idle(self) -> bool:
        return not self.admission.waiting and not self.table.busy() and not self.embeds

    def waiting_for_embedder(self) -> bool:
        """Whether the only work left waits for an embedder being made on its thread (which wakes the engine's)."""
        return not self.admission.waiting and not self.table.busy() and self.embeds.waiting_for_embedder()

    def waiting_for_images(self) -> bool:
        """Whether the slots this step would compute all wait for their image's encode (and no embed job waits but for
        its embedder): a step then has nothing to compute until one ends (it wakes the engine's thread) or a deadline
        passes."""
        if self.encodings is None or not self.encodings.pending:
            return False
        if self.embeds and not self.embeds.waiting_for_embedder():
            return False
        return self.encodings.waiting_only([s.id for s in runnable(self.table.busy())])

    def close(self) -> bool:
        """Stop the image encoder's thread, waiting a moment at most for an encode under way; whether it has ended (if
        not, the model must be left to the process's exit: the encode reads it)."""
        return self.encodings is None or self.encodings.close()

    # -- the step --

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._expire()
        for task, code in self.admission.expired():
            self.ends.error(task, code, f"job {code.value} while {'suspended' if task.generated else 'waiting for a slot'}")
        placed = self.admission.admit()
        if placed:
            self.ends.saved_changed(placed[-1])
        if self.encodings is not None:  # (images of jobs that ended meanwhile: cancel, deadline, failure, hand-back)
            self.encodings.drop_ended(lambda i: self.table[i].task)
        busy = self.table.busy()
        if not busy:
            return
        self.failures.check(busy)
        if self.projector is not None:
            self._images(runnable(self.table.busy()))
        running = self._runnable()
        top, now = top_priority(running), time.monotonic()
        self.urgency.ran(top, now)
        # (while a job generates, or one of higher priority may come back, a step's prompt work is paced: worker/pace.py)
        generating = any(s.task.generated for s in running)
        budget = first = self.n_batch if self.exact else self.pace.budget(generating, self.urgency.hurry(top, now))
        t1 = time.perf_counter()
        for group in self.batcher.groups(running):  # (one llama_decode each: worker/batching.py)
            left = self._run(group.slots, budget)
            budget = left if group.budgeted else budget
        self.pace.measured(first - budget, time.perf_counter() - t1)
        self.counters.step_s += time.perf_counter() - t0

    def _runnable(self) -> list[Slot]:
        """The busy slots this step computes (worker/batching.py `runnable`); the jobs it leaves out for one of higher
        priority are paused, logged when they pause and when they go on."""
        busy = self.table.busy()
        running = runnable(busy)
        if len(running) == len(busy) and not any(s.task.paused for s in busy):
            return running
        now = time.monotonic()
        for slot in busy:
            task: Task = slot.task
            if task.paused_at and task.paused_s + now - task.paused_at >= PRIORITY_MAX_PAUSE_S:
                task.aged = True  # (paused long enough: it runs beside them until it ends)
                running = runnable(busy)
        top = top_priority(busy)
        for slot in busy:
            task = slot.task
            if slot in running:
                if task.paused:
                    task.paused_s += now - task.paused_at
                    log.info(
                        "job_resumed", request_id=task.id, slot=slot.id, priority=task.priority, paused_steps=task.paused,
                        paused_s=round(task.paused_s, 3), aged=task.aged,
                    )  # fmt: skip
                    task.paused, task.paused_at = 0, 0.0
                continue
            if not task.paused:
                log.info("job_paused", request_id=task.id, slot=slot.id, priority=task.priority, running_priority=top)
                task.paused_at = now
            task.paused += 1
            self.counters.paused_steps += 1
        return running

    def _images(self, slots: list[Slot]) -> None:
        """The images of prefilling slots' prompts (worker/images.py): an encode started for each slot whose prompt has
        an image next, on the encoder's thread, while the other slots step on (this slot gets no rows meanwhile:
        worker/batching.py `_chunk`); once it has ended, the image's rows decoded on their own before the step's
        batches: whole where they attend to each other (Gemma 3's), else n_batch rows a step (`_image_rows`); the text
        after it goes in the batches once it is whole."""
        assert self.projector is not None and self.encodings is not None
        encodings = self.encodings
        for slot in slots:
            task = slot.task
            while task is not None and not task.generated:
                if slot.id in encodings.parts:
                    if not self._image_rows(slot, task):
                        break  # (rows left for the next step)
                    task = slot.task
                    continue
                if (image := task.images.get(slot.n_tokens)) is None:
                    break
                start = slot.n_tokens
                if slot.id not in encodings.pending:
                    encodings.start(slot.id, task, start, image.data)
                enc = encodings.take(slot.id)
                if enc is None:
                    break  # (still encoding: the slot gets no rows this step)
                try:
                    encoded: EncodedImage = enc.future.result()
                except (ProjectorError, RuntimeError) as exc:  # (nothing of the image was decoded: the slot is as it was)
                    code = ErrorCode.BAD_REQUEST if isinstance(exc, ProjectorError) else ErrorCode.INTERNAL
                    self.ends.error(task, code, f"image at prompt position {start}: {exc}")
                    break
                self.counters.images_encoded += 1
                self.counters.image_encode_s += encoded.encode_s
                log.info(
                    "image_encoded",
                    request_id=task.id,
                    slot=slot.id,
                    rows=encoded.n_tokens,
                    encode_ms=round(1e3 * encoded.encode_s, 1),
                )
                n, n_pos = encoded.n_tokens, image_n_pos(task.prompt, start, image.n_tokens)
                try:
                    if enc.start != start:  # (not possible while the job holds its slot; its rows are not these)
                        raise RuntimeError(f"an image encoded for position {enc.start} came at {start}")
                    if (n, encoded.n_pos) != (image.n_tokens, n_pos):  # the router counted otherwise: nothing decoded
                        self.counters.invariant_violations += 1
                        raise RuntimeError(
                            f"the image takes {n} rows and {encoded.n_pos} positions here, the job said "
                            f"{image.n_tokens} and {n_pos}"
                        )
                    if n > self.n_batch and self.projector.causal(encoded):
                        encodings.parts[slot.id] = ImageRows(task, start, encoded, n_pos)
                        slot.took_image(start, n, n_pos)  # (its span: positions after its rows, as they come)
                        continue
                    advanced = self.projector.decode_image(self.llama.ctx, encoded, slot.pos(start), slot.id, self.llama.rows)
                    if advanced != n_pos:
                        raise RuntimeError(f"the image advanced {advanced} positions, not {n_pos}")
                except (ProjectorError, RuntimeError) as exc:
                    encoded.free()
                    self.prefixes.clear(slot)  # (what of the image was decoded is not known)
                    code = ErrorCode.BAD_REQUEST if isinstance(exc, ProjectorError) else ErrorCode.INTERNAL
                    self.ends.error(task, code, f"image at prompt position {start}: {exc}")
                    break
                encoded.free()
                self._took_rows(slot, task, start, n)
                slot.took_image(start, n, n_pos)
                self.failures.check([slot])
                task = slot.task

    def _image_rows(self, slot: Slot, task: Task) -> bool:
        """The next n_batch rows of the slot's causal image (worker/images.py `ImageRows`), decoded on their own: the
        same parts every time, so that they are exact as prompt chunks are. Whether the image is whole now (or its job
        failed)."""
        assert self.projector is not None and self.encodings is not None
        part = self.encodings.parts[slot.id]
        n = min(self.n_batch, part.encoded.n_tokens - part.done)
        at = part.start + part.done
        try:
            if slot.n_tokens != at:  # (not possible while the job holds its slot)
                raise RuntimeError(f"the image's rows {part.done}.. were to go at {at}, the slot holds {slot.n_tokens}")
            self.projector.decode_rows(self.llama.ctx, part.encoded, slot.pos(part.start), slot.id, part.done, n)
        except RuntimeError as exc:
            del self.encodings.parts[slot.id]
            part.encoded.free()
            self.prefixes.clear(slot)  # (what of the image was decoded is not known)
            self.ends.error(task, ErrorCode.INTERNAL, f"image at prompt position {part.start}: {exc}")
            return True
        self._took_rows(slot, task, at, n)
        part.done += n
        self.failures.check([slot])
        if part.done < part.encoded.n_tokens:
            return False
        del self.encodings.parts[slot.id]
        part.encoded.free()
        return True

    def _took_rows(self, slot: Slot, task: Task, start: int, n: int) -> None:
        """An image's rows start..start+n-1 are in the slot's KV now."""
        slot.tokens.extend(task.prompt[start : start + n])
        if slot.n_exact == start:  # (decoded alone, the same way every time: exact, as a prompt chunk is)
            slot.n_exact = slot.n_tokens
        self.counters.prefill_rows += n
        self.counters.image_rows += n

    def _run(self, group: list[Slot], budget: int) -> int:
        """Build, decode and commit one batch for `group`. Returns the prefill budget left."""
        group = [s for s in group if s.task is not None]
        while True:
            t0 = time.perf_counter()
            plan = self.batcher.build(group, budget)
            if not plan:
                return budget
            if self.faults:
                self.faults.before_decode([slot.task.id for slot, _, _ in plan])
            t1 = time.perf_counter()
            ret = self._decode()
            self.prefixes.copying.clear()  # llama_decode does the pending stream copies before anything else
            self.counters.decode_s += time.perf_counter() - t1
            for seq, pos in self.batcher.padding(plan):  # the padding rows' KV goes
                self.llama.seq_rm(seq, pos, -1)  # (checked by the invariant)
            if ret == 1 and budget > 1 and any(n > 1 for _, n, _ in plan):
                self.counters.decode_retries += 1
                budget //= 2  # no KV room for this batch: retry with a smaller prefill chunk (memory is unchanged)
                continue
            break
        c = self.counters  # (counted for the batch decoded, not for one built again after a KV-full retry)
        c.steps += 1
        c.batch_rows += self.llama.batch.n
        c.decode_rows += sum(1 for slot, _, _ in plan if slot.task.generated)
        c.prefill_rows += sum(n for slot, n, _ in plan if not slot.task.generated)
        c.spec_withheld += sum(1 for slot, _, _ in plan if slot.task.withheld)
        used = sum(n - 1 if slot.task.generated else n for slot, n, _ in plan)  # prompt and guessed rows
        if ret != 0:
            self.failures.decode_failed(plan, ret)
            return budget - used
        rows, decode_only = self.llama.batch.n, not self.exact and all(slot.task.generated for slot, _, _ in plan)
        self._commit(plan)
        if decode_only:  # every row has logits and is sampled: what a guessed row adds to a step
            self.step_cost.observe(rows, time.perf_counter() - t0)
        return budget - used

    def _guess(self, task: Task, slot: Slot, budget: int, decoding: int = 0, rows: int = 0) -> list[int]:
        """Tokens to verify after the slot's decode row: within the step's budget, the slot's context, and what the
        job may still produce; none while the job's guesses are taken too rarely to pay in a step of `decoding`
        decode rows and `rows` rows so far (decoding 0: rows that cost nothing, deterministic mode's padding)."""
        if not self.spec:
            return []
        if task.drafter is None:
            pool = self.pool.lookup(task.job.cache_salt) if self.pool else None
            task.drafter = Drafter(
                slot.tokens + task.generated[-1:], self.n_ctx + 1, self.cfg.spec_ngram, self.cfg.spec_max, pool
            )
        drafter = task.drafter
        limit = min(budget, self.n_ctx - 1 - slot.n_tokens, task.max_gen - len(task.generated) - 1)
        if self.uncut:
            limit = min(limit, self.rollback)  # (a recurrent state is taken back this far at most)
        pays = not decoding or self.step_cost.pays(drafter.rate, decoding, rows, min(drafter.k, limit))
        task.withheld = not pays and drafter.shadow(limit)
        return [] if task.withheld else drafter.propose(limit)

    def _commit(self, plan: list[Planned]) -> None:
        """The decode succeeded: record the tokens now in KV, check the invariant, sample the output rows."""
        for slot, n, _ in plan:
            task: Task = slot.task
            if task.generated:
                start = slot.n_tokens
                slot.tokens.append(task.generated[-1])
                slot.tokens.extend(task.draft)  # in KV now; the part the sampler does not take is removed below
                if self.exact and not self.uncut and slot.n_exact == start:
                    slot.n_exact = slot.n_tokens  # computed in a padded batch: as a prompt pass would
            else:
                start = slot.n_tokens
                slot.tokens.extend(task.prompt[start : start + n])
                if (task.exact_chunk or (self.exact and n >= EXACT_ROWS)) and slot.n_exact == start:
                    slot.n_exact = slot.n_tokens
                if slot.n_tokens in task.checkpoint_at:
                    self.prefixes.checkpoint(slot)
        self.failures.check([slot for slot, _, _ in plan])
        ctx = self.llama.ctx
        now = time.monotonic()
        for slot, _, row in plan:
            task = slot.task
            if row < 0 or task is None:  # mid-prompt chunk, or the job was ended by the invariant check
                continue
            assert task.sampler is not None  # freed only when the job ends
            if task.draft:
                self._verify(task, slot, row, now)
                continue
            tok, logprob = task.sampler.sample(ctx, row)
            self._on_token(task, slot, tok, now, logprob)

    def _verify(self, task: Task, slot: Slot, row: int, now: float) -> None:
        """The sampler takes the slot's rows in order while they agree with the guess (row i's logits follow the
        guess's first i tokens); the guessed tokens' KV after the first disagreement is removed."""
        draft, task.draft = task.draft, []
        assert task.sampler is not None and task.drafter is not None
        guide = task.sampler.guide
        picked: list[tuple[int, TokenLogprob | None, bool]] = []  # token, its log-probability, grammar complete after it
        for i in range(len(draft) + 1):
            tok, logprob = task.sampler.sample(self.llama.ctx, row + i)
            complete = guide is not None and guide.done  # the grammar allows nothing after this token
            picked.append((tok, logprob, complete))
            if complete or i == len(draft) or tok != draft[i]:
                break
        taken = len(picked) - 1
        keep = slot.n_tokens - (len(draft) - taken)
        self.counters.spec_proposed += len(draft)
        self.counters.spec_accepted += taken
        task.drafter.verified(len(draft), taken)
        if keep < slot.n_tokens:
            self.prefixes.unguess(slot, keep)
            if slot.n_tokens != keep:  # the trim failed and cleared the slot: this job's KV is gone
                error_id = new_error_id()
                log.error("spec_trim_failed", error_id=error_id, slot=slot.id, keep=keep)
                message = f"could not remove rejected guesses from slot {slot.id} (error {error_id})"
                self.ends.error(task, ErrorCode.INTERNAL, message, error_id)
                return
        for tok, logprob, complete in picked:
            self._on_token(task, slot, tok, now, logprob, complete)
            if slot.task is not task:  # the job ended (end of generation, a stop, its length)
                return

    def _on_token(
        self, task: Task, slot: Slot, tok: int, now: float, logprob: TokenLogprob | None = None, complete: bool | None = None
    ) -> None:
        """Take one sampled token. `complete`: whether the grammar was complete right after it (given by `_verify`,
        whose sampler has already gone through the later rows; otherwise read from the guide now)."""
        if not task.generated and not task.earlier:
            task.t_first = now
        task.generated.append(tok)
        if task.drafter is not None:
            task.drafter.push(tok)
        self.counters.generated_tokens += 1
        if tok in self.vocab.eog_tokens and not task.job.sampling.ignore_eos:
            self._done(task, slot, FinishReason.STOP)
            return
        stream = task.stream
        text = stream.push(self.vocab.piece(tok))
        assert task.sampler is not None
        if complete is None:
            guide = task.sampler.guide
            complete = guide is not None and guide.done  # the grammar allows nothing more
        delta = JobDelta(id=task.id, text=text, tokens=pack_tokens([tok]), logprobs=[] if logprob is None else [logprob])
        if len(task.generated) == 1 and not task.earlier:
            delta.reused_tokens = task.reused
        if stream.stop is not None:
            send(task.sink, delta)
            self._done(task, slot, FinishReason.STOP)
        elif complete or len(task.generated) >= task.max_gen:
            delta.text += stream.flush()
            send(task.sink, delta)
            self._done(task, slot, FinishReason.STOP if complete else FinishReason.LENGTH)
        else:
            send(task.sink, delta)

    def _expire(self) -> None:
        """End running jobs that were cancelled or ran past their deadline, hand back those preempted before their first
        token and suspend those preempted after it; their slots keep the valid KV."""
        now = time.monotonic()
        for slot in self.table.busy():
            task: Task = slot.task
            if task.cancelled:  # (before a preemption: the client's end is the job's)
                self._flush_and_done(task, slot, FinishReason.CANCELLED)
            elif task.preempt and not task.generated:
                self.ends.error(task, ErrorCode.PREEMPTED, "handed back before its first token for a job of higher priority")
            elif task.preempt:
                self.ends.suspend(task, slot)
            elif task.deadline is not None and now >= task.deadline:
                self._flush_and_done(task, slot, FinishReason.DEADLINE_EXCEEDED)

    def _flush_and_done(self, task: Task, slot: Slot, reason: FinishReason) -> None:
        text = task.stream.flush()
        if text:
            send(task.sink, JobDelta(id=task.id, text=text, tokens=b""))
        self._done(task, slot, reason)

    # -- endings (worker/job_ends.py) and failures (worker/failures.py) --

    def _done(self, task: Task, slot: Slot, reason: FinishReason) -> None:
        if self.pool is not None:  # (recent outputs: guesses across requests)
            self.pool.add(task.job.cache_salt, task.output)
        self.ends.done(task, slot, reason)

    def _hand_back(self, running: bool) -> int:
        return self.ends.hand_back(running)

    def forget_jobs(self, only: Collection[str] | None = None) -> int:
        """End jobs (every one, or those `only` names) without a word; their slots keep the KV they computed."""
        return self.ends.forget(only)

    def _reset(self) -> None:
        self.ends.reset()
