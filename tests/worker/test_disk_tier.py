"""The disk tier in the engine, with the real default model (deterministic, so a restored prefix must give exactly
what a cold computation gives): host RAM spills to disk, a restart finds what a graceful stop wrote, and a file
that does not check out is removed and its prompt computed."""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_helpers import assert_slot_invariant, complete

import worker.saved_states
from protocol import JobDone, unpack_tokens
from worker.config import WorkerConfig
from worker.disk_cache import DiskEntry
from worker.engine import Engine
from worker.saved_states import ENTRY_OVERHEAD_BYTES

pytestmark = pytest.mark.model

STORY = (
    "The ferry log, winter. Ice formed on the rails before dawn and the crossing was delayed by an hour. "
    "Twelve cars and a lorry of timber came over; the captain noted a loose plate on the ramp and a gull on the mast. "
)


def engine_on(directory: Path, host_mb: int = 4) -> Engine:
    """2 slots; host RAM for one ~150-token state (18 KiB a token), so a second save spills the first to disk."""
    cfg = WorkerConfig(slots=2, ctx_per_slot=1024, threads=2, deterministic=True, host_cache_mb=host_mb, cache_dir=str(directory))
    return Engine(cfg).start()


def history(vocab, i: int) -> list[int]:
    return vocab.tokenize(f"Log {i}. " + STORY * 3)


def question(vocab, hist: list[int]) -> list[int]:
    return hist + vocab.tokenize(" Question: what was loose?", add_special=False)


def test_host_ram_spills_to_disk_and_a_prompt_is_restored_from_there(tmp_path, vocab):
    eng = engine_on(tmp_path)
    try:
        a = history(vocab, 1)
        first = complete(eng, a, slot=0, max_tokens=2)
        # each overwrites slot 0: the previous history goes to host RAM, which holds one
        runs = [complete(eng, history(vocab, i), slot=0, max_tokens=2) for i in (2, 3)]
        assert eng.disk is not None and eng.disk.flush(30)
        held = (a + unpack_tokens(first.final.tokens))[: first.final.slot_tokens]
        assert [e.tokens for e in eng.disk.entries] == [held]  # history 1 went from host RAM to disk
        runs.append(complete(eng, vocab.tokenize("Tell the router."), slot=1, max_tokens=1))
        # the router hears of it with the next JobDone once written, tokens and all
        (entry,) = [e for r in runs for e in r.cache_added if e.tier == "disk"]
        assert unpack_tokens(entry.tokens) == held and entry.n_tokens == len(held)
        prompt = question(vocab, a)
        back = complete(eng, prompt, slot=1)
        cold = complete(eng, prompt, slot=0, prefix_cache=False)
        assert isinstance(back.final, JobDone) and back.final.restored_tokens == back.final.reused_tokens >= len(a) - 8
        assert back.tokens == cold.tokens
        assert eng.counters.disk_restores == 1 and eng.counters.disk_restore_failures == 0
        assert_slot_invariant(eng, back)
    finally:
        eng.stop()


def test_a_restart_restores_what_a_graceful_stop_wrote_and_a_bad_file_is_served_cold(tmp_path, vocab, monkeypatch):
    a, b = history(vocab, 4), history(vocab, 5)
    eng = engine_on(tmp_path, host_mb=64)
    try:
        complete(eng, a, slot=0, max_tokens=2)
        complete(eng, b, slot=1, max_tokens=2)
        refs = [complete(eng, question(vocab, h), slot=0, prefix_cache=False) for h in (a, b)]  # cold answers
        assert eng.persist(30) >= 2  # slot 1 (history b), host RAM (history a, evicted from slot 0)
    finally:
        eng.stop()
    files = sorted(tmp_path.glob("*.kvs"))
    assert len(files) >= 2
    eng = engine_on(tmp_path, host_mb=64)
    try:
        slots, cached = eng.held().result(30)
        assert not any(unpack_tokens(s.tokens) for s in slots)  # a new process: empty slots...
        on_disk = [unpack_tokens(c.tokens) for c in cached if c.tier == "disk"]
        assert any(t[: len(a)] == a for t in on_disk) and any(t[: len(b)] == b for t in on_disk)  # ...a warm disk
        # a hello carries only what fits its budget (here one state): the most recently used
        monkeypatch.setattr(worker.saved_states, "HELLO_LISTING_BYTES", 4 * max(map(len, on_disk)) + ENTRY_OVERHEAD_BYTES)
        _, few = eng.held().result(30)
        assert len(few) == 1 and few[0].id == max(eng.disk.entries, key=lambda e: e.last_used).id
        monkeypatch.undo()
        back = complete(eng, question(vocab, a), slot=0)
        assert isinstance(back.final, JobDone) and back.final.restored_tokens >= len(a) - 8
        assert not [e for e in back.cache_added if e.tier == "disk"]  # the hello told them: not sent twice
        assert back.tokens == refs[0].tokens  # restored after the restart: the same answer as computed cold
        # a file damaged on disk: logged, removed, and its prompt computed instead
        asked = question(vocab, b)  # the entry that prompt would be restored from (worker/prefix.py `best_saved`):
        bad, _ = eng.call(lambda e: e.prefixes.best_saved(asked, "", False)).result(30)
        assert isinstance(bad, DiskEntry)
        raw = bytearray(bad.path.read_bytes())
        raw[-100] ^= 0xFF
        bad.path.write_bytes(bytes(raw))
        again = complete(eng, question(vocab, b), slot=1)
        assert isinstance(again.final, JobDone) and again.final.reused_tokens == 0
        assert again.tokens == refs[1].tokens
        assert eng.counters.disk_restore_failures == 1 and not bad.path.exists()
    finally:
        eng.stop()
