"""Messages between the router's worker socket (ROUTER, bound) and workers (DEALER, identity = worker id)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol.chat import TokenLogprob
from protocol.client_messages import MAX_GRAMMAR_CHARS, RequestId
from protocol.common import DeadlineMs, Message, NonNeg, Overflow, Priority, Sampling, Struct, Timings, TokenBytes
from protocol.tokens import check_token_bytes

WorkerId = Annotated[str, Meta(min_length=1, max_length=64)]
CacheSalt = Annotated[str, Meta(max_length=64)]  # a digest of the client's cache_salt, never the salt itself


# ---- worker -> router -------------------------------------------------------------------------


class SlotHeld(Struct, kw_only=True):
    """What one slot's KV holds, as a worker that outlived its router reports it in `hello`."""

    slot: NonNeg
    tokens: TokenBytes  # exactly the tokens whose KV the slot holds, in position order
    n_exact: NonNeg = 0  # deterministic mode: leading tokens whose KV was computed as prompt
    salt: CacheSalt = ""  # the tenant whose prompt it holds (Job.cache_salt)
    min_keep: NonNeg = 0  # shortest prefix the slot can be cut to (a restored state's sliding-window layers)
    cuts: list[NonNeg] = []  # shorter prefixes it can also be cut to: its context checkpoints (CacheEntry.cuts)

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class CacheEntry(Struct, kw_only=True):
    """An entry of a worker's cache of saved slot states (host RAM, or disk), which the router indexes like a slot:
    a prompt sharing a prefix with it can have it restored into a slot instead of computing it.

    Its tokens are not sent again when the router knows them: an entry made from the contents a slot held before its
    current job names that `slot` (the router's mirror has them; `hash` checks it). Otherwise (`hello`, the disk
    tier) `tokens` carries them."""

    id: NonNeg  # unique within the worker process and its tier
    tier: Literal["ram", "disk"] = "ram"
    n_tokens: NonNeg
    hash: str  # token_hash() of its tokens
    nbytes: NonNeg  # size of the saved state (a restore copies this much)
    n_exact: NonNeg = 0  # deterministic mode: leading tokens whose KV was computed as prompt
    min_keep: NonNeg = 0  # shortest prefix a restore can keep (sliding-window layers hold only their last window; a
    # recurrent state: all of it, n_tokens)
    cuts: list[NonNeg] = []  # ascending: prefixes below min_keep it can be cut to (context checkpoints, PROTOCOL.md)
    slot: int = -1  # the slot whose previous contents it holds (-1: see tokens)
    tokens: TokenBytes = b""
    salt: CacheSalt = ""  # the tenant whose prompt it holds

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class Hello(Message, tag="hello", kw_only=True):
    """First message of a worker; repeated until `accept` or `refuse` arrives."""

    worker_id: WorkerId
    incarnation: NonNeg  # grows each time this worker id starts; a new one means empty slots
    slots: Annotated[int, Meta(ge=1, le=256)]
    ctx_per_slot: Annotated[int, Meta(ge=1)]
    model_fingerprint: str
    device: str  # "cpu" or "cuda:0" ...
    kv_bytes: NonNeg = 0  # KV memory reserved for all slots
    host_cache_bytes: NonNeg = 0  # host RAM it saves what a job overwrites in (0: none), to restore it when asked
    n_batch: NonNeg = 0
    deterministic: bool = False
    pid: NonNeg = 0
    weights_fingerprint: str = ""  # of the model file's tensors; must equal the router's when both are given
    held: list[SlotHeld] | None = None  # what the slots hold (a worker that outlived its router); None: unknown
    cached: list[CacheEntry] = []  # its cache of saved states, tokens included (none when `held` is None)
    model: str = ""  # the router's name of the model it serves (several served); "": the one its fingerprint names


class SlotState(Struct, kw_only=True):
    slot: NonNeg
    busy: bool
    n_tokens: NonNeg
    job_id: str | None = None


