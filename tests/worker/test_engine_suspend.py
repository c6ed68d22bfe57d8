"""A job suspended after its output began (JobCancel.preempt, worker/job_ends.py `suspend`) and resumed (Job.resume,
worker/admission.py `resume`), on the real model in default mode: it goes on where it stopped and gives the tokens it
gives alone, from its slot or from what its worker saved of it; cancelled while suspended it ends at once; a seeded
job is not suspended; a resume the worker cannot match is refused."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from worker_helpers import Run, complete, job

from protocol import ErrorCode, Job, JobDone, JobError, pack_tokens, unpack_tokens
from worker.config import WorkerConfig
from worker.core import EngineCore
from worker.engine import Engine

pytestmark = pytest.mark.model

LOW = "Write a long story about a lighthouse keeper and the storm."
N = 32


def until(what: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """Default mode, without speculation (whose guesses, verified in rows of their own, are computed with other
    kernels than one row: a job and the same job alone would differ by what was guessed, not by the suspension)."""
    eng = Engine(WorkerConfig(slots=2, ctx_per_slot=1024, threads=2, spec="none")).start()
    yield eng
    eng.stop()


def suspended(eng: Engine, prompt: list[int], after: int = 4, **kw) -> tuple[Job, Run, JobError]:
    """A job of `prompt` suspended once `after` of its tokens are out (asked between two steps, on the compute thread,
    so that it cannot end first); its run waits for more (`final` cleared)."""
    run, msg = Run(prompt), job(prompt, prefix_cache=False, max_tokens=N, ignore_eos=True, **kw)
    eng.submit(msg, run)

    def preempt(e: EngineCore) -> bool:
        task = e.admission.by_id.get(msg.id)
        if task is None or len(task.generated) < after:
            return False
        e.cancel(msg.id, preempt=True)
        return True

    until(lambda: eng.call(preempt).result(30))
    held = run.wait()
    assert isinstance(held, JobError) and held.code == ErrorCode.PREEMPTED and held.suspended, held
    run.final = None
    return msg, run, held


def resume(msg: Job, prompt: list[int], held: JobError, slot: int) -> Job:
    return Job(id=msg.id, slot=slot, tokens=pack_tokens(prompt + unpack_tokens(held.tokens)), resume=True)


def test_a_suspended_job_goes_on_in_its_slot_with_the_tokens_it_gives_alone(engine: Engine):
    eng = engine
    prompt = eng.vocab.tokenize(LOW)
    alone = complete(eng, prompt, max_tokens=N, ignore_eos=True, prefix_cache=False)
    msg, run, held = suspended(eng, prompt)
    out = unpack_tokens(held.tokens)
    assert out == run.streamed_tokens and len(out) < N, "its output so far, as streamed"
    assert held.slot >= 0 and held.slot_tokens == len(prompt) + len(out) - 1, "its slot holds all but its last token"
    other = Run(prompt)
    eng.submit(resume(msg, prompt, held, held.slot), other)
    done = run.wait()  # (the job's output goes on to its own sink)
    assert isinstance(done, JobDone) and other.final is None and other.deltas == []
    assert run.tokens == alone.tokens and run.streamed_tokens == alone.tokens
    assert done.text == alone.final.text and done.finish_reason == "length"
    assert (done.prompt_tokens, done.generated_tokens, done.reused_tokens) == (len(prompt), N, 0), "counted from its start"
    assert done.slot_tokens == len(prompt) + N - 1


def test_a_suspended_job_whose_slot_was_taken_goes_on_from_what_its_worker_saved(engine: Engine):
    eng = engine
    prompt = eng.vocab.tokenize(LOW)
    alone = complete(eng, prompt, max_tokens=N, ignore_eos=True, prefix_cache=False)
    msg, run, held = suspended(eng, prompt)
    restores = eng.call(lambda e: e.counters.host_restores).result(10)
    complete(eng, eng.vocab.tokenize("List the planets of the solar system."), slot=held.slot, prefix_cache=False)
    eng.submit(resume(msg, prompt, held, held.slot), Run(prompt))
    done = run.wait()
    assert isinstance(done, JobDone), done
    assert run.tokens == alone.tokens and done.text == alone.final.text
    assert eng.call(lambda e: e.counters.host_restores).result(10) == restores + 1, "restored from host RAM"


def test_a_job_cancelled_while_suspended_ends_at_once_and_a_resume_that_does_not_match_is_refused(engine: Engine):
    eng = engine
    prompt = eng.vocab.tokenize(LOW)
    msg, run, held = suspended(eng, prompt)
    eng.cancel(msg.id)
    end = run.wait()
    assert isinstance(end, JobError) and end.code == ErrorCode.CANCELLED and "suspended" in end.message
    unknown = Run(prompt)
    eng.submit(resume(msg, prompt, held, held.slot), unknown)  # (it ended: nothing to resume)
    refused = unknown.wait()
    assert isinstance(refused, JobError) and refused.code == ErrorCode.BAD_REQUEST and "not suspended" in refused.message

    msg, run, held = suspended(eng, prompt)
    violations = eng.call(lambda e: e.counters.invariant_violations).result(10)
    wrong = Job(id=msg.id, slot=held.slot, tokens=pack_tokens([*prompt, 1, 2]), resume=True)
    bad = Run(prompt)
    eng.submit(wrong, bad)
    failed = bad.wait()
    assert isinstance(failed, JobError) and failed.code == ErrorCode.INTERNAL and failed.error_id, failed
    assert eng.call(lambda e: (e.counters.invariant_violations, msg.id in e.admission.by_id)).result(10) == (
        violations + 1,
        False,
    ), "counted, and the job let go of"


def test_a_seeded_job_preempted_after_its_output_began_runs_on(engine: Engine):
    eng = engine
    prompt = eng.vocab.tokenize(LOW)
    run, msg = Run(prompt), job(prompt, prefix_cache=False, max_tokens=N, ignore_eos=True, seed=7, temperature=0.8)
    eng.submit(msg, run)
    until(lambda: len(run.streamed_tokens) >= 4)
    eng.cancel(msg.id, preempt=True)  # (its tokens depend on how its rows are computed: it is not suspended)
    done = run.wait()
    assert isinstance(done, JobDone) and done.generated_tokens == N
