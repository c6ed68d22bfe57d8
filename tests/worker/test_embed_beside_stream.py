"""An embed job of many long inputs beside a streaming job, on the real model (worker/embed_jobs.py run by
worker/engine.py's loop): the stream's tokens keep coming, one step between two inputs, so its longest gap is about
one input's time, not the whole job's; and the engine's progress figure moves with every input (issue 61: a worker
computing all of a request's inputs in one turn was taken for hung and killed)."""

from __future__ import annotations

import itertools
import random
import threading
import time

from worker_helpers import decodes, start

from protocol import EmbedDone, EmbedJob, JobError, pack_tokens
from worker.engine import Engine

INPUTS, TOKENS = 5, 256


def test_a_stream_goes_on_beside_an_embed_job_and_progress_moves(fast_engine: Engine) -> None:
    engine = fast_engine
    rng = random.Random(61)
    inputs = [[2] + [rng.randrange(100, 20000) for _ in range(TOKENS - 1)] for _ in range(INPUTS)]
    warm = threading.Event()  # (the embedding context is made at its first job: not timed)
    engine.embed(EmbedJob(id="warm", inputs=[pack_tokens(inputs[0][:8])]), lambda end: warm.set())
    assert warm.wait(120)

    stream = start(engine, [2, *range(1000, 1015)], max_tokens=None, ignore_eos=True)
    while len(stream.deltas) < 3:
        time.sleep(0.005)
    ends: list[EmbedDone | JobError] = []
    ended = threading.Event()

    def end(msg: EmbedDone | JobError) -> None:
        ends.append(msg)
        ended.set()

    seen_progress: list[int] = []
    with decodes(engine) as batches:
        t0, p0 = time.monotonic(), engine.progress
        engine.embed(EmbedJob(id="long", inputs=[pack_tokens(t) for t in inputs]), end)
        while not ended.wait(0.01):
            seen_progress.append(engine.progress)
        t1, p1 = time.monotonic(), engine.progress
    engine.cancel(stream.deltas[0].id)
    stream.wait()

    (done,) = ends
    assert isinstance(done, EmbedDone) and len(done.vectors) == INPUTS
    # the stream's slot decoded between every two inputs (one input, then one step)
    assert len(batches) >= INPUTS - 1, batches
    during = [t for t in stream.times if t0 <= t <= t1]
    assert len(during) >= INPUTS - 1
    edges = [t0, *during, t1]
    worst = max(b - a for a, b in itertools.pairwise(edges))
    assert worst < 0.6 * (t1 - t0), f"worst gap {worst:.2f} s of an embed job of {t1 - t0:.2f} s"
    # every input is progress: the figure moved while the job ran, input after input
    assert p1 - p0 >= INPUTS
    assert len(set(seen_progress)) >= INPUTS - 1, seen_progress


def test_a_stream_goes_on_while_an_embedding_context_is_made(fast_engine: Engine) -> None:
    """The first embed job of a pooling kind makes its context (memory allocated: seconds on a loaded machine) on a
    thread of its own: the stream's tokens keep coming while it is made (held here until the stream has gone on),
    then the job is computed."""
    engine = fast_engine
    engine.call(lambda core: [e.close() for e in core.embeds.embedders.values()]).result(30)
    engine.call(lambda core: core.embeds.embedders.clear()).result(30)  # (the next job makes its context anew)
    held = threading.Event()
    real = engine.core.embeds.make

    def held_make(pooling: str):  # type: ignore[no-untyped-def]
        assert held.wait(30)
        return real(pooling)

    engine.core.embeds.make = held_make
    stream = start(engine, [2, *range(1000, 1015)], max_tokens=None, ignore_eos=True)
    try:
        while len(stream.deltas) < 3:
            time.sleep(0.005)
        ended = threading.Event()
        ends: list[EmbedDone | JobError] = []
        engine.embed(EmbedJob(id="first", inputs=[pack_tokens([2, *range(300, 340)])]), lambda e: (ends.append(e), ended.set()))
        n0, deadline = len(stream.deltas), time.monotonic() + 20
        while len(stream.deltas) < n0 + 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(stream.deltas) >= n0 + 10, "the stream stopped while the embedding context was made"
        assert not ends, "the job waits for its context"
        held.set()
        assert ended.wait(60)
        (done,) = ends
        assert isinstance(done, EmbedDone) and len(done.vectors) == 1
    finally:
        held.set()
        engine.core.embeds.make = real
        engine.cancel(stream.deltas[0].id)
        stream.wait()