class EngineCounters(Struct, kw_only=True):
    """A worker engine's monotonic counters (written by its compute thread) and, last, three gauges: the router's
    per-worker metrics. On the wire a map of numbers by field name (ints, or floats); a name this router does not
    know is ignored."""

    steps: int | float = 0
    batch_rows: int | float = 0
    decode_rows: int | float = 0
    prefill_rows: int | float = 0
    image_rows: int | float = 0  # of prefill_rows: images' rows, encoded by the projector and decoded on their own
    images_encoded: int | float = 0  # images the projector encoded
    image_encode_s: float = 0.0  # the time their encodes took (on a thread beside the steps)
    reused_tokens: int | float = 0
    prefilled_tokens: int | float = 0
    generated_tokens: int | float = 0
    jobs_done: int | float = 0
    jobs_failed: int | float = 0
    jobs_suspended: int | float = 0  # jobs that gave their slot to one of higher priority after their output began
    invariant_violations: int | float = 0
    decode_errors: int | float = 0
    decode_retries: int | float = 0
    snapshot_restores: int | float = 0  # slots cut back to one of their context checkpoints
    checkpoints_taken: int | float = 0  # context checkpoints saved (recurrent, hybrid, sliding-window memories)
    slot_copies: int | float = 0  # prefixes copied from another slot of this worker
    host_saves: int | float = 0  # evicted slot contents kept in host RAM
    host_restores: int | float = 0  # prefixes restored from host RAM
    host_restore_bytes: int | float = 0  # bytes of the states restored (with host_restore_s: the restore speed)
    host_restore_s: float = 0.0
    disk_restores: int | float = 0  # prefixes restored from the disk tier (counted in restored_from_host)
    disk_restore_bytes: int | float = 0
    disk_restore_s: float = 0.0
    disk_restore_failures: int | float = 0  # a disk entry that did not check out or that llama.cpp refused (served cold)
    restored_tokens: int | float = 0  # reused tokens that came from another slot or host RAM
    restored_from_slots: int | float = 0  # of restored_tokens: copied from another slot
    restored_from_host: int | float = 0  # of restored_tokens: restored from host RAM
    copy_failures: int | float = 0  # llama.cpp refused a state copy (the slot was cleared and prefilled instead)
    host_save_failures: int | float = 0  # a copy to host RAM failed (nothing else did: the slot went on)
    state_buffers_mapped: int | float = 0  # saved states and checkpoints copied into memory new to the process
    state_buffers_reused: int | float = 0  # ... into the memory of one freed before (worker/buffers.py)
    spec_proposed: int | float = 0  # guessed tokens verified (speculation)
    spec_accepted: int | float = 0  # of spec_proposed: taken by the sampler
    spec_withheld: int | float = 0  # guesses not computed: the job's guesses were taken too rarely to pay in its batch
    paused_steps: int | float = 0  # steps that left a running job out for one of higher priority (one per job and step)
    decode_s: float = 0.0  # time inside llama_decode
    step_s: float = 0.0  # time of whole steps (batch building + decode + sampling + messages)
    # gauges, set when a heartbeat is made
    host_cache_bytes: int | float = 0
    host_cache_entries: int | float = 0
    snapshot_bytes: int | float = 0  # memory held by the slots' context checkpoints (recurrent, hybrid, windows)


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    """Every second: what the worker is doing."""

    worker_id: WorkerId
    incarnation: NonNeg
    slots: list[SlotState]
    queue: NonNeg  # jobs waiting for a slot inside the worker
    draining: bool = False
    counters: EngineCounters = msgspec.field(default_factory=EngineCounters)  # (the router's per-worker metrics)
    progress: NonNeg = 0  # engine steps and embedding inputs completed: a worker with jobs whose progress stops is hung


