"""The router's exact mirror of every slot: which tokens each slot's KV holds, and whether it is busy.

Contract (the worker's invariant, protocol/worker_messages.py): after a job the slot holds exactly the
first `slot_tokens` tokens of (prompt + generated tokens), and `slot_hash` is their token_hash.
- `assign` (dispatch): the slot becomes busy and is recorded as holding the prompt, so the index
  already routes on it; the previous contents are kept until the worker answers.
- `finish` / `fail` (the worker's report): the slot becomes idle holding what the report says. The
  mirror's own prediction is checked against the reported length and hash; on a mismatch it is
  counted, the slot is recorded as empty and marked `dirty`, and the next job on it is sent with
  prefix_cache=False so the worker clears it: the mirror is exact again after one job, never trusted
  while wrong.
- The mirror owns the index; every change to a slot's tokens goes through here, so the two agree. Tenants
  (`cache_salt`) are isolated by keeping one index per salt: a prompt is matched only against what its own
  tenant's prompts left in slots and saved states, so nothing (a reuse, a time to first token) tells one tenant
  about another's prompts. The worker applies the same rule to what it reuses and copies.
- Saved states: each worker keeps copies of evicted slot contents in host RAM and reports them (protocol
  `CacheEntry`: added with the slot whose previous contents it copied, or with its tokens; dropped by id). The mirror
  indexes them as owners (`Saved`) beside the slots, so selection can weigh restoring one against prefilling. An
  added entry whose hash disagrees with the tokens the mirror knows is a mismatch: counted, not indexed.
- Routers side by side (several routers, one fleet): another router's job on a slot makes it busy here (`taken`)
  until the worker says what it left (`updated_by_other`); the worker numbers each job on a slot (its epoch), so the
  two reports may arrive in either order.
- Sessions (Submit.session, a client's hint): each slot remembers the session of the request it last ran. A
  conversation is keyed by (session, a digest of its prompt's first CONVERSATION_HEAD tokens): a client session can
  hold several conversations (Claude Code's sub-agents send their parent's session id with another system prompt),
  so the same session with another head is a sub-agent of that session (its parent is that session, unless the
  request's parent_session names another). A conversation whose job ended in tool calls *awaits* its slot
  (`Sessions`): the slot is kept for its next turn until a time-to-live passes (selection overwrites it only as a last
  resort, router/select.py), learned from the conversation's own pauses. Only this router's view: another router
  side by side places without it.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from common.slots import SlotPhase
from protocol import CacheEntry, token_array, token_hash
from router.index import Index, Match, Tokens, as_tokens

EMPTY: Tokens = np.empty(0, dtype=np.int32)

CONVERSATION_HEAD = 32  # the prompt's leading tokens that tell a session's conversations apart (its system prompt)
Conversation = tuple[str, str]  # (Submit.session, digest of the prompt's first CONVERSATION_HEAD tokens)


def conversation_of(session: str | None, tokens: Tokens) -> Conversation | None:
    """The conversation a request continues: its session and its prompt's head; None without a session."""
    if not session:
        return None
    return (session, token_hash(np.asarray(tokens[:CONVERSATION_HEAD], dtype=np.int32))[:12])


