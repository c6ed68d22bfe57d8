"""worker/embed_jobs.py with a fake embedder, no model: one chunk per turn (an input whole with nothing beside it,
about STEP_S of it beside generating slots), the jobs taking turns an input at a time; a job's end (its vectors, or why
not) after its last input; cancelled, forgotten and handed-back jobs; every chunk counts as progress. And the engine's
loop (worker/engine.py) with a fake core: one chunk between two steps, commands taken between chunks."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from protocol import EmbedDone, EmbedJob, ErrorCode, JobError, pack_tokens
from worker import embed_jobs
from worker.embed_jobs import EmbedJobs
from worker.embedder import EmbedInput, InputTooLong
from worker.engine import Engine

MAX_TOKENS = 100


class FakeEmbedder:
    """A vector per input: [its length, its first token]; `log` names each input computed (and each chunk of one in
    parts, with its size); `fail_on` an input's first token that makes it raise."""

    dims = 2

    def __init__(self, log: list[str], fail_on: int | None = None) -> None:
        self.log, self.fail_on = log, fail_on
        self.reused_tokens = 0
        self.after: dict[int, Callable[[], None]] = {}  # by an input's first token: called once it is computed

    def check(self, lengths: list[int]) -> None:
        for i, n in enumerate(lengths):
            if n > MAX_TOKENS:
                raise InputTooLong(f"input {i} has {n} tokens; an embedding holds at most {MAX_TOKENS}")

    def begin(self, toks: list[int]) -> EmbedInput:
        self.reused_tokens += 1
        return EmbedInput(toks, 0)

    def advance(self, inp: EmbedInput, most: int) -> np.ndarray | None:
        tokens = inp.tokens
        if tokens[0] == self.fail_on:
            raise RuntimeError("llama_decode returned -1")
        n = min(most, inp.left)
        inp.pos += n
        if inp.left or n < len(tokens):
            self.log.append(f"chunk {tokens[0]}: {n}")
        if inp.left:
            return None
        self.log.append(f"input {tokens[0]}")
        self.after.get(tokens[0], lambda: None)()
        return np.array([len(tokens), tokens[0]], dtype=np.float32)

    def close(self) -> None:
        self.log.append("closed")


def embed_job(jid: str, *firsts: int, length: int = 3, normalize: bool = False) -> EmbedJob:
    return EmbedJob(id=jid, inputs=[pack_tokens([f] * length) for f in firsts], normalize=normalize)


def jobs(fail_on: int | None = None) -> tuple[EmbedJobs, list[str], list[EmbedDone | JobError]]:
    log: list[str] = []
    ends: list[EmbedDone | JobError] = []
    made: list[str] = []

    def make(pooling: str) -> FakeEmbedder:
        made.append(pooling)
        return FakeEmbedder(log, fail_on)

    q = EmbedJobs(make)
    q.made = made  # type: ignore[attr-defined]
    return q, log, ends


def test_jobs_take_turns_an_input_at_a_time_and_a_job_ends_with_its_vectors() -> None:
    """A small request waits for one input of a large one before it, not for all of them (the bench's 40 inputs of
    2,000 tokens held a one-input request behind them for minutes)."""
    q, log, ends = jobs()
    q.add(embed_job("a", 1, 2), ends.append)
    q.add(embed_job("b", 3), ends.append)
    q.run_one()
    assert log == ["input 1"] and not ends and q.computed == 1 and len(q) == 2
    q.run_one()
    assert log == ["input 1", "input 3"] and [e.id for e in ends] == ["b"], "b's turn after a's first input"
    q.run_one()
    done = ends[1]
    assert isinstance(done, EmbedDone) and done.id == "a" and done.dims == 2 and done.reused_tokens == 2
    assert [np.frombuffer(v, "<f4").tolist() for v in done.vectors] == [[3, 1], [3, 2]]
    assert q.computed == 3 and not q
    q.run_one()  # (nothing to do)
    assert q.computed == 3 and q.made == ["mean"]  # type: ignore[attr-defined]


def test_a_cancelled_job_drops_its_inputs_left_and_says_so() -> None:
    q, log, ends = jobs()
    q.add(embed_job("a", 1, 2, 3), ends.append)
    q.add(embed_job("b", 4), ends.append)
    q.run_one()
    assert q.cancel("a") and not q.cancel("a") and not q.cancel("nope")
    (err,) = ends
    assert isinstance(err, JobError) and (err.id, err.code) == ("a", ErrorCode.CANCELLED) and "1 of 3" in err.message
    q.run_one()
    assert log == ["input 1", "input 4"] and ends[-1].id == "b" and isinstance(ends[-1], EmbedDone)


