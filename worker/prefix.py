"""Prefix sourcing: where a job's prompt prefix comes from when it is not computed. A slot gives what it holds of the
prompt (common/slots.py `reused` and `restore_keep`, the rules the router predicts with: a memory that cannot be cut
back anywhere, recurrent or a window cache of its window alone, is cut back to one of the slot's context checkpoints,
worker/checkpoints.py); another slot's memory (a stream copy), or a state saved in host RAM or on disk (worker/tier.py,
with its checkpoints), gives more when it is worth the copy. Before a slot loses tokens worth keeping, they are saved
to host RAM. A job whose prefix another slot is computing right now waits and copies it.

Owned by the engine's compute thread (worker/core.py): admission (worker/admission.py) asks it whether a job waits
(`awaits`) and has it place a job on a slot (`place`); the engine has it cut a slot back (`trim`, `clear`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common import logs
from common.media import image_floor
from common.slots import common_prefix, restore_keep, reused, worth_copy
from protocol import EngineCounters
from worker import checkpoints
from worker.checkpoints import Budget, Checkpoint
from worker.disk_cache import DiskEntry
from worker.host_cache import Entry
from worker.llama import Llama
from worker.saved_states import SAVE_MIN, SavedStates, from_disk
from worker.slots import Slot, SlotTable
from worker.task import Task, runnable
from worker.tier import SavedState

log = logs.get(__name__)

WAIT_MIN = 32  # a job waits for a busy slot computing its prefix only to gain this many tokens (waiting costs latency)


@dataclass(frozen=True)
class Source:
    """Where a prompt's prefix can be copied from: another slot's KV, or a state a tier saved."""

    lcp: int  # prompt tokens it would give (after the reuse rules)
    slot: Slot | None = None
    saved: SavedState | None = None  # a host-RAM Entry or a DiskEntry


class Prefixes:
    def __init__(
        self,
        llama: Llama,
        table: SlotTable,
        saved: SavedStates,
        counters: EngineCounters,
        *,
        exact: bool,
        uncut: bool,
        budget: Budget | None,
        for_saves: bool = False,
        n_ctx: int,
        n_batch: int,
        every: int = 0,
    ) -> None:
        """`uncut`: the memory cannot be cut back at all (recurrent, hybrid; --snapshots forces it); `budget`: the
        slots take context checkpoints within it (None: they take none); `for_saves`: a slot's memory is cut anywhere, and
        its checkpoints serve only the states saved from it (worker/checkpoints.py `for_saves`); `every`: a checkpoint
        every this many tokens of a long prompt (0: none such)."""
        self.llama, self.table, self.counters = llama, table, counters
        self.host, self.disk, self.tiers = saved.host, saved.disk, saved.tiers
        self.exact = exact  # deterministic mode
        self.uncut = uncut
        self.budget = budget
        self.for_saves = for_saves
        self.n_ctx, self.n_batch, self.every = n_ctx, n_batch, every
        self.rollback = 0  # a recurrent state's positions llama.cpp takes back after a decode (the engine sets it)
        self.copying: set[int] = set()  # slots whose stream copy (seq_cp) llama.cpp does at the next decode

    def place(self, task: Task, slot: Slot) -> None:
        """`task` has `slot` now: keep the slot's longest reusable prefix of the prompt, or copy a longer one in from
        another slot or a saved state (`source`); cut the rest, saving it first when it is worth keeping."""
        task.slot, task.t_assigned = slot.id, task.t_assigned or time.monotonic()  # (a resumed job's: its first)
        prompt, salt = task.prompt, task.job.cache_salt
        if not task.job.prefix_cache or slot.salt != salt:  # (another tenant's KV is never reused: its timing would tell)
            self.save(slot, 0)
            self.clear(slot)
        slot.salt = salt
        seeded = task.seeded
        branch = self.branch(prompt, salt) if task.job.prefix_cache and self.budget is not None else 0
        lcp = self.held(slot, prompt, seeded)
        src = self.source(slot, prompt, lcp, seeded) if task.job.prefix_cache else None
        if src is not None:
            self.save(slot, 0)
            lcp = self.copy(slot, src)
            task.restored = lcp
        if lcp < slot.n_tokens:
            self.save(slot, lcp)
            self.trim(slot, lcp)
        task.reused = slot.n_tokens
        if self.budget is not None:  # where its slot takes checkpoints (the first one now: where its new tokens begin)
            where = checkpoints.for_saves if self.for_saves else checkpoints.positions
            at = where(task.reused, len(prompt), self.every, self.n_batch, self.exact, branch=branch)
            task.checkpoint_at = [p for p in at if image_floor(prompt, p) == p]  # (an image is computed whole)
            self.checkpoint(slot)
        task.restored = min(task.restored, task.reused)
        c = self.counters
        c.reused_tokens += task.reused
        c.restored_tokens += task.restored
        if src is not None and src.slot is not None:
            c.restored_from_slots += task.restored
        elif src is not None:
            c.restored_from_host += task.restored
        c.prefilled_tokens += len(prompt) - task.reused
        log.debug(
            "slot_assigned",
            request_id=task.id,
            slot=slot.id,
            reused=task.reused,
            restored=task.restored,
            prefilled=len(prompt) - task.reused,
            predicted_reuse=task.job.predicted_reuse,
        )

    def held(self, slot: Slot, prompt: list[int], seeded: bool = False) -> int:
        """Prompt tokens `slot` gives (the rules the router predicts with, common/slots.py): their LCP, minus one on a
        full match (logits are not cached: the last prompt token must be computed again); in deterministic mode only
        KV computed as prompt, leaving a full-size chunk to compute, and to a seeded job otherwise only KV computed as
        a seeded job's prompt (`n_exact` both); then where its memory can be cut back to (`min_keep`), or its longest
        checkpoint within that, or nothing."""
        lcp = image_floor(prompt, reused(common_prefix(slot.tokens, prompt), len(prompt), slot.n_exact, self.exact, seeded))
        return restore_keep(lcp, slot.n_tokens, self.min_keep(slot), checkpoints.cuts(slot.checkpoints))

    def branch(self, prompt: list[int], salt: str) -> int:
        """The longest prefix of `prompt` a slot or saved state of this tenant holds, whether or not it can be cut back
        there: where the prompt branches off what is held (a checkpoint there gives it to the next prompt that does)."""
        held = [common_prefix(s.tokens, prompt) for s in self.table.slots if s.salt == salt]
        for tier in self.tiers:
            held += [n for _, n in tier.sharing(prompt, salt)]
        return max(held, default=0)

    def restorable(self, entry: SavedState, prompt: list[int], seeded: bool = False) -> int:
        """Prompt tokens a saved state gives (as `held`)."""
        lcp = image_floor(prompt, reused(common_prefix(entry.tokens, prompt), len(prompt), entry.n_exact, self.exact, seeded))
        return restore_keep(lcp, len(entry.tokens), self.entry_min_keep(entry.pos_min, len(entry.tokens)), entry.cuts)

    def min_keep(self, slot: Slot) -> int:
        """The shortest prefix `slot`'s memory can be cut to (for the router's mirror too): its length for a memory that
        cannot be cut; where its sliding-window layers begin allows; else 0."""
        return self.entry_min_keep(self.llama.seq_pos_min(slot.id), slot.n_tokens) if slot.n_tokens else 0

    def entry_min_keep(self, pos_min: int, n: int) -> int:
        """The shortest prefix a sequence of `n` tokens whose memory begins at `pos_min` can be cut to."""
        return n if self.uncut else self.llama.min_keep(pos_min, n)

    def keeps(self, slot: Slot, n: int) -> bool:
        """Whether `slot`, saved as it is, could give its first `n` tokens back: a saved state's window layers hold only
        their last window (`state_pos_min`), so it is cut back only as far as they and its checkpoints allow."""
        if n > slot.n_tokens:
            return False
        min_keep = self.entry_min_keep(self.llama.state_pos_min(slot.id, slot.n_tokens), slot.n_tokens)
        return restore_keep(n, slot.n_tokens, min_keep, checkpoints.cuts(slot.checkpoints)) == n

    def source(self, slot: Slot, prompt: list[int], have: int, seeded: bool) -> Source | None:
        """Another slot (idle or busy: its KV is committed) or a saved state of the same tenant (`slot.salt`) that gives
        enough more of the prompt than the `have` tokens `slot` gives itself to be worth a copy; the one giving most."""
        best: Source | None = None
        salt = slot.salt
        for other in self.table.slots:
            if other is slot or not other.tokens or other.salt != salt:
                continue
            lcp = self.held(other, prompt, seeded)
            if other.id in self.copying and lcp < self.min_keep(other):
                continue  # (its state is not written yet: it could only be copied as a stream, not cut back after)
            if worth_copy(lcp - have, self.n_ctx) and (best is None or lcp > best.lcp):
                best = Source(lcp, slot=other)
        if slot.id in self.copying:  # a restore writes the slot's cells now; a stream copy still pending would not
            return best
        entry, lcp = self.best_saved(prompt, salt, seeded)
        if entry is not None and worth_copy(lcp - have, len(entry.tokens)) and (best is None or lcp > best.lcp):
            best = Source(lcp, saved=entry)
        return best

    def best_saved(self, prompt: list[int], salt: str, seeded: bool) -> tuple[SavedState | None, int]:
        """This tenant's saved state giving the most of `prompt` (`restorable`), and that much: the most tokens, then
        the fewest to copy, then host RAM before disk (the router's choice: router/select.py `best_saved`)."""
        best: tuple[int, int, int] | None = None
        top: SavedState | None = None
        for rank, tier in enumerate(self.tiers):
            for entry, _ in tier.sharing(prompt, salt):
                key = (self.restorable(entry, prompt, seeded), -len(entry.tokens), -rank)
                if key[0] > 0 and (best is None or key > best):
                    best, top = key, entry
        return top, best[0] if best is not None else 0

    def copy(self, slot: Slot, src: Source) -> int:
        """Replace what `slot` holds by the source's (its checkpoints too); returns how many of its tokens to keep (0 on
        failure).

        From another slot, llama.cpp copies the whole stream (every layer in full), at the next decode: a cut the
        memory allows is valid then; one to a checkpoint would write the checkpoint into cells that copy overwrites
        after, so for that the state goes through host memory instead. From a saved state, it comes back with only the
        last window of its sliding-window layers (`pos_min`)."""
        if src.slot is not None:
            other = src.slot
            if src.lcp < self.min_keep(other):
                return src.lcp if self._copy_state(slot, other) else 0
            self.llama.seq_cp(other.id, slot.id)
            self.copying.add(slot.id)
            slot.hold(list(other.tokens), other.n_exact, list(other.checkpoints))
            self.counters.slot_copies += 1
            return src.lcp
        saved = src.saved
        if isinstance(saved, Entry):
            restored = self._restore(slot, saved)
        else:
            assert isinstance(saved, DiskEntry)
            restored = self._restore_from_disk(slot, saved)
        return src.lcp if restored else 0

    def _copy_state(self, slot: Slot, other: Slot) -> bool:
        """Copy what `other` holds into `slot` through host memory (its state read out, written in). False (slot
        cleared) when llama.cpp refuses."""
        try:
            data = self.llama.state_get(other.id)
        except (RuntimeError, MemoryError) as exc:
            log.warning("state_copy_failed", slot=slot.id, source=other.id, error=str(exc))
            data = None
        if data is None or not self.llama.state_set(slot.id, data):
            self.counters.copy_failures += 1
            self.clear(slot)
            return False
        slot.hold(list(other.tokens), other.n_exact, list(other.checkpoints))
        self.counters.slot_copies += 1
        return True

    def _restore(self, slot: Slot, entry: Entry) -> bool:
        """Write a host-RAM entry into the slot; False (slot cleared) when llama.cpp refuses it."""
        t0 = time.perf_counter()
        if not self.llama.state_set(slot.id, entry.data):
            self.counters.copy_failures += 1
            log.warning("state_restore_refused", slot=slot.id, tokens=len(entry.tokens))
            self.host.drop(entry)  # it would fail again
            self.clear(slot)
            return False
        slot.hold(list(entry.tokens), entry.n_exact, list(entry.checkpoints))
        self.host.used(entry)
        self.counters.host_restores += 1
        self.counters.host_restore_bytes += entry.nbytes
        self.counters.host_restore_s += time.perf_counter() - t0
        return True

    def _restore_from_disk(self, slot: Slot, entry: DiskEntry) -> bool:
        """Read a disk-tier entry (checked against its checksum) into the slot; False (slot cleared) when it fails."""
        assert self.disk is not None
        t0 = time.perf_counter()
        data = self.disk.read(entry)  # (a file that does not check out is removed: the prompt is computed instead)
        state, ckpts = from_disk(data, entry.checkpoints) if data is not None else (None, [])
        if data is None or state is None or not self.llama.state_set(slot.id, state):
            self.counters.disk_restore_failures += 1
            log.warning("disk_restore_failed", slot=slot.id, tokens=len(entry.tokens), read=data is not None)
            if data is not None:
                self.disk.drop(entry)
            self.clear(slot)
            return False
        slot.hold(list(entry.tokens), entry.n_exact, ckpts)
        self.disk.used(entry)
        self.counters.disk_restores += 1
        self.counters.disk_restore_bytes += len(data)
        self.counters.disk_restore_s += time.perf_counter() - t0
        return True

    def save(self, slot: Slot, keep: int) -> None:
        """`slot` is about to keep only `keep` of its tokens: copy it to host RAM first when what it loses is worth
        it and no other slot or entry holds it."""
        if not self.host.capacity or slot.n_tokens - keep < SAVE_MIN or slot.id in self.copying:
            return  # (a slot whose stream copy is still pending has no KV to read yet)
        tokens, n, salt = slot.tokens, slot.n_tokens, slot.salt
        if self.host.covers(tokens, salt) or any(
            o is not slot and o.salt == salt and o.tokens[:n] == tokens and self.keeps(o, n) for o in self.table.slots
        ):
            return
        pos_min = self.llama.state_pos_min(slot.id, n)
        cut = self.entry_min_keep(pos_min, n) > 0  # it cannot be cut back anywhere: its checkpoints go with it
        kept = tuple(slot.checkpoints) if cut else ()
        # (and more, taken on the way down to `keep`: near its end and every window, worker/checkpoints.py `on_save`)
        taken = [c.n_tokens for c in kept]
        more = checkpoints.on_save(keep, n, self.llama.info.n_swa, self.min_keep(slot), taken) if self.for_saves and cut else []
        extra = self.llama.partial_size(slot.id) * len(more)  # (at most a window each)
        if not self.host.make_room(self.llama.state_size(slot.id) + sum(c.nbytes for c in kept) + extra):
            return  # over the whole budget: nothing is allocated
        tokens, n_exact = list(tokens), slot.n_exact  # (the slot is cut back below)
        try:
            data = self.llama.state_get(slot.id)
        except (RuntimeError, MemoryError) as exc:  # the copy is a nicety: the job goes on without it
            self.counters.host_save_failures += 1
            log.warning("host_save_failed", slot=slot.id, tokens=n, error=str(exc))
            return
        for p in more:
            if (ckpt := self._cut_to_checkpoint(slot, p)) is None:
                break  # (the slot was cleared: it is overwritten next anyway)
            kept = (*kept, ckpt)
        kept = tuple(sorted(kept, key=lambda c: c.n_tokens))
        if self.host.put(tokens, n_exact, pos_min, data, salt, slot.id, kept):
            self.counters.host_saves += 1

    def _cut_to_checkpoint(self, slot: Slot, n: int) -> Checkpoint | None:
        """Cut `slot` (about to lose those tokens anyway) back to its first `n` tokens and take its window there: a
        checkpoint for the state just saved from it. None where that fails (the slot is then cleared)."""
        if not self.llama.seq_rm(slot.id, slot.pos(n), -1):
            log.warning("seq_rm_refused", slot=slot.id, keep=n, held=slot.n_tokens)
            self.clear(slot)
            return None
        slot.keep(n)
        try:
            return Checkpoint(n, self.llama.partial_get(slot.id))
        except (RuntimeError, MemoryError) as exc:
            log.warning("checkpoint_failed", slot=slot.id, tokens=n, error=str(exc))
            return None

    def awaits(self, task: Task) -> bool:
        """Whether a busy slot is computing a prefix of this prompt longer (by a copy's worth) than any KV held now:
        then the job waits for it and copies it, instead of computing the same tokens a second time alongside."""
        if not task.job.prefix_cache:
            return False
        prompt, salt, seeded = task.prompt, task.job.cache_salt, task.seeded
        busy = [s for s in self.table.busy() if s.task is not None]
        running = runnable(busy)  # (a job of lower priority is paused: not waited for)
        computing = [s for s in running if not s.task.generated and s.salt == salt]
        if seeded and not self.exact:  # (a seeded job reuses only what a seeded job computes)
            computing = [s for s in computing if s.task.seeded]
        if not computing:
            return False
        have = max([self.held(s, prompt, seeded) for s in self.table.slots if s.salt == salt] + [0])
        have = max(have, self.best_saved(prompt, salt, seeded)[1])
        for s in computing:
            shared = min(common_prefix(s.task.prompt, prompt), len(prompt) - 1)
            if self.budget is not None and not self.for_saves:  # it is cut back only to where it takes a checkpoint
                shared = max((p for p in s.task.checkpoint_at if p <= shared), default=0)
            if s.n_tokens < shared and shared - have >= WAIT_MIN:
                return True
        return False

    def trim(self, slot: Slot, n: int) -> None:
        """Make the slot hold only its first n tokens; where its memory cannot be cut there, its longest checkpoint
        within them (or nothing)."""
        if n >= slot.n_tokens:
            return
        if n >= self.min_keep(slot):
            if self.llama.seq_rm(slot.id, slot.pos(n), -1):
                slot.keep(n)
                return
            log.warning("seq_rm_refused", slot=slot.id, keep=n, held=slot.n_tokens)
            self.clear(slot)
            return
        ckpt = next((c for c in reversed(slot.checkpoints) if c.n_tokens <= n), None)
        if ckpt is None:
            self.clear(slot)
            return
        # the part that cannot be cut comes back from the checkpoint, the rest (attention KV) is cut there
        if self.llama.partial_set(slot.id, ckpt.data) and self.llama.seq_rm(slot.id, slot.pos(ckpt.n_tokens), -1):
            slot.keep(ckpt.n_tokens)
            self.counters.snapshot_restores += 1
            return
        log.warning("checkpoint_restore_refused", slot=slot.id, keep=ckpt.n_tokens, held=slot.n_tokens)
        self.clear(slot)

    def unguess(self, slot: Slot, n: int) -> None:
        """Take a slot back to its first `n` tokens right after a decode with guesses: a recurrent state by llama.cpp's
        rollback (`rollback` positions at most, once between two decodes), else as `trim`."""
        if self.uncut and 0 < slot.n_tokens - n <= self.rollback and self.llama.seq_rm(slot.id, slot.pos(n), -1):
            slot.keep(n)
            return
        self.trim(slot, n)

    def checkpoint(self, slot: Slot) -> None:
        """Save the part of the slot's memory that cannot be cut back, at its current length (worker/checkpoints.py),
        unless it has one there, its state is not written yet (a stream copy pending) or the budget has no room."""
        n = slot.n_tokens
        if self.budget is None or n == 0 or slot.id in self.copying or checkpoints.at(slot.checkpoints, n):
            return
        if not self.budget.fits(self.llama.partial_size(slot.id)):
            return
        try:
            data = self.llama.partial_get(slot.id)
        except (RuntimeError, MemoryError) as exc:  # a nicety: the job goes on without it
            log.warning("checkpoint_failed", slot=slot.id, tokens=n, error=str(exc))
            return
        if self.budget.add(slot, Checkpoint(n, data), self.table.slots):
            self.counters.checkpoints_taken += 1

    def clear(self, slot: Slot) -> None:
        self.llama.seq_clear(slot.id)
        slot.keep(0)
        slot.checkpoints = []
