"""Slot selection: the cost model and the comparison policies, as pure functions over a snapshot.

Cost of sending a prompt of L tokens to idle slot s of worker w, in prompt-token equivalents (lowest wins):

    reuse(s)   = LCP(prompt, tokens held by s), minus 1 when the whole prompt matches (the worker
                 backs off one token to get logits); 0 for a dirty slot or with prefix caching off;
                 on a deterministic worker at most the tokens computed as prompt and L - 8, for a
                 seeded request on another worker at most the tokens a seeded prompt computed; 0 when
                 s holds a restored state that cannot be cut that far back (its reported min_keep).
    cost(w, s) = (L - affine(s))                              prompt tokens still to prefill here
               + queued_prefill(w)                             prefill already sent to w, not yet done
               + busy_slot_cost * busy(w)                      each running slot shares w's compute
               + evict_weight * (n(s) - reuse(s)) * recency(s) * share(w)   what the choice overwrites
               + AWAITED_COST, when s is awaited by another conversation  a last resort (see Awaited, below)
    affine(s)  = reuse(s) if reuse(s) >= min_match else 0     a tiny match (BOS, "The") is no affinity
    recency(s) = 0.5 ** (idle seconds of s / evict_half_life_s) a hot, recently used prefix is dear
    share(w)   = 1, or where w saves what a job overwrites in host RAM (its Hello's host_cache_bytes), the cost of
                 restoring a token's KV bytes later (measured: WorkerLoad.evict_share): what it overwrites is kept

A state a worker saved in host RAM (`Saved`, in the same index) is a third kind of candidate: restoring it into
that worker's cheapest slot to overwrite gives reuse(saved) (the worker's rule: common/slots.py `restore_keep`,
`worth_copy`) at an extra cost of its bytes x the worker's `restore_cost` (prompt-token equivalents per byte: its
measured prefill speed / restore speed). The reuse a dispatch predicts includes the restore the worker will do on
the chosen slot, whichever way it was chosen.

A saved state is a candidate on another worker too (`state_copies`, `Dispatch.copy_from`): that worker's cheapest slot
to overwrite, at COPY_COST_FACTOR times the restore's cost there (router/state_copies.py sends the job once the copy
has come), when the two workers' states are interchangeable (`WorkerLoad.takes_copy_of`). A dispatch whose worker's
own slots and states give as much copies nothing.

Awaited slots (router/mirror.py `Sessions`): a slot whose last job, of a request with a session, ended in tool calls
is awaited by that conversation (its session and prompt head: `Params.conversation`) until a time-to-live passes
(`Slot.awaited`). For any other request it costs AWAITED_COST more (1e9 prompt-token equivalents, more than any other
candidate's cost can be): so it is chosen only when no other idle slot of any candidate worker is left (and, among
several awaited ones, the cheapest as above). For its own conversation it costs what any slot costs, and its prefix
wins it. A worker's coldest slot being awaited, its other idle slots are candidates too (`_Cheapest.cold`), and a
saved state is restored on the worker's coldest slot not awaited (`coldest_for`). When one is overwritten after all,
the worker saves what it held to its host tier first, as for any slot (and the reuse predicted stays exact).
The baselines (`round-robin`, `least-loaded`) ignore it; another choice of a request with n > 1 (router/dispatch_queue.py
`_beside`) takes its worker's coldest slot that no other conversation awaits (`coldest_for`).

Guards:
- Imbalance: when busy(max) - busy(min) > imbalance_abs and busy(max) > imbalance_rel * busy(min)
  (min over workers with an idle slot), only workers with busy <= busy(min) + imbalance_abs are
  candidates: affinity is kept among lightly loaded workers instead of being dropped (SGLang #32195).
- Ties are broken by a rotating worker order (`rotation`), never "always worker 0".
- Busy best slot: when a busy slot would reuse at least `min_match` more tokens than the best idle
  choice, or a state saved on a worker with no idle slot would (restored there once a slot frees), the
  request waits for it (`Wait`) for `busy_wait_ms`, then while waiting should cost less than computing the tokens
  it would gain on the best idle choice's worker (`worth_waiting`: the full worker's first job should end sooner),
  then takes the best idle choice.
- Hold: a slot whose job ended less than `hold_ms` ago is kept for its own conversation (a prompt
  that reuses at least `min_match` of it); another request skips it, and waits (`Wait`) when nothing
  else is idle, at most until the hold ends. With more conversations than slots this keeps
  each returning turn on its history instead of every turn overwriting another's. Off by default:
  a worker keeps what a job overwrites in host RAM and restores it when the conversation returns,
  so a hold only leaves slots idle (measured: bench/README.md).
Cold requests (no affinity anywhere) thus go to the least-loaded worker, to its empty or least
recently used slot. `round-robin` and `least-loaded` ignore prefixes when choosing (the baselines of
bench/; the scheduler pins a round-robin request to one worker when it arrives, and orders their queue
first come, first served): the worker still reuses whatever the chosen slot happens to share, copies or
restores what it holds itself, and the reuse is still predicted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from common.slots import restore_keep, reused, worth_copy
from protocol import MAX_STATE_BYTES
from router.config import RouterConfig
from router.index import Match
from router.mirror import Conversation, Saved, SavedKey, Slot

_CONFIG: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
# Until a worker has measured both: prefill ~1,000 tokens/s, restore ~1 GB/s (a CPU worker; a GPU prefills faster
# and restores faster alike)
RESTORE_COST_PER_BYTE = 1e-6
DISK_RESTORE_COST_PER_BYTE = 1e-5  # ~100 MB/s, a slow disk's cold read
MAX_WAIT_MS = 60_000.0  # the longest a request waits for the slot or worker holding its prefix
AWAITED_COST = 1e9  # an idle slot another conversation awaits: beyond any other candidate's cost (prompt tokens)
# A state copied from another worker: read out there, through the router, kept and restored here (about four times the
# bytes a restore of one's own copies)
COPY_COST_FACTOR = 4.0
_PER_REQUEST = ("seeded", "conversation")  # Params' fields that are a request's, not the router's flags


@dataclass(frozen=True)
class Params:
    """The cost model's settings: those of RouterConfig (the router's flags), with its defaults."""

    policy: str = _CONFIG["policy"]
    prefix_cache: bool = _CONFIG["prefix_cache"]
    min_match: int = _CONFIG["min_match"]
    busy_slot_cost: float = float(_CONFIG["busy_slot_cost"])
    evict_weight: float = _CONFIG["evict_weight"]
    evict_half_life_s: float = _CONFIG["evict_half_life_s"]
    imbalance_abs: int = _CONFIG["imbalance_abs"]
    imbalance_rel: float = _CONFIG["imbalance_rel"]
    busy_wait_ms: float = float(_CONFIG["busy_wait_ms"])
    hold_ms: float = float(_CONFIG["hold_ms"])
    state_copies: bool = _CONFIG["state_copies"]
    seeded: bool = False  # the request has a seed: it reuses only KV computed for seeded jobs (common/slots.py)
    conversation: Conversation | None = None  # the request's conversation: a slot awaiting it is no last resort for it

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> Params:
        kinds: dict[str, Any] = {f.name: type(f.default) for f in dataclasses.fields(cls) if f.name not in _PER_REQUEST}
        return cls(**{name: kind(getattr(cfg, name)) for name, kind in kinds.items()})


@dataclass
class WorkerLoad:
    """One ready worker as selection sees it: its busy slots and the prefill sent to it and not yet computed
    (recomputed by its owner, router/requests.py `WorkerConn.refresh`, from the mirror and the running jobs)."""

    worker: str
    slots: list[Slot]
    busy: int = 0
    queued_prefill: int = 0
    restore_cost: float = RESTORE_COST_PER_BYTE  # prompt-token equivalents of restoring one byte from host RAM
    disk_restore_cost: float = DISK_RESTORE_COST_PER_BYTE  # the same from its disk tier
    evict_share: float = 1.0  # of a cached token a choice overwrites, what is lost (restoring it, when saved first)
    prefill_tps: float = 0.0  # its prompt tokens computed per second, measured (0: not yet)
    frees_at: float | None = None  # when its first running job should end (monotonic; None: not known)
    host_cache_bytes: int = 0  # its host-RAM tier: a state another worker saved can be copied into it (Hello's)
    ctx_per_slot: int = 0
    deterministic: bool = False
    saved: dict[SavedKey, Saved] = field(default_factory=dict, repr=False)  # its saved states (the mirror's)
    cold: Slot | None = field(default=None, repr=False)  # cache of coldest, valid while cold_rev holds
    cold_rev: object = field(default=None, repr=False)

    def restore_cost_of(self, saved: Saved) -> float:
        return saved.nbytes * (self.disk_restore_cost if saved.on_disk else self.restore_cost)

    def takes_copy_of(self, saved: Saved, source: WorkerLoad | None) -> bool:
        """Whether a copy of a state `source` saved in host RAM can be restored here (`Dispatch.copy_from`): a worker
        of the same slots (llama.cpp's state of a sequence lists every slot's KV stream), length and mode, whose host-RAM
        tier can keep it."""
        return (
            saved.nbytes <= self.host_cache_bytes
            and source is not None
            and source.worker != self.worker
            and (len(source.slots), source.ctx_per_slot, source.deterministic)
            == (len(self.slots), self.ctx_per_slot, self.deterministic)
            and not saved.on_disk
            and saved.nbytes <= MAX_STATE_BYTES
            and len(saved.tokens) < self.ctx_per_slot
        )


@dataclass(frozen=True)
class Dispatch:
    slot: Slot
    reuse: int  # predicted reused tokens (what the worker must report)
    cost: float
    affinity: bool  # chosen for its cached prefix (reuse >= min_match)
    guarded: bool = False  # the imbalance guard limited the candidates
    restore: bool = False  # the reuse comes from a saved state the worker restores
    copy_from: Saved | None = None  # ...that another worker saved, copied to this one first (router/state_copies.py)
    without_copy: int = 0  # with copy_from: what the slot reuses if the copy does not come


@dataclass(frozen=True)
class Wait:
    slot: Slot  # the busy slot worth waiting for (with `saved`: a slot of the worker that saved it)
    reuse: int
    saved: bool = False  # waiting for a worker with no idle slot, to restore a state it saved


Decision = Dispatch | Wait | None  # None: no idle slot anywhere


def predicted_reuse(lcp: int, length: int, slot: Slot, params: Params) -> int:
    """What the worker will reuse on `slot`: the rule both sides share (common/slots.py `reused`; a slot holding a
    restored state or a recurrent memory cannot be cut back before its `min_keep`, except to its checkpoints:
    `restore_keep`)."""
    if not params.prefix_cache or slot.dirty:
        return 0
    r = reused(lcp, length, slot.n_exact, slot.exact, params.seeded)
    return restore_keep(r, len(slot.tokens), slot.min_keep, slot.cuts)


def restored_reuse(lcp: int, length: int, saved: Saved, have: int, seeded: bool) -> int:
    """What a saved state sharing `lcp` tokens with a prompt gives on a slot that gives `have` itself: the worker's
    rule (worker/prefix.py `Prefixes.source`); `have` when a restore is not worth it there."""
    r = reused(lcp, length, saved.n_exact, saved.exact, seeded)
    r = restore_keep(r, len(saved.tokens), saved.min_keep, saved.cuts)
    return r if worth_copy(r - have, len(saved.tokens)) else have


def expected_reuse(match: Match, slot: Slot, params: Params, saved: dict[SavedKey, Saved]) -> tuple[int, bool]:
    """What the worker will reuse for this prompt on `slot`: its own prefix, or the state it restores (True) from its
    `saved` ones: the one sharing the longest prefix, as the worker picks it."""
    own = predicted_reuse(match.lcp(slot), match.length, slot, params)
    if not params.prefix_cache or slot.dirty or not saved:
        return own, False
    gives, top = best_saved(match, saved, params.seeded)
    r = gives if top is not None and worth_copy(gives - own, len(top.tokens)) else own
    return r, r > own


def best_saved(match: Match, saved: dict[SavedKey, Saved], seeded: bool) -> tuple[int, Saved | None]:
    """The saved state giving the most of the prompt (common/slots.py `restore_keep`), and that much; (0, None) when
    none gives any. As the worker chooses (worker/prefix.py `best_saved`): the most tokens, then the fewest to copy, then
    host RAM before disk. Walks the match's path deepest first and stops where no shallower state can give as much, so
    its cost is about the worker's entry count once, not an LCP per entry (with 100,000 entries indexed that scan was
    half of a decision's time)."""
    entries = set(saved.values())
    length = match.length
    best: tuple[int, int, bool] | None = None
    top: Saved | None = None
    for level, depth in match.levels():
        if best is not None and min(depth, length - 1) < best[0]:
            break  # (a state gives at most what it shares)
        for s in cast("set[Saved]", level & entries):
            r = restore_keep(reused(depth, length, s.n_exact, s.exact, seeded), len(s.tokens), s.min_keep, s.cuts)
            key = (r, -len(s.tokens), not s.on_disk)
            if r > 0 and (best is None or key > best):
                best, top = key, s
    return (best[0], top) if best is not None else (0, None)


