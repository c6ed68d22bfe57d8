"""Prefix sourcing: where a job's prompt prefix comes from when it is not computed. A slot gives what it holds of the
prompt (kvroute/slots.py `reused`, the rule the router predicts with); another slot's KV (a stream copy), or a state
saved in host RAM or on disk (worker/saved.py), gives more when it is worth the copy. Before a slot loses tokens
worth keeping, they are saved to host RAM. A job whose prefix another slot is computing right now waits and copies it.

Owned by the engine's compute thread (worker/core.py): admission (worker/admission.py) asks it whether a job waits
(`awaits`) and has it place a job on a slot (`place`); the engine has it cut a slot back (`trim`, `clear`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvroute import logs
from kvroute.slots import COPY_MIN, common_prefix, restore_keep, reused, worth_copy
from protocol import EngineCounters
from worker.disk_cache import DiskEntry
from worker.host_cache import Entry
from worker.llama import Llama
from worker.saved import SavedState
from worker.saved_states import SAVE_MIN, SavedStates
from worker.slots import Slot, SlotTable
from worker.task import Task

log = logs.get(__name__)


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
        snapshots: bool,
        n_ctx: int,
    ) -> None:
        self.llama, self.table, self.counters = llama, table, counters
        self.host, self.disk, self.tiers = saved.host, saved.disk, saved.tiers
        self.exact = exact  # deterministic mode
        self.snapshots = snapshots  # this model's memory is cut back by restoring a snapshot, not by seq_rm
        self.copies = not snapshots  # KV can be trimmed, so prefixes can move between slots and tiers
        self.n_ctx = n_ctx
        self.copying: set[int] = set()  # slots whose stream copy (seq_cp) llama.cpp does at the next decode

    def place(self, task: Task, slot: Slot) -> None:
        """`task` has `slot` now: keep the slot's longest reusable prefix of the prompt, or copy a longer one in from
        another slot or a saved state (`source`); cut the rest, saving it first when it is worth keeping."""
        task.slot, task.t_assigned = slot.id, time.monotonic()
        prompt, salt = task.prompt, task.job.cache_salt
        if not task.job.prefix_cache or slot.salt != salt:  # (another tenant's KV is never reused: its timing would tell)
            self.save(slot, 0)
            self.clear(slot)
        slot.salt = salt
        seeded = task.seeded
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

    def reusable(self, tokens: list[int], n_exact: int, prompt: list[int], pos_min: int, seeded: bool = False) -> int:
        """Prompt tokens a sequence holding `tokens` can give: their LCP, minus one on a full match (logits are not
        cached: the last prompt token must be computed again); in deterministic mode only KV computed as prompt,
        leaving a full-size chunk to compute, and to a seeded job otherwise only KV computed as a seeded job's prompt
        (`n_exact` both); none when its sliding-window layers start at `pos_min`, too late for the cut (a state
        restored from host RAM can only be extended, not cut far back)."""
        lcp = reused(common_prefix(tokens, prompt), len(prompt), n_exact, self.exact, seeded)
        return lcp if self.llama.can_keep(pos_min, len(tokens), lcp) else 0

    def held(self, slot: Slot, prompt: list[int], seeded: bool = False) -> int:
        """What `slot` gives of `prompt` (`reusable`)."""
        return self.reusable(slot.tokens, slot.n_exact, prompt, self.llama.seq_pos_min(slot.id), seeded)

    def restorable(self, entry: SavedState, prompt: list[int], seeded: bool = False) -> int:
        """Prompt tokens a saved state gives (the rule the router predicts with: kvroute/slots.py)."""
        lcp = reused(common_prefix(entry.tokens, prompt), len(prompt), entry.n_exact, self.exact, seeded)
        return restore_keep(lcp, len(entry.tokens), self.llama.min_keep(entry.pos_min))

    def min_keep(self, slot: Slot) -> int:
        """The shortest prefix `slot` can be cut to (`reusable`'s rule, for the router's mirror): above 0 only while it
        holds a state restored from host RAM or disk."""
        return self.llama.min_keep(self.llama.seq_pos_min(slot.id)) if slot.n_tokens else 0

    def source(self, slot: Slot, prompt: list[int], have: int, seeded: bool) -> Source | None:
        """Another slot (idle or busy: its KV is committed) or a saved state of the same tenant (`slot.salt`) that gives
        enough more of the prompt than the `have` tokens `slot` gives itself to be worth a copy; the one giving most."""
        if not self.copies:
            return None
        best: Source | None = None
        salt = slot.salt
        for other in self.table.slots:
            if other is slot or not other.tokens or other.salt != salt:
                continue
            lcp = self.held(other, prompt, seeded)
            if worth_copy(lcp - have, self.n_ctx) and (best is None or lcp > best.lcp):
                best = Source(lcp, slot=other)
        if slot.id in self.copying:  # a restore writes the slot's cells now; a stream copy still pending would not
            return best
        for tier in self.tiers:
            entry, _ = tier.best(prompt, salt)
            if entry is None:
                continue
            lcp = self.restorable(entry, prompt, seeded)
            if worth_copy(lcp - have, len(entry.tokens)) and (best is None or lcp > best.lcp):
                best = Source(lcp, saved=entry)
        return best

    def copy(self, slot: Slot, src: Source) -> int:
        """Replace what `slot` holds by the source's; returns how many of its tokens to keep (0 on failure).

        From another slot, llama.cpp copies the whole stream (every layer in full, so any cut is valid). From a saved
        state, it comes back with only the last window of its sliding-window layers (`pos_min`)."""
        if src.slot is not None:
            self.llama.seq_cp(src.slot.id, slot.id)
            self.copying.add(slot.id)
            slot.tokens, slot.n_exact, slot.snapshot = list(src.slot.tokens), src.slot.n_exact, None
            self.counters.slot_copies += 1
            return src.lcp
        saved = src.saved
        if isinstance(saved, Entry):
            restored = self._restore(slot, saved)
        else:
            assert isinstance(saved, DiskEntry)
            restored = self._restore_from_disk(slot, saved)
        return src.lcp if restored else 0

    def _restore(self, slot: Slot, entry: Entry) -> bool:
        """Write a host-RAM entry into the slot; False (slot cleared) when llama.cpp refuses it."""
        t0 = time.perf_counter()
        if not self.llama.state_set(slot.id, entry.data):
            self.counters.copy_failures += 1
            log.warning("state_restore_refused", slot=slot.id, tokens=len(entry.tokens))
            self.host.drop(entry)  # it would fail again
            self.clear(slot)
            return False
        slot.tokens, slot.n_exact, slot.snapshot = list(entry.tokens), entry.n_exact, None
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
        if data is None or not self.llama.state_set(slot.id, data):
            self.counters.disk_restore_failures += 1
            log.warning("disk_restore_failed", slot=slot.id, tokens=len(entry.tokens), read=data is not None)
            if data is not None:
                self.disk.drop(entry)
            self.clear(slot)
            return False
        slot.tokens, slot.n_exact, slot.snapshot = list(entry.tokens), entry.n_exact, None
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
        if self.host.put(tokens, slot.n_exact, pos_min, data, salt, slot.id):
            self.counters.host_saves += 1

    def awaits(self, task: Task) -> bool:
        """Whether a busy slot is computing a prefix of this prompt longer (by a copy's worth) than any KV held now:
        then the job waits for it and copies it, instead of computing the same tokens a second time alongside."""
        if not self.copies or not task.job.prefix_cache:
            return False
        prompt, salt, seeded = task.prompt, task.job.cache_salt, task.seeded
        computing = [s for s in self.table.busy() if s.task is not None and not s.task.generated and s.salt == salt]
        if seeded and not self.exact:  # (a seeded job reuses only what a seeded job computes)
            computing = [s for s in computing if s.task.seeded]
        if not computing:
            return False
        have = max([self.held(s, prompt, seeded) for s in self.table.slots if s.salt == salt] + [0])
        for tier in self.tiers:
            saved, _ = tier.best(prompt, salt)
            if saved is not None:
                have = max(have, self.restorable(saved, prompt, seeded))
        for s in computing:
            shared = min(common_prefix(s.task.prompt, prompt), len(prompt) - 1)
            if s.n_tokens < shared and shared - have >= COPY_MIN:
                return True
        return False

    def trim(self, slot: Slot, n: int) -> None:
        """Make the slot hold only its first n tokens, or fewer if its memory cannot be cut there."""
        if not self.snapshots:
            if self.llama.seq_rm(slot.id, n, -1):
                slot.keep(n)
                return
            log.warning("seq_rm_refused", slot=slot.id, keep=n, held=slot.n_tokens)
            self.clear(slot)
            return
        snap = slot.snapshot
        if snap is not None and snap.n_tokens <= n and self.llama.state_set(slot.id, snap.data):
            slot.keep(snap.n_tokens)
            self.counters.snapshot_restores += 1
            return
        self.clear(slot)

    def clear(self, slot: Slot) -> None:
        self.llama.seq_clear(slot.id)
        slot.keep(0)
        slot.snapshot = None
