"""Images in a slot (issue 64), with the real default model and the tiny random-weight Gemma 3 projector
(bench/tiny_mmproj.py): a prompt's image is encoded and its rows decoded into the slot, the next turn that repeats it
reuses all of it, another image stops the reuse at its first row, and what is reused is what a cold computation gives
(deterministic mode). A job whose ids are not its image's, or that comes to a worker without a projector, is refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from worker_helpers import Run, assert_slot_invariant, complete, decodes, job, prompt_of
from worker_helpers import start as start_run

from bench.tiny_mmproj import mmproj, png
from common.projector import MARKER
from protocol import JobDone, JobError, JobImage
from worker.config import WorkerConfig
from worker.engine import Engine

pytestmark = pytest.mark.model

TURN_1 = "<start_of_turn>user\nWhat is in this picture? " + MARKER + "<end_of_turn>\n<start_of_turn>model\n"
TURN_2 = TURN_1 + "A lighthouse.<end_of_turn>\n<start_of_turn>user\nAnd what colour is it?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def seer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    proj = mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf")
    cfg = WorkerConfig(slots=2, ctx_per_slot=1024, threads=1, deterministic=True, host_cache_mb=64, mmproj=str(proj))
    eng = Engine(cfg).start()
    yield eng
    eng.stop()


def test_an_image_is_read_and_the_next_turn_reuses_it_exactly(seer: Engine) -> None:
    seer.reset()
    picture = png(48, 40, seed=1)
    first, images = prompt_of(seer, TURN_1, picture)
    (image,) = images
    counted = lambda e: (e.counters.image_rows, e.counters.images_encoded, e.counters.image_encode_s)  # noqa: E731
    rows, encoded, encode_s = seer.call(counted).result(10)
    one = complete(seer, first, slot=0, images=images)
    assert isinstance(one.final, JobDone), one.final
    rows2, encoded2, encode_s2 = seer.call(counted).result(10)
    assert (rows2 - rows, encoded2 - encoded) == (image.n_tokens, 1) and encode_s2 > encode_s
    assert_slot_invariant(seer, one)

    second, images2 = prompt_of(seer, TURN_2, picture)
    warm = complete(seer, second, slot=0, images=images2)
    cold = complete(seer, second, slot=1, images=images2, prefix_cache=False)
    assert isinstance(warm.final, JobDone) and isinstance(cold.final, JobDone)
    assert warm.final.reused_tokens >= image.start + image.n_tokens  # the image whole (deterministic mode: the short
    # text chunk after it is not computed as an exact chunk, so it is computed again)
    assert warm.tokens == cold.tokens  # the reused image's KV is what a cold computation gives

    other, images3 = prompt_of(seer, TURN_2, png(48, 40, seed=2))
    assert other[: image.start] == second[: image.start] and other[image.start] != second[image.start]
    third = complete(seer, other, slot=0, images=images3)
    assert isinstance(third.final, JobDone) and third.final.reused_tokens == image.start  # up to its first row


def test_a_job_whose_ids_are_not_its_images_is_refused(seer: Engine) -> None:
    prompt, images = prompt_of(seer, TURN_1, png(48, 40, seed=3))
    wrong = [JobImage(start=images[0].start, n_tokens=images[0].n_tokens, data=png(48, 40, seed=4))]
    run = complete(seer, prompt, images=wrong)
    assert isinstance(run.final, JobError) and "not those of its image" in run.final.message
    assert isinstance(complete(seer, prompt, images=[]).final, JobError)  # image ids without their image


def test_a_worker_without_a_projector_refuses_images(engine: Engine, seer: Engine) -> None:
    prompt, images = prompt_of(seer, TURN_1, png(48, 40, seed=1))
    run = complete(engine, prompt, images=images)
    assert isinstance(run.final, JobError) and "--mmproj" in run.final.message


@contextmanager
def held_encodes(engine: Engine) -> Iterator[threading.Event]:
    """Every image encode waits for the event (set on leaving) before it computes: an encode the test sees under way."""
    gate = threading.Event()
    real = engine.call(lambda e: e.encodings.encoder.encode).result(10)

    def held(data: bytes, n_batch: int):
        assert gate.wait(60), "the test never let the encode go on"
        return real(data, n_batch)

    engine.call(lambda e: setattr(e.encodings.encoder, "encode", held)).result(10)
    try:
        yield gate
    finally:
        gate.set()
        engine.call(lambda e: setattr(e.encodings.encoder, "encode", real)).result(10)


def wait_for(what: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_other_slots_step_on_while_an_image_encodes(seer: Engine) -> None:
    """Item 3 of issue 64: an image's encode runs off the compute thread; while it is held, the other slot's job
    streams its tokens and the image's slot gets no rows; then the image job ends with the tokens it gives alone."""
    seer.reset()
    prompt, images = prompt_of(seer, TURN_1, png(48, 40, seed=5))
    start = images[0].start
    alone = complete(seer, prompt, slot=0, images=images, prefix_cache=False)
    text = seer.vocab.tokenize("<start_of_turn>user\nCount from one to fifty.<end_of_turn>\n<start_of_turn>model\n")
    seer.reset()
    with held_encodes(seer) as gate, decodes(seer) as seen:
        reading = start_run(seer, prompt, slot=0, images=images, prefix_cache=False)
        talking = start_run(seer, text, slot=1, max_tokens=40, ignore_eos=True)
        wait_for(lambda: len(talking.deltas) >= 10)  # (the encode is held: only the other slot's steps go on)
        assert reading.final is None and not reading.deltas
        assert seer.call(lambda e: 0 in e.encodings.pending).result(10)  # (the image's encode is under way)
        during = list(seen)
        gate.set()
        reading.wait()
        talking.wait()
    assert isinstance(reading.final, JobDone) and isinstance(talking.final, JobDone), (reading.final, talking.final)
    assert reading.tokens == alone.tokens  # its rows decoded as when it ran alone (deterministic mode: exactly)
    assert_slot_invariant(seer, reading)
    rows = [(seq, pos) for batch in during for seq, pos, _ in batch]
    assert sum(1 for seq, pos, logits in (r for b in during for r in b) if seq == 1 and logits) >= 10
    assert all(pos < start for seq, pos in rows if seq == 0)  # (slot 0: its text before the image at most)
    assert reading.times[0] > talking.times[9]  # (its first token after the other's tenth)