def _recency(slot: Slot, now: float, half_life: float) -> float:
    return 0.5 ** (max(0.0, now - slot.last_used) / half_life)


def _rotated(workers: list[WorkerLoad], rotation: int) -> list[WorkerLoad]:
    if not workers:
        return workers
    k = rotation % len(workers)
    return workers[k:] + workers[:k]


def _cold_key(s: Slot, half_life: float) -> float:
    """How dear an idle slot is to overwrite, in `coldest`'s order: empty or dirty first (-inf), else by
    log2(n_tokens * 2 ** (last_used / half_life))."""
    if s.dirty or not s.tokens.size:
        return -math.inf
    return math.log2(len(s.tokens)) + s.last_used / half_life


def coldest(w: WorkerLoad, half_life: float) -> Slot | None:
    """The idle slot of `w` that is cheapest to overwrite: empty or dirty first, else the smallest
    n_tokens * recency. That order does not change with time (recency is exponential), so it is
    cached until one of the worker's slots changes (`Slot.rev`)."""
    rev = (w.slots[0].rev[0], half_life) if w.slots else None
    if w.cold_rev == rev:
        return w.cold
    best: Slot | None = None
    best_key = math.inf
    for s in w.slots:
        if s.busy:
            continue
        key = _cold_key(s, half_life)
        if key < best_key:
            best, best_key = s, key
            if key == -math.inf:
                break
    w.cold, w.cold_rev = best, rev
    return best


