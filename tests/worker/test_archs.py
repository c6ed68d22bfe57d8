"""The engine on tiny random-weight models of the hybrid, recurrent and sliding-window architectures (issue 48:
bench/tiny_archs.py writes them from llama.cpp's own test layouts). Prompts are token ids (the models have no real
vocabulary). Each turn is also run cold in another slot: cached must equal cold, token for token; and each reuse
must be what the router predicts from what the worker reported (common/slots.py `restore_keep`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from worker_helpers import complete

from bench import tiny_archs
from common.slots import common_prefix, restore_keep, reused
from protocol import JobDone
from worker.config import WorkerConfig
from worker.core import ROLLBACK
from worker.engine import Engine

pytestmark = pytest.mark.model

# qwen35 qwen3next nemotron_h granitehybrid lfm2 mamba2 jamba falcon-h1 gemma3, and gemma3 with a window cache of
# its window alone (`gemma3-window`: --swa-full off)
ARCHS = (*tiny_archs.ARCHS, "gemma3-window")
COLD = 2  # the slot cold runs take


def engine(arch: str, cache_dir: Path | None = None, **kw) -> Engine:
    if arch == "gemma3-window":
        arch, kw["swa_full"] = "gemma3", "off"
    kw.setdefault("ctx_per_slot", 256)
    cfg = WorkerConfig(
        model=str(tiny_archs.model(arch)),
        slots=3,
        threads=2,
        n_batch=64,
        host_cache_mb=64,
        cache_dir=str(cache_dir) if cache_dir else None,
        **kw,
    )
    return Engine(cfg).start()


@dataclass
class Mirror:
    """What the router knows of each slot after each job: its tokens, where it can be cut back to."""

    slots: dict[int, tuple[list[int], int, list[int], int]] = field(default_factory=dict)

    def predict(self, slot: int, prompt: list[int], exact: bool) -> int:
        held, min_keep, cuts, n_exact = self.slots.get(slot, ([], 0, [], 0))
        lcp = reused(common_prefix(held, prompt), len(prompt), n_exact, exact)
        return restore_keep(lcp, len(held), min_keep, cuts) if held else 0

    def settle(self, slot: int, prompt: list[int], done: JobDone, generated: list[int]) -> None:
        held = (prompt + generated)[: done.slot_tokens]
        self.slots[slot] = (held, done.slot_min_keep, list(done.slot_cuts), done.slot_n_exact)


def turn(eng: Engine, mirror: Mirror, prompt: list[int], slot: int, exact: bool = False, copied: bool = False) -> list[int]:
    """Run `prompt` on `slot` and cold; returns the tokens. Without `copied`, the reuse must be the slot's own as
    predicted; with it, at least that (a copy from another slot or a saved state adds to it, counted as restored)."""
    predicted = mirror.predict(slot, prompt, exact)
    warm = complete(eng, prompt, slot=slot, max_tokens=5)
    cold = complete(eng, prompt, slot=COLD, max_tokens=5, prefix_cache=False)
    assert isinstance(warm.final, JobDone) and isinstance(cold.final, JobDone), (warm.final, cold.final)
    assert warm.tokens == cold.tokens, f"cached {warm.tokens} != cold {cold.tokens}"
    done = warm.final
    if copied:
        assert done.reused_tokens >= predicted and done.restored_tokens > 0, (done.reused_tokens, predicted)
    else:
        assert (done.reused_tokens, done.restored_tokens) == (predicted, 0)
    mirror.settle(slot, prompt, done, warm.tokens)
    mirror.settle(COLD, prompt, cold.final, cold.tokens)
    return warm.tokens


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def test_a_hybrid_with_a_sliding_window_serves_turn_after_turn_with_its_invariant_held():
    """LFM2's layout (short convolutions + sliding-window attention, llama.cpp's hybrid iSWA memory): llama.cpp reports
    the recurrent state's position as the sequence's pos_min, which the slot invariant read as a sliding window
    starting too late: every request failed with "slot 0 believed it held 11 tokens but its KV holds positions
    10..10"."""
    eng = Engine(WorkerConfig(model=str(tiny_archs.model("lfm2")), slots=1, ctx_per_slot=256, threads=2)).start()
    try:
        rnd = random.Random(1)
        history = [rnd.randrange(128) for _ in range(12)]
        for _ in range(3):
            prompt = history + [rnd.randrange(128) for _ in range(6)]
            run = complete(eng, prompt, slot=0, max_tokens=4)
            assert isinstance(run.final, JobDone), run.final
            assert run.final.slot_tokens == len(prompt) + len(run.tokens) - 1
            history = prompt + run.tokens
        assert eng.counters.invariant_violations == 0
    finally:
        eng.stop()