@dataclass(eq=False)
class Slot:
    """One slot of one worker incarnation. Identity-hashed: it is the index's owner key."""

    worker: str
    index: int
    tokens: Tokens = field(default_factory=lambda: EMPTY)
    phase: SlotPhase = SlotPhase.IDLE
    job: str | None = None
    dirty: bool = False  # contents unknown: the next job clears the slot
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0  # jobs that reused at least min_match tokens here
    reused_total: int = 0
    before: Tokens | None = None  # contents before the running job, restored if the worker never touched it
    exact: bool = False  # the worker runs in deterministic mode (it reuses only KV computed in full-size ubatches)
    n_exact: int = 0  # leading tokens a deterministic worker, or a seeded job on any worker, reuses (common/slots.py)
    before_exact: int = 0
    rev: list[int] = field(default_factory=lambda: [0])  # shared by a worker's slots; bumped on any change
    salt: str = ""  # the tenant whose prompt it holds (a digest of the client's cache_salt; "": none)
    before_salt: str = ""
    min_keep: int = 0  # shortest prefix it can be cut to (a restored state, a recurrent memory: common/slots.py restore_keep)
    cuts: tuple[int, ...] = ()  # shorter prefixes it can also be cut to: its context checkpoints, ascending
    before_cuts: tuple[int, ...] = ()  # (min_keep and cuts of the contents before the running job)
    before_min_keep: int = 0
    # routers side by side: the latest epoch (job number on this slot) of another router's job the worker announced
    # (SlotTaken, or a refusal), and the latest one it said ended (SlotUpdate); while the first is ahead, it is theirs
    taken: int = 0
    updated: int = 0
    session: str | None = None  # the session (Submit.session) of the request it last ran
    before_session: str | None = None  # (that of the request before the running job)
    awaited_by: Conversation | None = None  # the conversation expected back for what it holds (its job made tool calls)
    awaited_until: float = 0.0  # (monotonic) until then; past it the slot is an ordinary idle slot again

    def awaited(self, now: float) -> Conversation | None:
        """The conversation that awaits this slot now (None: none, or its time-to-live passed)."""
        return self.awaited_by if self.awaited_by is not None and now < self.awaited_until else None

    def awaited_s(self, now: float) -> float:
        """Seconds the slot is still awaited (0: not awaited)."""
        return max(0.0, self.awaited_until - now) if self.awaited_by is not None else 0.0

    @property
    def busy(self) -> bool:
        return self.phase is SlotPhase.BUSY or self.foreign

    @property
    def foreign(self) -> bool:
        """Another router's job runs here (its contents change; this mirror learns them when it ends)."""
        return self.taken > self.updated

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        other = f", another router's until update {self.taken}" if self.foreign else ""
        return f"Slot({self.worker}/{self.index}, {self.phase.value}, n={len(self.tokens)}{other})"


SavedKey = tuple[str, int]  # (tier, id): "ram" or "disk", and the entry's id in it


@dataclass(eq=False)
class Saved:
    """A state a worker saved in host RAM or on disk: restoring it into one of that worker's slots gives its prefix."""

    worker: str
    key: SavedKey
    tokens: Tokens
    nbytes: int
    n_exact: int = 0
    min_keep: int = 0  # shortest prefix a restore can keep
    exact: bool = False  # the worker runs in deterministic mode
    salt: str = ""  # the tenant whose prompt it holds
    cuts: tuple[int, ...] = ()  # shorter prefixes a restore can keep: its context checkpoints, ascending

    @property
    def on_disk(self) -> bool:
        return self.key[0] == "disk"

    def __repr__(self) -> str:
        return f"Saved({self.worker}/{self.key[0]}#{self.key[1]}, n={len(self.tokens)})"