def awaited_by_other(s: Slot, conversation: Conversation | None, now: float) -> bool:
    """Whether `s` is awaited by a conversation other than `conversation` (router/mirror.py `Sessions`)."""
    other = s.awaited(now)
    return other is not None and other != conversation


def coldest_for(w: WorkerLoad, half_life: float, conversation: Conversation | None, now: float) -> Slot | None:
    """`coldest`, unless another conversation awaits it: then the coldest idle slot of `w` no other conversation
    awaits, when there is one."""
    cold = coldest(w, half_life)
    if cold is None or not awaited_by_other(cold, conversation, now):
        return cold
    free = [s for s in w.slots if not s.busy and not awaited_by_other(s, conversation, now)]
    return min(free, key=lambda s: _cold_key(s, half_life)) if free else cold


def select(match: Match, workers: list[WorkerLoad], params: Params, now: float, rotation: int, waited_ms: float) -> Decision:
    """Pick a slot for a prompt of `match.length` tokens. Pure (only caches per-worker facts)."""
    hl = params.evict_half_life_s
    everyone = {w.worker: w for w in workers}
    full = {w.worker: w for w in workers if coldest(w, hl) is None}
    workers = _rotated([w for w in workers if w.worker not in full], rotation)
    if not workers:
        return None
    if params.policy == "round-robin":
        return _plain(workers[0], match, params)
    if params.policy == "least-loaded":
        return _plain(min(workers, key=lambda w: w.busy + w.queued_prefill / 512.0), match, params)
    return _prefix(match, workers, params, now, waited_ms, full, everyone)