def conversation(eng: Engine, exact: bool, turns: int = 6) -> Iterator[int]:
    """Agent turns on slot 0: the next prompt extends the slot exactly, or re-sends the reply otherwise (diverging in
    it), or changes the last tokens of the prompt before it (a template rendering the generation prompt otherwise);
    yields each turn's reuse."""
    mirror, rnd = Mirror(), random.Random(3)
    history = [rnd.randrange(128) for _ in range(40)]
    for i in range(turns):
        prompt = history + [rnd.randrange(128) for _ in range(12)]
        out = turn(eng, mirror, prompt, 0, exact)
        yield mirror.slots[0][0].__len__()
        history = [
            prompt + out,  # the reply as it was
            [*prompt, *out[:2], 77, 78],  # the reply re-sent otherwise after 2 tokens
            [*prompt[:-2], 99],  # the prompt's last 2 tokens rendered otherwise
        ][i % 3]


def test_turns_resume_from_the_slot_or_its_checkpoints_as_predicted_and_cached_equals_cold(arch):
    eng = engine(arch)
    try:
        assert sum(1 for _ in conversation(eng, exact=False)) == 6
        c = eng.counters
        assert c.invariant_violations == 0 and c.decode_errors == 0
        if arch != "gemma3":  # (a window cache of the full length: the slot is cut anywhere, no checkpoint needed)
            assert c.checkpoints_taken > 0
        if not arch.startswith("gemma3"):  # (a window cache of its window: these cuts are all within what it holds)
            assert c.snapshot_restores > 0
    finally:
        eng.stop()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2", "lfm2", "gemma3-window"])
def test_deterministic_mode_resumes_from_checkpoints_with_the_same_tokens_as_cold(arch):
    eng = engine(arch, deterministic=True)
    try:
        assert sum(1 for _ in conversation(eng, exact=True)) == 6
        assert eng.counters.invariant_violations == 0
    finally:
        eng.stop()


def test_copies_between_slots_host_ram_and_the_disk_tier_after_a_restart(arch, tmp_path):
    """A prompt extending another slot is copied from it; one diverging in that slot's reply, from its checkpoint at
    the prompt's end (through host memory); a conversation whose slot was overwritten comes back from host RAM; after
    a graceful stop and a new engine, from the disk tier. Cached equals cold throughout."""
    rnd = random.Random(5)
    base = [rnd.randrange(128) for _ in range(60)]
    eng = engine(arch, tmp_path / "disk")
    try:
        mirror = Mirror()
        out = turn(eng, mirror, base, 0)
        turn(eng, mirror, base + out + [3] * 30, 1, copied=True)  # the whole of slot 0 copied in
        other = [rnd.randrange(128) for _ in range(50)]
        turn(eng, mirror, other, 0)  # slot 0 overwritten: its previous contents go to host RAM
        turn(eng, mirror, other + [1] * 20, 1, copied=True)  # (from slot 0)
        # from host RAM, cut back to a checkpoint (a saved state holds only the last window of its window layers: it is
        # extended, not cut back, where a window cache of the full length takes no checkpoints)
        back = base + out + [4] * 20 if arch == "gemma3" else [*base, *out[:2], 9, 9, 9, *[4] * 20]
        cut_back = eng.counters.snapshot_restores
        turn(eng, mirror, back, 0, copied=True)
        c = eng.counters
        assert c.slot_copies >= 1 and c.host_saves >= 1 and c.host_restores >= 1 and c.invariant_violations == 0
        if not arch.startswith("gemma3"):  # (a recurrent state: restored whole, then cut back to its checkpoint)
            assert c.snapshot_restores == cut_back + 1
        assert eng.persist(30) >= 1
    finally:
        eng.stop()
    again = engine(arch, tmp_path / "disk")
    try:
        turn(again, Mirror(), base + out + [5] * 30, 0, copied=True)  # from the disk tier
        assert again.counters.disk_restores == 1 and again.counters.disk_restore_failures == 0
    finally:
        again.stop()