@dataclass(frozen=True)
class Mismatch:
    """A report that disagreed with the mirror. `error_id` appears in the log line and the metrics."""

    worker: str
    slot: int
    job: str
    expected_tokens: int
    reported_tokens: int
    expected_hash: str
    reported_hash: str
    error_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class Mirror:
    """Every slot of every connected worker, and the one index over them."""

    def __init__(self) -> None:
        self.indexes: dict[str, Index] = {"": Index()}  # by tenant salt
        self.workers: dict[str, list[Slot]] = {}
        self.saved: dict[str, dict[SavedKey, Saved]] = {}  # worker -> its saved states
        self.mismatches = 0

    def add_worker(
        self,
        worker: str,
        n_slots: int,
        *,
        contents_known: bool = True,
        exact: bool = False,
        held: dict[int, tuple[Tokens, int, str, int, list[int]]] | None = None,
        cached: Sequence[CacheEntry] = (),
    ) -> list[Slot]:
        """Slots of a newly accepted worker: holding what the worker reports (`held`, from a worker that outlived its
        router: slot -> tokens, n_exact, salt, min_keep, cuts), else empty, or `dirty` when its KV may hold anything; and the
        saved states it reports (`cached`, with their tokens)."""
        self.remove_worker(worker)
        rev = [0]
        slots = [Slot(worker, i, dirty=not contents_known, exact=exact, rev=rev) for i in range(n_slots)]
        for slot in slots:
            if held is None:
                continue
            if slot.index not in held:
                slot.dirty = True  # not reported: unknown
                continue
            tokens, n_exact, salt, min_keep, cuts = held[slot.index]
            if len(tokens):
                slot.tokens, slot.n_exact, slot.dirty, slot.salt = as_tokens(tokens), n_exact, False, salt
                slot.min_keep, slot.cuts = min_keep, tuple(cuts)
                self._index(salt).insert(slot, slot.tokens)
        self.workers[worker] = slots
        self.saved[worker] = {}
        self.cache_changed(worker, cached)
        return slots

    def remove_worker(self, worker: str) -> list[Slot]:
        """Forget a worker: all its slots and saved states leave the index at once."""
        slots = self.workers.pop(worker, [])
        for s in slots:
            self._unindex(s, s.salt)
        for saved in self.saved.pop(worker, {}).values():
            self._unindex(saved, saved.salt)
        return slots

    @property
    def index(self) -> Index:
        """The index of prompts without a tenant."""
        return self.indexes[""]

    def match(self, tokens: Tokens, salt: str = "") -> Match:
        """What every slot and saved state of this tenant shares with the prompt."""
        index = self.indexes.get(salt)
        return index.match(tokens) if index is not None else Match([], len(tokens))

    def _index(self, salt: str) -> Index:
        index = self.indexes.get(salt)
        if index is None:
            index = self.indexes[salt] = Index()
        return index

    def _unindex(self, owner: Slot | Saved, salt: str) -> None:
        index = self.indexes.get(salt)
        if index is None:
            return
        index.remove(owner)
        if salt and not len(index):  # (a tenant that left takes no memory)
            del self.indexes[salt]

    def cache_changed(
        self, worker: str, added: Sequence[CacheEntry], dropped: Sequence[int] = (), disk_dropped: Sequence[int] = ()
    ) -> list[str]:
        """A worker's report of its saved states (before the report's own job is settled: an entry naming a slot holds
        what the slot held before its running job): added, dropped from host RAM, dropped from disk. Returns the
        problems found, for the log."""
        saved, slots = self.saved.get(worker), self.workers.get(worker, [])
        if saved is None:
            return []
        problems = []
        for e in added:
            if (e.tier, e.id) in saved:
                continue  # known from the hello that listed it
            if e.tokens:
                tokens, salt = token_array(e.tokens), e.salt
            elif 0 <= e.slot < len(slots) and (before := self._before(slots[e.slot])) is not None:
                tokens, salt = before
            else:
                continue  # the mirror does not know what that slot held (unknown contents): not routed to
            tokens = tokens[: e.n_tokens]
            if salt != e.salt:
                self.mismatches += 1
                problems.append(f"saved state {e.id} (from slot {e.slot}) is of another tenant than the slot held")
                continue
            if len(tokens) != e.n_tokens or token_hash(tokens) != e.hash:
                self.mismatches += 1
                held = "its tokens" if e.tokens else f"{len(tokens)} tokens from {slots[e.slot]!r}"
                problems.append(f"saved state {e.id} ({e.n_tokens} tokens, from slot {e.slot}) differs from the mirror's {held}")
                continue
            exact = bool(slots) and slots[0].exact
            s = Saved(worker, (e.tier, e.id), tokens, e.nbytes, e.n_exact, e.min_keep, exact, e.salt, tuple(e.cuts))
            saved[s.key] = s
            self._index(s.salt).insert(s, tokens)
        for key in [("ram", i) for i in dropped] + [("disk", i) for i in disk_dropped]:
            gone = saved.pop(key, None)
            if gone is not None:
                self._unindex(gone, gone.salt)
        return problems

    @staticmethod
    def _before(slot: Slot) -> tuple[Tokens, str] | None:
        """What the slot held before the job that runs there now (and whose tenant), when the mirror knows."""
        if slot.phase is SlotPhase.BUSY:
            return None if slot.before is None else (slot.before, slot.before_salt)
        if slot.foreign and not slot.dirty:  # the mirror keeps the contents another router's job started from
            return slot.tokens, slot.salt
        return None

    def slots(self) -> list[Slot]:
        return [s for slots in self.workers.values() for s in slots]

    # ---- routers side by side: another router's jobs on this worker's slots ------------------------------------

    def taken(self, slot: Slot, epoch: int) -> None:
        """Another router's job took the slot (SlotTaken): busy until the update of that epoch or a later one."""
        slot.taken = max(slot.taken, epoch)
        slot.rev[0] += 1

    def refused(self, slot: Slot) -> None:
        """The worker refused this router's job on the slot (slot_busy): another router's job holds it, whose epoch
        comes with its update."""
        slot.taken = max(slot.taken, slot.updated + 1)
        slot.rev[0] += 1

    def updated_by_other(
        self,
        slot: Slot,
        epoch: int,
        tokens: Tokens,
        n_exact: int = 0,
        salt: str = "",
        min_keep: int = 0,
        cuts: Sequence[int] = (),
    ) -> None:
        """Another router's job on the slot ended (SlotUpdate): it holds exactly `tokens` now."""
        slot.updated = max(slot.updated, epoch)
        if slot.phase is SlotPhase.BUSY:  # this router's job, sent meanwhile, starts from what they left
            slot.before, slot.before_exact, slot.before_salt = as_tokens(tokens), n_exact, salt
            slot.before_min_keep, slot.before_cuts = min_keep, tuple(cuts)
            slot.rev[0] += 1
            return
        if salt != slot.salt:
            self._unindex(slot, slot.salt)
            slot.salt = salt
        self._idle(slot, as_tokens(tokens), dirty=False)
        slot.n_exact, slot.min_keep = min(n_exact, len(tokens)), min_keep if len(tokens) else 0
        slot.cuts = tuple(cuts) if len(tokens) else ()

    def assign(self, slot: Slot, job: str, prompt: Tokens, salt: str = "", session: str | None = None) -> None:
        if slot.busy:
            raise RuntimeError(f"{slot!r} is busy with {slot.job}, cannot take {job}")
        slot.phase, slot.job = SlotPhase.BUSY, job
        slot.before_session, slot.session = slot.session, session
        slot.before = None if slot.dirty else slot.tokens
        slot.before_exact, slot.before_salt = slot.n_exact, slot.salt
        slot.before_min_keep, slot.before_cuts = slot.min_keep, slot.cuts
        slot.tokens = as_tokens(prompt)
        slot.dirty = False  # the job goes with prefix_cache=False when the slot was dirty
        if salt != slot.salt:
            self._unindex(slot, slot.salt)
            slot.salt = salt
        self._index(salt).insert(slot, slot.tokens)
        slot.last_used = time.monotonic()
        slot.rev[0] += 1

    def finish(
        self,
        slot: Slot,
        job: str,
        prompt: Tokens,
        generated: Tokens,
        slot_tokens: int,
        slot_hash: str,
        min_keep: int = 0,
        n_exact: int = 0,
        cuts: Sequence[int] = (),
    ) -> Mismatch | None:
        """A JobDone: the slot holds the first `slot_tokens` of prompt + generated, can be cut to `min_keep` or more and
        to its checkpoints (`cuts`), and gives a seeded or deterministic job its first `n_exact`."""
        full = np.concatenate([prompt, generated]) if len(generated) else prompt
        return self._settle(slot, job, full, slot_tokens, slot_hash, min_keep, n_exact, cuts)

    def fail(
        self,
        slot: Slot,
        job: str,
        prompt: Tokens,
        streamed: Tokens,
        touched: bool,
        slot_tokens: int,
        slot_hash: str,
        min_keep: int = 0,
        n_exact: int = 0,
        cuts: Sequence[int] = (),
    ) -> Mismatch | None:
        """A JobError. Untouched (slot -1): the slot holds what it held before the job."""
        if not touched:
            before, before_exact = slot.before, slot.before_exact
            if slot.before_salt != slot.salt:  # the worker never took the job: the slot is the old tenant's still
                self._unindex(slot, slot.salt)
                slot.salt = slot.before_salt
            min_keep, cuts = slot.before_min_keep, slot.before_cuts  # (kept: what the slot held is unchanged)
            slot.session = slot.before_session
            self._idle(slot, EMPTY if before is None else before, dirty=before is None)
            slot.n_exact = before_exact if before is not None else 0
            slot.min_keep = min_keep if before is not None else 0
            slot.cuts = tuple(cuts) if before is not None else ()
            return None
        full = np.concatenate([prompt, streamed]) if len(streamed) else prompt
        return self._settle(slot, job, full, slot_tokens, slot_hash, min_keep, n_exact, cuts)

    def lost(self, slot: Slot) -> None:
        """The job's outcome is unknown (cancelled without report): the slot's contents are unknown."""
        self._idle(slot, EMPTY, dirty=True)

    def check_idle(self, slot: Slot, n_tokens: int) -> bool:
        """A heartbeat's view of an idle slot; False (and the slot marked dirty) when the lengths differ."""
        if slot.busy or slot.dirty or n_tokens == len(slot.tokens):
            return True
        self.mismatches += 1
        self._idle(slot, EMPTY, dirty=True)
        return False

    def _settle(
        self,
        slot: Slot,
        job: str,
        full: Tokens,
        slot_tokens: int,
        slot_hash: str,
        min_keep: int,
        n_exact: int,
        cuts: Sequence[int] = (),
    ) -> Mismatch | None:
        held = full[:slot_tokens]
        if slot_tokens <= len(full) and token_hash(held) == slot_hash:
            self._idle(slot, held, dirty=False)
            slot.n_exact = min(n_exact, slot_tokens)  # (the worker's word: it alone knows which chunks were exact)
            slot.min_keep = min_keep if slot_tokens else 0
            slot.cuts = tuple(c for c in cuts if c <= slot_tokens) if slot_tokens else ()
            return None
        self.mismatches += 1
        mm = Mismatch(slot.worker, slot.index, job, len(full), slot_tokens, token_hash(held), slot_hash)
        self._idle(slot, EMPTY, dirty=True)
        return mm

    def _idle(self, slot: Slot, tokens: Tokens, *, dirty: bool) -> None:
        slot.phase, slot.job, slot.before = SlotPhase.IDLE, None, None
        slot.tokens, slot.dirty, slot.n_exact, slot.min_keep, slot.cuts = tokens, dirty, 0, 0, ()
        if len(tokens) and not dirty:
            self._index(slot.salt).insert(slot, tokens)
        else:
            self._unindex(slot, slot.salt)
        slot.last_used = time.monotonic()
        slot.rev[0] += 1