def _plain(w: WorkerLoad, match: Match, params: Params) -> Dispatch:
    slot = coldest(w, params.evict_half_life_s)
    assert slot is not None
    reuse, restore = expected_reuse(match, slot, params, w.saved)
    return Dispatch(slot, reuse, float(match.length - reuse), reuse >= params.min_match, restore=restore)


def _prefix(
    match: Match,
    workers: list[WorkerLoad],
    params: Params,
    now: float,
    waited_ms: float,
    full: dict[str, WorkerLoad],
    everyone: dict[str, WorkerLoad],
) -> Decision:
    """Cost over idle slots: each worker's cheapest slot to overwrite (the only cold candidate that can
    win there), then the slots holding a prefix, deepest match first, until no shallower match can win."""
    workers, guarded = _balanced(workers, params)
    found = _Cheapest(match, workers, params, now, everyone)
    for w in workers:
        found.cold(w)
    if params.prefix_cache:
        found.holders()
    best = found.slot
    if best is None:
        assert found.held is not None
        return Wait(found.held, 0)
    reuse, restore = found.reuse, found.restore
    if params.prefix_cache:
        wait = _busy_better(match, match.length, params, reuse, full)
        holder = full.get(wait.slot.worker) if wait is not None and wait.saved else None
        if wait is not None and worth_waiting(wait.reuse - reuse, found.by_name[best.worker], holder, params, waited_ms, now):
            return wait
    copy_from = found.copy_from
    if not restore or copy_from is not None:  # the worker restores a saved state on that slot if one is worth it
        own, own_restore = expected_reuse(match, best, params, found.by_name[best.worker].saved)
        if copy_from is None or own >= reuse:
            reuse, restore, copy_from = own, own_restore, None  # (its own gives as much: nothing to copy)
        else:
            return Dispatch(best, reuse, found.cost, reuse >= params.min_match, guarded, True, copy_from, own)
    return Dispatch(best, reuse, found.cost, reuse >= params.min_match, guarded, restore)


