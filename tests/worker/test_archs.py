"""The engine on tiny random-weight models of the hybrid, recurrent and sliding-window architectures (issue 48:
bench/tiny_archs.py writes them from llama.cpp's own test layouts). Prompts are token ids (the models have no real
vocabulary)."""

from __future__ import annotations

import random

import pytest
from worker_helpers import complete

from bench import tiny_archs
from protocol import JobDone
from worker.config import WorkerConfig
from worker.engine import Engine

pytestmark = pytest.mark.model


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
