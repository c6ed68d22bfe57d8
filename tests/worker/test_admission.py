"""worker/admission.py with plain data, no model: what a job is refused for before any work, and which waiting job
gets which slot, in what order."""

from __future__ import annotations

import time
from typing import Any

import pytest
from worker_prefix_fakes import FakeLlama, prefixes_for

from common.slots import SlotPhase
from protocol import EngineCounters, ErrorCode, Job, Message, Overflow, Sampling, pack_tokens, unpack_tokens
from worker.admission import Admission
from worker.slots import SlotTable
from worker.task import Task

N_CTX = 1024
N_VOCAB = 1000


class FakeVocab:
    n_vocab = N_VOCAB

    def piece(self, token: int) -> bytes:
        return b"x"


def setup(slots: int = 2) -> tuple[Admission, SlotTable, list[Message]]:
    llama, table = FakeLlama(slots), SlotTable(slots)
    prefixes = prefixes_for(llama, table, N_CTX)
    return Admission(FakeVocab(), None, table, prefixes, EngineCounters(), N_CTX), table, []  # type: ignore[arg-type]


def job(jid: str, prompt: list[int] | None = None, slot: int = -1, deadline_ms: int | None = None, **sampling: Any) -> Job:
    tokens = pack_tokens(prompt or [1, 2, 3])
    return Job(id=jid, slot=slot, tokens=tokens, sampling=Sampling(**sampling), deadline_ms=deadline_ms)


@pytest.mark.parametrize(
    ("made", "code", "words"),
    [
        (job("a", slot=5), ErrorCode.BAD_REQUEST, "slot 5 does not exist"),
        (job("a", [1, N_VOCAB]), ErrorCode.BAD_REQUEST, f"token id {N_VOCAB} is outside the vocabulary"),
        (job("a", [1] * N_CTX), ErrorCode.CONTEXT_OVERFLOW, f"does not fit a slot's context of {N_CTX}"),
        (job("a", [1] * 1000, max_tokens=100), ErrorCode.CONTEXT_OVERFLOW, "+ max_tokens 100 = 1100"),
        (job("a", logit_bias={"5000": 1.0}), ErrorCode.BAD_REQUEST, "logit_bias: token id 5000 is outside the vocabulary"),
    ],
)
def test_a_job_that_cannot_run_is_refused_before_any_work(made: Job, code: ErrorCode, words: str) -> None:
    admission, _, sent = setup()
    refused = admission.accept(made, sent.append, 0.0)
    assert refused is not None and refused.code == code and words in refused.message, refused
    assert not admission.waiting and not admission.by_id
    if code == ErrorCode.CONTEXT_OVERFLOW:  # the numbers, for each API to word its own message
        prompt_tokens = len(unpack_tokens(made.tokens))
        assert refused.overflow == Overflow(prompt_tokens=prompt_tokens, max_tokens=made.sampling.max_tokens, context=N_CTX)


def test_a_draining_worker_and_a_repeated_id_are_refused() -> None:
    admission, _, sent = setup()
    assert admission.accept(job("a", max_tokens=None), sent.append, 0.0) is None
    assert admission.by_id["a"].max_gen == N_CTX - 3  # no max_tokens: up to the slot's end
    repeated = admission.accept(job("a"), sent.append, 0.0)
    assert repeated is not None and "already running" in repeated.message
    admission.draining = True
    drained = admission.accept(job("b"), sent.append, 0.0)
    assert drained is not None and drained.code == ErrorCode.DRAINING
    assert [t.id for t in admission.waiting] == ["a"]


def test_jobs_take_slots_in_arrival_order_and_a_named_busy_slot_holds_back_only_its_own() -> None:
    admission, table, sent = setup(slots=2)
    for j in (job("first", slot=0), job("second", slot=0), job("free", [7, 8, 9])):
        assert admission.accept(j, sent.append, time.monotonic()) is None
    admission.admit()
    first, free = table[0].task, table[1].task
    assert isinstance(first, Task) and first.id == "first" and first.slot == 0
    assert isinstance(free, Task) and free.id == "free"  # it passed the job waiting for slot 0
    assert [t.id for t in admission.waiting] == ["second"]
    table.release(table[0])
    admission.admit()
    assert table[0].task is not None and table[0].task.id == "second" and not admission.waiting


def test_waiting_jobs_cancelled_or_past_their_deadline_are_taken_out_to_be_ended() -> None:
    admission, table, sent = setup(slots=1)
    assert admission.accept(job("running", [5, 6]), sent.append, time.monotonic()) is None
    admission.admit()  # every slot busy: everything after waits
    assert admission.accept(job("cancelled"), sent.append, time.monotonic()) is None
    assert admission.accept(job("late", deadline_ms=1), sent.append, time.monotonic() - 1) is None
    assert admission.accept(job("waits"), sent.append, time.monotonic()) is None
    admission.cancel("cancelled")
    gone = admission.expired()
    assert [(t.id, code) for t, code in gone] == [("cancelled", ErrorCode.CANCELLED), ("late", ErrorCode.DEADLINE_EXCEEDED)]
    admission.admit()
    assert [t.id for t in admission.waiting] == ["waits"] and table[0].phase is SlotPhase.BUSY
    admission.forget_id("waits")
    assert not admission.waiting and "waits" not in admission.by_id