def test_a_job_cancelled_while_its_image_encodes_ends_and_the_worker_goes_on(seer: Engine) -> None:
    seer.reset()
    prompt, images = prompt_of(seer, TURN_1, png(48, 40, seed=6))
    with held_encodes(seer) as gate:
        run = Run(prompt)
        j = job(prompt, slot=0, images=images)
        seer.submit(j, run)
        wait_for(lambda: seer.call(lambda e: 0 in e.encodings.pending).result(10))
        seer.cancel(j.id)
        done = run.wait(30)  # (it ends while its encode is still held)
        assert isinstance(done, JobDone) and done.finish_reason == "cancelled", done
        assert not seer.call(lambda e: e.encodings.pending).result(10)
        gate.set()
        wait_for(lambda: not seer.call(lambda e: e.encodings._dropped).result(10))  # (its rows freed once it ended)
    again = complete(seer, prompt, slot=0, images=images)
    assert isinstance(again.final, JobDone), again.final
    assert_slot_invariant(seer, again)


def test_a_stopping_worker_does_not_wait_for_an_encode(tmp_path_factory: pytest.TempPathFactory) -> None:
    proj = mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf")
    eng = Engine(WorkerConfig(slots=1, ctx_per_slot=512, threads=1, mmproj=str(proj))).start()
    prompt, images = prompt_of(eng, TURN_1, png(48, 40, seed=7))
    gate = threading.Event()
    real = eng.core.encodings.encoder.encode

    def held(data: bytes, n_batch: int):
        gate.wait(60)
        return real(data, n_batch)

    eng.call(lambda e: setattr(e.encodings.encoder, "encode", held)).result(10)
    run = start_run(eng, prompt, images=images)
    wait_for(lambda: eng.call(lambda e: 0 in e.encodings.pending).result(10))
    t0 = time.monotonic()
    eng.stop()  # (the encode is held: the model is left to the exit, not freed under it)
    assert time.monotonic() - t0 < 10 and run.final is None
    gate.set()
