"""A long prompt beside a streaming job, on the real model (worker/pace.py run by worker/core.py's step): while the
stream generates, each step computes about `step_target_ms` of the prompt (here as small as it goes: MIN_TOKENS),
the stream's row in every one of them; with nothing generating, n_batch-token chunks."""

from __future__ import annotations

import collections
import random
import time

from worker_helpers import decodes, start

from worker.engine import Engine
from worker.pace import MIN_TOKENS

_rng = random.Random(7101)  # (prompts no other test of the shared engine sent: nothing of them is cached)
PROMPT, ALONE = ([2] + [_rng.randrange(100, 20000) for _ in range(900)] for _ in range(2))  # (slots of 1,024)


def test_a_long_prompt_beside_a_stream_goes_a_paced_chunk_a_step(fast_engine: Engine) -> None:
    engine = fast_engine
    pace = engine.core.pace
    target = pace.target_s
    engine.call(lambda core: setattr(core.pace, "target_s", 1e-6)).result(10)  # (MIN_TOKENS a step, on any machine)
    stream = start(engine, [2, *range(1000, 1015)], max_tokens=None, ignore_eos=True)
    try:
        while len(stream.deltas) < 3:
            time.sleep(0.005)
        with decodes(engine) as batches:
            before = len(stream.deltas)
            long = start(engine, PROMPT, max_tokens=1)
            long.wait()
            tokens_beside = len(stream.deltas) - before
        counts = [collections.Counter(seq for seq, _, _ in b) for b in batches]
        long_seq = max((n, seq) for c in counts for seq, n in c.items())[1]
        chunks = [c[long_seq] for c in counts if c[long_seq]]
        # one chunk, before the speed was measured, may be a whole n_batch; the others MIN_TOKENS at most, the stream's
        # row beside each (a token for it every step)
        assert long.final is not None and len(chunks) > 10, chunks
        assert sum(n > MIN_TOKENS for n in chunks) <= 1, chunks
        assert len(PROMPT) - 8 <= sum(chunks) <= len(PROMPT) and tokens_beside >= len(chunks) - 2, (tokens_beside, len(chunks))
    finally:
        engine.call(lambda core: setattr(core.pace, "target_s", target)).result(10)
        engine.cancel(stream.deltas[0].id)
        stream.wait()

    with decodes(engine) as batches:  # nothing generating beside it: n_batch-token chunks
        alone = start(engine, ALONE, max_tokens=1)
        alone.wait()
    assert max(len(b) for b in batches) == engine.n_batch, [len(b) for b in batches]