def worth_waiting(gain: int, here: WorkerLoad, holder: WorkerLoad | None, params: Params, waited_ms: float, now: float) -> bool:
    """Whether a request that would gain `gain` tokens by waiting (for a busy slot, or for a slot of `holder`, a full
    worker that saved its prefix) waits on, rather than taking the best idle slot (on `here`) now: for `busy_wait_ms`
    at least; then while the holder's first job should end (`frees_at`, from what its jobs have left) before computing
    those tokens on `here` would; where that is not known, until it has waited that cost (`wait_bound_ms`)."""
    if waited_ms < params.busy_wait_ms:
        return True
    if waited_ms >= MAX_WAIT_MS:
        return False
    bound = wait_bound_ms(gain, here, params)
    if holder is not None and holder.frees_at is not None and here.prefill_tps > 0:
        left_ms = (holder.frees_at - now) * 1000
        if left_ms >= 0:  # (a job past its estimate: the estimate says nothing more)
            return left_ms <= bound
    return waited_ms < bound


def wait_bound_ms(gain: int, here: WorkerLoad, params: Params) -> float:
    """How long a request waits for a busy slot or a full worker that would give it `gain` more tokens than the best
    idle slot (on `here`): `busy_wait_ms`, or what computing those tokens there costs, when longer: their time at its
    measured speed, once for this request and once more for each job running there (they share its compute, and are
    slowed as much). So the wait never costs more than the computing it saves (the ski-rental bound)."""
    if here.prefill_tps <= 0:
        return params.busy_wait_ms
    return max(params.busy_wait_ms, min(MAX_WAIT_MS, gain / here.prefill_tps * 1000 * (1 + here.busy)))