# ---- sessions: conversations that await their slot ------------------------------------------------------------

TTL_CAP_S = 600.0  # a learned time-to-live is at most this (--tool-wait-s itself may be longer)
PAUSES_KEPT = 4  # a conversation's TTL is learned from its last this many pauses
CONVERSATIONS_KEPT = 4096  # conversations remembered (least recently seen forgotten first)


@dataclass(eq=False)
class Conv:
    """What the router remembers of one conversation: its parent, its pauses, the slot it awaits."""

    key: Conversation
    parent: str | None = None  # the session it is a sub-agent of (None: its session's first conversation)
    pauses: deque[float] = field(default_factory=lambda: deque(maxlen=PAUSES_KEPT))  # tool-call end -> next arrival
    ended: float | None = None  # when its last job ended in tool calls (monotonic): the pause runs from there
    slot: Slot | None = None  # the slot it awaits, until its next request is placed
    until: float = 0.0  # when that wait ends
    lost: bool = False  # another conversation overwrote that slot before `until` (a miss, counted then)


class Sessions:
    """Retention: a conversation whose job ended in tool calls awaits its slot for a time-to-live (TTL), the
    configured `tool_wait_s` (0: retention off), or, once it has come back, max(tool_wait_s, 2 x the longest of its last
    PAUSES_KEPT pauses), the learned part capped at TTL_CAP_S. A pause runs from a job's end in tool calls to the
    conversation's next request's arrival (a pause after a plain reply, a person's, is not learned). The wait ends when
    its next request is placed or the TTL passes (lazily: `Slot.awaited`). Outcomes, counted in `retention`: `hit` (it
    came back within its TTL and was placed on its slot), `miss` (another conversation overwrote the slot within the
    TTL, or it came back within the TTL and was placed elsewhere: its KV gone), `expired` (it came back after its
    TTL)."""

    def __init__(self, tool_wait_s: float, retention: dict[str, int] | None = None) -> None:
        self.tool_wait_s = tool_wait_s
        self.convs: OrderedDict[Conversation, Conv] = OrderedDict()
        self.firsts: OrderedDict[str, str] = OrderedDict()  # session -> head digest of its first conversation
        self.retention: dict[str, int] = retention if retention is not None else {}

    def _count(self, outcome: str) -> None:
        self.retention[outcome] = self.retention.get(outcome, 0) + 1

    def conv(self, key: Conversation, parent_session: str | None = None) -> Conv:
        """The conversation `key` (remembered from now on): a session's first conversation has no parent unless the
        request names one; another conversation of the same session is a sub-agent of it (or of parent_session)."""
        c = self.convs.get(key)
        if c is not None:
            self.convs.move_to_end(key)
            return c
        session, head = key
        first = self.firsts.setdefault(session, head)
        self.firsts.move_to_end(session)
        parent = parent_session if parent_session or first == head else session
        c = self.convs[key] = Conv(key, parent)
        while len(self.convs) > CONVERSATIONS_KEPT:
            self.convs.popitem(last=False)
        while len(self.firsts) > CONVERSATIONS_KEPT:
            self.firsts.popitem(last=False)
        return c

    def arrived(self, key: Conversation, parent_session: str | None, at: float) -> Conv:
        """A request of conversation `key` arrived at `at` (monotonic): the pause since its tool calls is learned."""
        c = self.conv(key, parent_session)
        if c.ended is not None:
            c.pauses.append(max(0.0, at - c.ended))
            c.ended = None
        return c

    def ttl(self, c: Conv) -> float:
        """How long conversation `c` is awaited after its tool calls."""
        learned = min(TTL_CAP_S, 2 * max(c.pauses)) if c.pauses else 0.0
        return max(self.tool_wait_s, learned)

    def ended(self, key: Conversation, slot: Slot, tool_calls: bool, now: float) -> float:
        """A job of conversation `key` on `slot` ended: with tool calls (and retention on, and the slot's contents
        known) the slot is awaited by it for its TTL, which is returned (0: not awaited)."""
        c = self.conv(key)
        c.ended = now if tool_calls else None
        if not tool_calls or self.tool_wait_s <= 0 or slot.dirty or not slot.tokens.size:
            return 0.0
        self._release(c)
        ttl = self.ttl(c)
        c.slot, c.until, c.lost = slot, now + ttl, False
        slot.awaited_by, slot.awaited_until = key, c.until
        return ttl

    def placed(self, key: Conversation | None, slot: Slot, now: float) -> list[str]:
        """A request of conversation `key` (None: no session) is placed on `slot`: a wait that this ends, or a slot of
        another conversation's it overwrites, is counted; what happened, for the log (empty: nothing awaited)."""
        said = []
        other = slot.awaited(now)
        if other is not None and other != key:
            self._count("miss")  # overwritten before its TTL passed (the worker saves it to its host tier, if any)
            said.append(f"overwrote:{other[0][:16]}")
            lost = self.convs.get(other)
            if lost is not None and lost.slot is slot:
                lost.lost = True
            slot.awaited_by = None
        c = self.convs.get(key) if key is not None else None
        if c is None or c.slot is None:
            return said
        if c.lost:
            outcome = "lost"  # (counted when it was overwritten)
        elif now >= c.until:
            outcome = "expired"
        elif c.slot is slot:
            outcome = "hit"
        else:
            outcome = "miss"  # its KV is gone (its worker left, its slot's contents unknown) or did not win
        if outcome != "lost":
            self._count(outcome)
        said.append(outcome)
        self._release(c)
        return said

    @staticmethod
    def _release(c: Conv) -> None:
        """Conversation `c` awaits no slot any more."""
        if c.slot is not None and c.slot.awaited_by == c.key:
            c.slot.awaited_by = None
        c.slot, c.lost = None, False