class JobDelta(Message, tag="job_delta", kw_only=True):
    id: RequestId
    text: str  # the generated text, as the model wrote it (the router parses tool calls out of it)
    tokens: TokenBytes
    logprobs: list[TokenLogprob] = []  # one per token, when the job's sampling.logprobs is set
    reused_tokens: NonNeg | None = None  # on the job's first delta: prompt tokens whose KV was not computed

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class JobDeltas(Message, tag="job_deltas", kw_only=True):
    """The deltas of one engine step, of several jobs, in one message (a worker sends a step's single delta as a plain
    JobDelta). Each job's deltas come before its JobDone or JobError."""

    items: list[JobDelta]


class JobDone(Message, tag="job_done", kw_only=True):
    """A job ended. The slot now holds `slot_tokens` tokens: the prompt plus the generated ones it kept."""

    id: RequestId
    slot: NonNeg
    finish_reason: str
    text: str
    tokens: TokenBytes  # generated token ids
    prompt_tokens: NonNeg
    reused_tokens: NonNeg  # prompt tokens whose KV was not computed for this job
    prefilled_tokens: NonNeg  # prompt tokens computed for this job
    generated_tokens: NonNeg
    slot_tokens: NonNeg  # the slot's token count after the job
    slot_hash: str  # token_hash() of the slot's tokens after the job
    slot_min_keep: NonNeg = 0  # shortest prefix the slot can be cut to (0: any; see CacheEntry.min_keep)
    slot_cuts: list[NonNeg] = []  # shorter prefixes it can also be cut to (its checkpoints: CacheEntry.cuts)
    slot_n_exact: NonNeg = 0  # of slot_tokens, the leading ones a seeded or deterministic job reuses (SlotHeld.n_exact)
    timings: Timings
    stop: str | None = None
    restored_tokens: NonNeg = 0  # of reused_tokens: copied into the slot from another slot or host RAM
    # a resumed job (Job.resume): the figures above count from its first placing; these are its last placing's (its
    # prompt then held its earlier output), which the router predicted
    resumed_reused: NonNeg | None = None
    resumed_restored: NonNeg = 0
    cache_added: list[CacheEntry] = []  # saved states added since the worker's previous JobDone/JobError
    cache_dropped: list[NonNeg] = []  # ids of saved states (host RAM) dropped since then
    disk_dropped: list[NonNeg] = []  # ids of disk-tier entries dropped since then

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class JobError(Message, tag="job_error", kw_only=True):
    """A job failed. `slot`, `slot_tokens`, `slot_hash` say what the slot holds now (slot -1: none taken). A job with
    `reply_to` sent its deltas there: `tokens` has what it generated (the router saw none of it)."""

    id: RequestId
    code: str
    message: str
    error_id: str | None = None
    overflow: Overflow | None = None  # with `context_overflow`: the numbers
    slot: int = -1
    slot_tokens: NonNeg = 0
    slot_hash: str = ""
    slot_min_keep: NonNeg = 0  # as in JobDone
    slot_cuts: list[NonNeg] = []  # as in JobDone
    slot_n_exact: NonNeg = 0  # as in JobDone
    cache_added: list[CacheEntry] = []  # as in JobDone
    cache_dropped: list[NonNeg] = []
    disk_dropped: list[NonNeg] = []
    tokens: TokenBytes = b""  # a job with reply_to, or a suspended one: the tokens it generated
    # `preempted` after its output began: the job waits on the worker, its sampler, grammar and text as they were, for
    # the router to place it again (`Job.resume`); its slot holds its prompt and all it generated but the last token
    suspended: bool = False

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class EmbedDone(Message, tag="embed_done", kw_only=True):
    """An `embed_job`'s vectors, one per input in order (a failed one gets a `job_error` instead)."""

    id: RequestId
    vectors: list[bytes]  # each `dims` float32, little-endian
    dims: NonNeg
    ms: float = 0.0  # time it took on the worker
    reused_tokens: NonNeg = 0  # input tokens whose KV was kept from the input before (last pooling), not computed