def _balanced(workers: list[WorkerLoad], params: Params) -> tuple[list[WorkerLoad], bool]:
    """The imbalance guard: when the busiest worker runs too many more jobs than the least busy, only the workers
    within `imbalance_abs` of the least busy are candidates (True: the guard acted)."""
    lo = min(w.busy for w in workers)
    hi = max(w.busy for w in workers)
    if hi - lo > params.imbalance_abs and hi > params.imbalance_rel * lo:
        return [w for w in workers if w.busy <= lo + params.imbalance_abs], True
    return workers, False


class _Cheapest:
    """The search for one prompt's cheapest idle slot: every candidate is `consider`ed, the cheapest kept; a slot
    kept for its own conversation a little longer (`hold_ms`) is not a candidate, and is what to wait for when no
    other is."""

    def __init__(
        self, match: Match, workers: list[WorkerLoad], params: Params, now: float, everyone: dict[str, WorkerLoad]
    ) -> None:
        """`workers`: the candidates; `everyone`: every worker the request may go to (those with no idle slot too)."""
        self.match, self.params, self.now, self.everyone = match, params, now, everyone
        self.length = match.length
        self.rank = {w.worker: i for i, w in enumerate(workers)}  # rotated order breaks ties
        self.load = {w.worker: w.queued_prefill + params.busy_slot_cost * w.busy for w in workers}
        self.evict = {w.worker: params.evict_weight * w.evict_share for w in workers}
        self.by_name = {w.worker: w for w in workers}
        self.holding = params.prefix_cache and params.hold_ms > 0  # the wait ends when the hold does
        self.conversation = params.conversation
        self.hold_since = now - params.hold_ms / 1000.0
        self.key: tuple[float, int, int] | None = None  # (cost, rank, slot index) of the cheapest so far
        self.slot: Slot | None = None
        self.reuse = 0
        self.restore = False
        self.copy_from: Saved | None = None
        self.held: Slot | None = None

    @property
    def cost(self) -> float:
        return self.key[0] if self.key is not None else float("inf")

    def consider(self, s: Slot, lcp: int, saved: Saved | None = None, saved_lcp: int = 0) -> None:
        """`saved`: a state restored on `s` first (another worker's: copied to s's worker first)."""
        params, length = self.params, self.length
        reuse = own = predicted_reuse(lcp, length, s, params)
        extra = 0.0
        if saved is not None and not s.dirty:
            reuse = restored_reuse(saved_lcp, length, saved, own, params.seeded)
            extra = self.by_name[s.worker].restore_cost_of(saved) if reuse > own else 0.0
            if saved.worker != s.worker:
                extra *= COPY_COST_FACTOR
        mm = params.min_match
        if self.holding and reuse < mm and s.last_used > self.hold_since and s.tokens.size and not s.dirty:
            self.held = s  # kept for its own conversation a little longer
            return
        lost = 0 if s.dirty else len(s.tokens) - own
        cost = length - (reuse if reuse >= mm else 0) + self.load[s.worker] + extra
        if lost > 0 and params.evict_weight > 0:
            cost += self.evict[s.worker] * lost * _recency(s, self.now, params.evict_half_life_s)
        if s.awaited_by is not None and awaited_by_other(s, self.conversation, self.now):
            cost += AWAITED_COST  # another conversation's, expected back soon: a last resort
        key = (cost, self.rank[s.worker], s.index)
        if self.key is None or key < self.key:
            self.key, self.slot, self.reuse, self.restore = key, s, reuse, reuse > own
            self.copy_from = saved if reuse > own and saved is not None and saved.worker != s.worker else None

    def cold(self, w: WorkerLoad) -> None:
        """The worker's cheapest slot to overwrite; when that one is held, or awaited by another conversation, the
        worker's other idle slots."""
        cold = coldest(w, self.params.evict_half_life_s)
        if cold is None:
            return
        prefix = self.params.prefix_cache
        self.consider(cold, self.match.lcp(cold) if prefix else 0)
        if self.held is cold or awaited_by_other(cold, self.conversation, self.now):
            for s in w.slots:
                if not s.busy and s is not cold:
                    self.consider(s, self.match.lcp(s) if prefix else 0)

    def holders(self) -> None:
        """The idle slots and saved states holding a prefix of the prompt, deepest first, while one can still win."""
        params, length, hl = self.params, self.length, self.params.evict_half_life_s
        min_load = min(self.load.values())
        for level, depth in self.match.levels():
            owners = cast("set[Slot | Saved]", level)
            top = min(depth, length - 1)
            if top < params.min_match or length - top + min_load >= self.cost:
                break  # shallower levels reuse less: none of them can win
            for saved in owners:
                if not isinstance(saved, Saved):
                    continue
                if saved.worker in self.rank:
                    # (a restore overwrites what the slot holds)
                    target = coldest_for(self.by_name[saved.worker], hl, self.conversation, self.now)
                    if target is not None:
                        self.consider(target, self.match.lcp(target), saved, depth)
                if params.state_copies:  # (copied to another worker first: router/state_copies.py)
                    for w in self.by_name.values():
                        source = self.everyone.get(saved.worker)
                        if w.takes_copy_of(saved, source) and (target := coldest_for(w, hl, self.conversation, self.now)):
                            self.consider(target, self.match.lcp(target), saved, depth)
            idle = [s for s in owners if isinstance(s, Slot) and not s.busy and s.worker in self.rank]
            self._idle_at(idle, depth, top)

    def _idle_at(self, idle: list[Slot], depth: int, top: int) -> None:
        """Idle slots sharing one match depth; many of them are costed at once (numpy)."""
        ew = self.params.evict_weight
        if len(idle) <= 32 or ew <= 0:
            for s in idle:
                self.consider(s, depth)
            return
        plain = [s for s in idle if not (s.dirty or s.exact or s.min_keep or s.awaited_by is not None)]
        for s in idle:
            if s.dirty or s.exact or s.min_keep or s.awaited_by is not None:
                self.consider(s, depth)
        if plain:
            i = _vector_best(plain, top, self.length, self.load, self.rank, self.now, self.params.evict_half_life_s, self.evict)
            self.consider(plain[i], depth)


