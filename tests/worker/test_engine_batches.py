"""The batches a default-mode engine decodes, on the real model: rows in seq id order, and a padding row in an idle
slot between two generating ones (llama.cpp's ubatches: worker/batching.py `_write`), removed again after."""

from __future__ import annotations

import pytest
from worker_helpers import assert_slot_invariant, complete, decodes, start

from worker.engine import Engine

pytestmark = pytest.mark.model


def test_an_idle_slot_between_two_generating_ones_gets_a_padding_row_that_leaves_its_cache_as_it_was(default4: Engine):
    eng = default4
    vocab = eng.vocab
    cached = complete(eng, vocab.tokenize("The lighthouse keeper wrote in his log every night."), slot=2)
    held = eng.call(lambda e: (list(e.table[2].tokens), e.llama.seq_len(2))).result(10)
    assert held[1] == len(held[0]) > 0
    with decodes(eng) as seen:
        runs = [start(eng, vocab.tokenize(text), slot=s, max_tokens=12) for s, text in ((3, "The river"), (1, "Once upon"))]
        for run in runs:
            run.wait()
    both = [rows for rows in seen if {1, 3} <= {s for s, _, ok in rows if ok}]  # decode steps of both jobs
    assert both, "the two jobs never decoded in one batch"
    for rows in both:
        assert [s for s, _, _ in rows] == sorted(s for s, _, _ in rows)  # seq id order, whichever job came first
        assert [(pos, ok) for s, pos, ok in rows if s == 2] == [(len(held[0]), False)]  # one padding row, no logits
    assert eng.call(lambda e: (list(e.table[2].tokens), e.llama.seq_len(2))).result(10) == held  # gone again
    again = complete(eng, cached.prompt, slot=2)
    assert again.final.reused_tokens == len(cached.prompt) - 1  # (all but the last prompt token, computed again)
    for run in (*runs, again):
        assert_slot_invariant(eng, run)