class JobStart(Message, tag="job_start", kw_only=True):
    """To a job's reply_to, when the worker takes the job: the first message there (the client knows the path works).
    Then the job's `job_delta`s (or `job_deltas`, a step's deltas for that endpoint together) and its `job_done`, the
    same messages the router gets without reply_to; a job that fails gets nothing more there (its router sends the
    client an `error`), except one its router forgot (it restarted): an `error` with the job's id."""

    id: RequestId


class SlotTaken(Message, tag="slot_taken", kw_only=True):
    """To each other router a worker reports to (routers side by side over one fleet; sent only to routers whose
    accept lists "slot_notices"): a job of another router now owns this slot, whose contents will change. The router
    treats the slot as busy until the SlotUpdate of the same epoch or a later one."""

    slot: NonNeg
    epoch: NonNeg  # the job's number on this slot (grows with every job it takes; messages may cross: the greatest wins)


class SlotUpdate(Message, tag="slot_update", kw_only=True):
    """To each other router: another router's job on this slot ended, the slot holds exactly `tokens` now, and the
    saved states changed as the job's JobDone/JobError said to its own router (an added entry naming a slot holds what
    that slot held before its job, as there)."""

    slot: Annotated[int, Meta(ge=-1)]  # -1: no slot changed (the job took none), only the saved states
    epoch: NonNeg  # the ending job's (SlotTaken.epoch)
    tokens: TokenBytes
    n_exact: NonNeg = 0
    salt: CacheSalt = ""
    min_keep: NonNeg = 0
    cuts: list[NonNeg] = []
    cache_added: list[CacheEntry] = []
    cache_dropped: list[NonNeg] = []
    disk_dropped: list[NonNeg] = []

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class StateCheckpoint(Struct, kw_only=True):
    """A context checkpoint of a saved state (worker/checkpoints.py): the part of its memory that cannot be cut back,
    as it was when the sequence held its first `n_tokens` tokens."""

    n_tokens: NonNeg
    data: bytes


class StateBlob(Struct, kw_only=True):
    """A saved state of one worker's host-RAM tier, as another worker of the same model restores it: llama.cpp's
    sequence state (`data`), the tokens whose KV it holds and its checkpoints (`state_copy`, `job.state`)."""

    tokens: TokenBytes
    n_exact: NonNeg = 0
    pos_min: NonNeg = 0  # lowest position its sliding-window layers hold once restored
    salt: CacheSalt = ""
    data: bytes
    checkpoints: list[StateCheckpoint] = []

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens, empty_ok=False)


class StateCopy(Message, tag="state_copy", kw_only=True):
    """The answer to `state_fetch`: the saved state, or none when the worker no longer holds it."""

    id: RequestId  # the fetch's
    state: StateBlob | None = None
    gives: NonNeg = 0  # prompt tokens the state gives the fetch's prompt, by the rule a worker restores with


WorkerToRouter = Hello | Heartbeat | JobDelta | JobDeltas | JobDone | JobError | SlotTaken | SlotUpdate | EmbedDone | StateCopy


# ---- router -> worker -------------------------------------------------------------------------


class Accept(Message, tag="accept", kw_only=True):
    worker_id: WorkerId
    router_id: str = ""  # changes when the router restarts
    features: list[str] = []  # what this router reads beyond version 1's first messages: "job_deltas", "slot_notices"


class Refuse(Message, tag="refuse", kw_only=True):
    """The router will not use this worker. `code` is an ErrorCode (`model_mismatch`, `bad_request`...)."""

    code: str
    reason: str


class Constraint(Struct, kw_only=True):
    """What the output must match, as an llguidance grammar (Lark syntax; JSON Schemas inside `%json {...}`).

    Without triggers it holds from the first generated token. With triggers it is lazy: the output is free
    until one of them appears (anywhere, or only at the start of the output when `at_start`), and from there
    on the output, trigger included, must match the grammar. When the grammar can go no further the job ends
    (finish_reason `stop`).
    """

    grammar: Annotated[str, Meta(min_length=1, max_length=4 * MAX_GRAMMAR_CHARS)]
    triggers: list[Annotated[str, Meta(min_length=1, max_length=256)]] = []
    at_start: bool = False