def _vector_best(
    slots: list[Slot],
    reuse: int,
    length: int,
    load: dict[str, float],
    rank: dict[str, int],
    now: float,
    hl: float,
    evict: dict[str, float],
) -> int:
    """Index of the cheapest of many slots sharing one match depth (numpy; same cost as `consider`)."""
    n = np.fromiter((len(s.tokens) for s in slots), dtype=np.float64, count=len(slots))
    age = now - np.fromiter((s.last_used for s in slots), dtype=np.float64, count=len(slots))
    ld = np.fromiter((load[s.worker] for s in slots), dtype=np.float64, count=len(slots))
    rk = np.fromiter((rank[s.worker] for s in slots), dtype=np.int64, count=len(slots))
    ew = np.fromiter((evict[s.worker] for s in slots), dtype=np.float64, count=len(slots))
    cost = ld + ew * (n - reuse) * np.power(0.5, np.maximum(age, 0.0) / hl)
    return int(np.lexsort((rk, cost))[0])


def _busy_better(match: Match, length: int, params: Params, idle_reuse: int, full: dict[str, WorkerLoad]) -> Wait | None:
    """The busy slot with the deepest match, or a state saved on a worker with no idle slot (restored there when one
    frees), if it beats the best idle choice by min_match tokens."""
    for level, depth in match.levels():
        owners = cast("set[Slot | Saved]", level)
        if min(depth, length - 1) - idle_reuse < params.min_match:
            return None
        top: Wait | None = None
        for s in owners:
            if isinstance(s, Slot) and s.busy:
                wait = Wait(s, predicted_reuse(depth, length, s, params))
            elif isinstance(s, Saved) and s.worker in full:
                wait = Wait(full[s.worker].slots[0], restored_reuse(depth, length, s, 0, params.seeded), saved=True)
            else:
                continue
            reuse = wait.reuse
            if reuse >= params.min_match and reuse - idle_reuse >= params.min_match and (top is None or reuse > top.reuse):
                top = wait
        if top is not None:
            return top
    return None