def test_a_refused_or_failed_job_ends_with_why_and_the_next_one_runs() -> None:
    q, log, ends = jobs(fail_on=7)
    q.add(EmbedJob(id="long", inputs=[pack_tokens([1]), pack_tokens([2] * (MAX_TOKENS + 1))]), ends.append)
    q.add(embed_job("broken", 6, 7, 8), ends.append)
    q.add(embed_job("fine", 9), ends.append)
    q.run_one()  # refused whole, before any input is computed
    assert isinstance(ends[0], JobError) and ends[0].code == ErrorCode.BAD_REQUEST and "input 1" in ends[0].message
    assert log == []
    q.run_one()  # broken's first input, then fine's turn
    q.run_one()
    assert ends[1].id == "fine" and isinstance(ends[1], EmbedDone)
    q.run_one()  # broken's second input fails
    assert isinstance(ends[2], JobError) and (ends[2].id, ends[2].code) == ("broken", ErrorCode.INTERNAL)
    assert ends[2].error_id and "returned -1" in ends[2].message
    assert q.computed == 4 and not q  # (a refused or failed turn is progress too: the thread is not stuck)


def test_forgotten_jobs_end_without_a_word_and_handed_back_ones_say_draining() -> None:
    q, _, ends = jobs()
    for jid in ("a", "b", "c"):
        q.add(embed_job(jid, 1), ends.append)
    assert [r.job.id for r in q.take({"b"})] == ["b"] and not ends
    assert [r.job.id for r in q.queue] == ["a", "c"]  # (the others, in their order)
    assert q.hand_back() == 2 and not q
    assert [(e.id, e.code) for e in ends if isinstance(e, JobError)] == [("a", ErrorCode.DRAINING), ("c", ErrorCode.DRAINING)]


def test_close_frees_every_embedder() -> None:
    q, log, ends = jobs()
    q.add(embed_job("a", 1), ends.append)
    q.run_one()
    q.close()
    assert log[-1] == "closed" and not q.embedders


def test_with_wake_an_embedder_is_made_on_a_thread_while_run_one_returns() -> None:
    """A new embedding context allocates its memory (seconds on a loaded machine: a hostile test's stream once waited
    3 s for its next token): it is made on a thread of its own, `run_one` computing nothing for its job meanwhile (the
    engine steps the slots on), and the thread wakes the engine when it is ready."""
    log: list[str] = []
    release, woken = threading.Event(), threading.Event()
    threads: list[str] = []

    def make(pooling: str) -> FakeEmbedder:
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        return FakeEmbedder(log)

    q = EmbedJobs(make, wake=woken.set)
    ends: list[EmbedDone | JobError] = []
    q.add(embed_job("a", 1, 2), ends.append)
    q.run_one()
    assert q.waiting_for_embedder() and not log and q.computed == 0, "nothing computed while it is made"
    q.run_one()
    assert not log and len(q.making) == 1, "made once"
    release.set()
    assert woken.wait(10) and not q.waiting_for_embedder()
    q.run_one()
    q.run_one()
    assert log == ["input 1", "input 2"] and [type(e) for e in ends] == [EmbedDone]
    assert threads == ["kvroute-embedder-mean"], threads


def test_an_embedder_that_cannot_be_made_fails_its_job_and_the_next_tries_again() -> None:
    attempts: list[int] = []
    woken = threading.Event()

    def make(pooling: str) -> FakeEmbedder:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("llama.cpp could not make an embedding context of 8192 tokens (mean pooling)")
        return FakeEmbedder([])

    q = EmbedJobs(make, wake=woken.set)
    ends: list[EmbedDone | JobError] = []
    q.add(embed_job("a", 1), ends.append)
    q.add(embed_job("b", 2), ends.append)
    q.run_one()
    assert woken.wait(10)
    q.run_one()
    (failed,) = ends
    assert isinstance(failed, JobError) and failed.code is ErrorCode.INTERNAL and "could not make" in failed.message
    woken.clear()
    q.run_one()
    assert woken.wait(10)
    q.run_one()
    assert [e.id for e in ends] == ["a", "b"] and isinstance(ends[1], EmbedDone) and len(attempts) == 2


def test_close_waits_for_an_embedder_being_made_and_frees_it() -> None:
    log: list[str] = []
    release = threading.Event()

    def make(pooling: str) -> FakeEmbedder:
        assert release.wait(10)
        return FakeEmbedder(log)

    q = EmbedJobs(make, wake=lambda: None)
    q.add(embed_job("a", 1), lambda end: None)
    q.run_one()
    threading.Timer(0.05, release.set).start()
    q.close()
    assert log == ["closed"] and not q.making and not q.embedders


# ---- the engine's loop, with a fake core ----


