"""The context-checkpoint path of memories that cannot be cut back (recurrent, hybrid: worker/checkpoints.py), forced
on the default model (--snapshots)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_helpers import assert_slot_invariant, complete

from worker.config import WorkerConfig
from worker.engine import Engine

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def snap_engine() -> Iterator[Engine]:
    eng = Engine(WorkerConfig(slots=1, ctx_per_slot=512, threads=2, snapshots=True)).start()
    yield eng
    eng.stop()


def test_same_prompt_restores_a_checkpoint_instead_of_trimming(snap_engine):
    vocab = snap_engine.vocab
    prompt = vocab.tokenize("Snapshots let recurrent models reuse a prompt.")
    first = complete(snap_engine, prompt, slot=0, prefix_cache=False, max_tokens=5)
    assert first.final.slot_cuts == [len(prompt) - 4, len(prompt)]  # 4 before the prompt's end, and at its end
    again = complete(snap_engine, prompt, slot=0, max_tokens=5)
    assert again.final.reused_tokens == len(prompt) - 4  # restored the checkpoint 4 before the end
    assert snap_engine.counters.snapshot_restores == 1
    assert again.tokens == first.tokens
    assert_slot_invariant(snap_engine, again)


def test_follow_up_needs_no_trim_and_edit_falls_back_to_a_checkpoint_or_zero(snap_engine):
    vocab = snap_engine.vocab
    p1 = vocab.tokenize("User: hello there.\nAssistant:")
    first = complete(snap_engine, p1, slot=0, prefix_cache=False, max_tokens=4)
    p2 = p1 + first.tokens + vocab.tokenize("\nUser: more?\nAssistant:", add_special=False)
    second = complete(snap_engine, p2, slot=0, max_tokens=4)
    assert second.final.reused_tokens == len(p1) + 3  # everything the slot held: nothing had to be cut
    edited = vocab.tokenize("User: goodbye.\nAssistant:")
    third = complete(snap_engine, edited, slot=0, max_tokens=2)
    assert third.final.reused_tokens == 0  # no checkpoint at or below the common prefix: recomputed from zero
    assert_slot_invariant(snap_engine, third)