def test_a_window_cache_of_its_window_alone_takes_less_memory_and_resumes_from_a_checkpoint_far_back():
    """Gemma 3's layout with --swa-full off: its window layers hold only their window and a batch (32 + 67 tokens here,
    which llama.cpp pads to 256 cells), so a prompt diverging further back resumes from the checkpoint before that
    (every 64 tokens), as predicted; with the full-size window cache the slot is cut anywhere, at more memory."""
    full = engine("gemma3", ctx_per_slot=1024)
    kv_full = full.core.llama.info.kv_bytes
    full.stop()
    eng = engine("gemma3-window", checkpoint_every=64, ctx_per_slot=1024)
    try:
        info = eng.core.llama.info
        assert not info.swa_full and info.kv_bytes < kv_full
        rnd = random.Random(9)
        mirror = Mirror()
        long = [rnd.randrange(128) for _ in range(600)]
        turn(eng, mirror, long, 0)
        _, min_keep, cut_at, _ = mirror.slots[0]
        assert min_keep > 300 and {256, 320} <= set(cut_at)  # what the window cache still holds; its checkpoints
        turn(eng, mirror, [*long[:300], 5, 5, *long[302:400]], 0)  # diverges at 300: from the checkpoint at 256
        assert eng.counters.snapshot_restores == 1 and eng.counters.invariant_violations == 0
    finally:
        eng.stop()


@pytest.mark.parametrize("arch", ["qwen35", "nemotron_h", "lfm2", "mamba2"])
def test_speculation_takes_rejected_guesses_back_out_of_a_recurrent_state_where_llama_cpp_can(arch):
    """qwen35, nemotron_h and lfm2: llama.cpp keeps ROLLBACK more copies of each slot's recurrent state, so guesses are
    verified and the rejected ones taken back (here every guess is wrong: the tokens are those of a run without
    guesses); mamba2: it cannot, speculation is off."""
    rnd = random.Random(4)
    prompt = [rnd.randrange(128) for _ in range(40)]
    plain = engine(arch, spec="none")
    try:
        want = complete(plain, prompt, slot=0, max_tokens=12).tokens
    finally:
        plain.stop()
    eng = engine(arch)
    try:
        core = eng.core
        assert core.spec == (arch != "mamba2") and core.rollback == (0 if arch == "mamba2" else ROLLBACK)

        guess = core._guess

        def wrong(task, slot, budget, decoding=0, rows=0):  # guesses the model never takes
            guess(task, slot, budget, decoding, rows)  # (the job's drafter: it counts what was taken)
            return [(t + 1) % 128 for t in want][: min(core.rollback, 3)] if core.spec else []

        core._guess = wrong  # type: ignore[method-assign]
        core.batcher.guess = wrong
        run = complete(eng, prompt, slot=0, max_tokens=12)
        assert run.tokens == want and isinstance(run.final, JobDone)
        c = eng.counters
        assert c.invariant_violations == 0 and c.spec_accepted <= c.spec_proposed
        if arch != "mamba2":
            assert c.spec_proposed > c.spec_accepted  # (rejected guesses were taken back)
    finally:
        eng.stop()