class FakeCore:
    """A core whose slot runs `steps` more steps (each logged), beside real embed jobs of a fake embedder."""

    def __init__(self, log: list[str], steps: int) -> None:
        self.log, self.steps = log, steps
        self.embedder = FakeEmbedder(log)
        self.embeds = EmbedJobs(lambda pooling: self.embedder)
        self.admission, self.table = SimpleNamespace(waiting=[]), SimpleNamespace(slots=[], busy=lambda: [])
        self.progress = 0

    def idle(self) -> bool:
        return not self.steps and not self.embeds

    def waiting_for_images(self) -> bool:
        return False

    def waiting_for_embedder(self) -> bool:
        return False

    def close(self) -> bool:
        return True

    def step(self) -> None:
        if self.steps:
            self.steps -= 1
            self.log.append("step")
        self.progress += 1

    def cancel(self, job_id: str) -> None:
        self.log.append(f"cancel {job_id}")
        self.embeds.cancel(job_id)


def fake_engine(core: FakeCore) -> Engine:
    engine = Engine.__new__(Engine)  # (no model: the loop, its inbox and the figures read from the core)
    engine.core, engine.disk, engine.after_step = core, None, None  # type: ignore[assignment]
    engine._inbox, engine._thread, engine._running = queue.SimpleQueue(), None, False
    return engine


def test_the_loop_takes_one_input_between_two_steps_and_commands_between_inputs() -> None:
    log: list[str] = []
    core = FakeCore(log, steps=2)
    engine = fake_engine(core)
    ends: list[EmbedDone | JobError] = []
    core.embedder.after = {3: lambda: engine.cancel("e")}  # (arrives while input 3 is computed)
    engine.embed(embed_job("e", 1, 2, 3, 4), ends.append)
    engine.embed(embed_job("f", 5, 6), ends.append)
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while len(ends) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        engine.stop(close=False)
    # the slot's steps and the inputs alternate (a step waits for one input at most), the jobs take turns, and the
    # cancel is taken before the next input
    assert log == ["input 1", "step", "input 5", "step", "input 2", "input 6", "input 3", "cancel e"]
    assert [(e.id, type(e)) for e in ends] == [("f", EmbedDone), ("e", JobError)]
    assert engine.progress == core.progress + 5  # (every loop turn, and every input computed)


def test_beside_generating_slots_a_chunk_is_about_step_s_of_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 61: a 2,000-token input took one decode of seconds, which the slots' next tokens waited for. Beside
    generating slots an input goes a chunk of about STEP_S at a time (the speed measured on the chunks before), its
    vector whole at the end; with nothing beside it, a whole input at once."""
    monkeypatch.setattr(embed_jobs, "FIRST_CHUNK", 4)
    q, log, ends = jobs()
    q.add(embed_job("a", 1, length=60), ends.append)
    q.run_one(beside=True)
    assert log == ["chunk 1: 4"] and q.computed == 1, "the first chunk, its speed not known yet"
    q.tokens_per_s = 40 / embed_jobs.STEP_S  # (as if measured)
    q.run_one(beside=True)
    assert log[-1] == "chunk 1: 40" and not ends
    q.run_one(beside=True)
    assert log[-2:] == ["chunk 1: 16", "input 1"] and q.computed == 3
    (done,) = ends
    assert isinstance(done, EmbedDone) and np.frombuffer(done.vectors[0], "<f4").tolist() == [60, 1]
    q.add(embed_job("b", 2, length=60, normalize=True), ends.append)
    q.run_one(beside=False)
    assert log[-1] == "input 2" and len(ends) == 2, "nothing beside it: the input at once"
    vector = np.frombuffer(ends[1].vectors[0], "<f4")  # type: ignore[union-attr]
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-6 and abs(vector[0] / vector[1] - 30) < 1e-4, "normalized"


def test_the_speed_is_measured_on_chunks_long_enough_to_tell() -> None:
    q, _, _ = jobs()
    q._timed(2, 0.001)  # (a few tokens: mostly the decode's fixed cost)
    assert q.tokens_per_s == 0
    q._timed(100, 0.5)
    assert q.tokens_per_s == 200 and q.chunk() == int(200 * embed_jobs.STEP_S)
    q._timed(100, 0.25)
    assert 200 < q.tokens_per_s < 400


def test_embed_work_is_work_and_progress_for_the_watchdog() -> None:
    core = FakeCore([], steps=0)
    engine = fake_engine(core)
    assert not engine.working() and engine.progress == 0
    core.embeds.add(embed_job("e", 1, 2), lambda end: None)
    assert engine.working() and not core.idle()
    core.embeds.run_one()
    assert engine.progress == 1