class JobImage(Struct, kw_only=True):
    """An image of a job's prompt (common/media.py): its rows start at `start` and take `n_tokens` positions, where
    the prompt holds the ids common/media.py makes from `data`, the image file's bytes, which the worker encodes with
    its projector (`--mmproj`)."""

    start: NonNeg
    n_tokens: Annotated[int, Meta(ge=1)]
    data: bytes


class Job(Message, tag="job", kw_only=True):
    """Run one generation. `slot` -1 lets the worker choose."""

    id: RequestId
    slot: Annotated[int, Meta(ge=-1)] = -1
    tokens: TokenBytes  # the whole prompt
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    deadline_ms: DeadlineMs | None = None  # relative to the worker's receipt
    predicted_reuse: NonNeg = 0  # what the router expects the slot to reuse (for logs)
    prefix_cache: bool = True  # False: clear the slot and compute the whole prompt
    constraint: Constraint | None = None  # a grammar the output must follow
    cache_salt: CacheSalt = ""  # the tenant: its KV is reused only by jobs with the same salt ("": no tenant)
    reply_to: str = ""  # the client's endpoint for the job's output (Submit.reply_to); "": all to the router
    reply_key: str = ""  # that endpoint's CURVE public key ("": none)
    images: list[JobImage] = []  # the prompt's images, in order (their ids are negative: common/media.py)
    # Submit.priority: while a job of higher priority runs on the worker, jobs of lower priority wait (keeping their KV)
    priority: Priority = 0
    # a state another worker saved (`state_copy`): kept in this worker's host-RAM tier before the job is placed
    state: StateBlob | None = None
    # go on with the job of this id that this worker suspended (JobError.suspended): `tokens` are its prompt and every
    # token it generated; it samples on where it stopped (its own sampling and grammar: this job's are not read)
    resume: bool = False

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens, empty_ok=False)


class EmbedJob(Message, tag="embed_job", kw_only=True):
    """Compute the vectors of whole inputs (`embed`), in a context of the worker's model kept for this, with pooling;
    the slots and their KV are not touched. Answered with `embed_done` or `job_error`."""

    id: RequestId
    inputs: list[TokenBytes]
    pooling: Literal["mean", "last", "cls", "rank"] = "mean"  # rank: a reranker's scores (`rerank`), not normalized
    normalize: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("`inputs` must not be empty")
        for i, t in enumerate(self.inputs):
            check_token_bytes(f"`inputs[{i}]`", t, empty_ok=False)


class JobCancel(Message, tag="job_cancel", kw_only=True):
    """Stop a job. `preempt`: hand it back (`job_error` `preempted`, its slot keeping what it computed) for the router
    to place again: at once if it has not sampled a token yet; else suspended (`JobError.suspended`) where the worker
    can take it up again exactly (not a seeded job, none with images, not in deterministic mode), or it runs on; a
    `reply_to` client reads on from the same job once it is resumed."""

    id: RequestId
    preempt: bool = False


class StateFetch(Message, tag="state_fetch", kw_only=True):
    """Send a copy of a state saved in host RAM (CacheEntry.id, tier "ram") back in `state_copy` with the same id, for
    the router to hand to another worker with a job (`job.state`); when that entry is gone (its change not reported
    yet), the state giving the most of `tokens`, the job's prompt. Answered at once, between steps or not."""

    id: RequestId
    entry: NonNeg
    tokens: TokenBytes = b""  # the job's prompt
    salt: CacheSalt = ""  # the job's tenant (Job.cache_salt)
    seeded: bool = False  # the job has a seed (it reuses only KV a seeded job computed)


class Drain(Message, tag="drain", kw_only=True):
    """Stop taking jobs; finish the running ones."""


RouterToWorker = Accept | Refuse | Job | JobCancel | Drain | EmbedJob | StateFetch
