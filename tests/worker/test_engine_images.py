"""Images in a slot (issue 64), with the real default model and the tiny random-weight Gemma 3 projector
(bench/tiny_mmproj.py): a prompt's image is encoded and its rows decoded into the slot, the next turn that repeats it
reuses all of it, another image stops the reuse at its first row, and what is reused is what a cold computation gives
(deterministic mode). A job whose ids are not its image's, or that comes to a worker without a projector, is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_helpers import assert_slot_invariant, complete

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


def prompt_of(engine: Engine, text: str, image: bytes) -> tuple[list[int], list[JobImage]]:
    tokens, images = engine.call(lambda e: e.projector.tokenize(text, True, [image])).result(30)
    return tokens.tolist(), [JobImage(start=i.start, n_tokens=i.n_tokens, data=i.data) for i in images]


def test_an_image_is_read_and_the_next_turn_reuses_it_exactly(seer: Engine) -> None:
    seer.reset()
    picture = png(48, 40, seed=1)
    first, images = prompt_of(seer, TURN_1, picture)
    (image,) = images
    before = seer.call(lambda e: e.counters.image_rows).result(10)
    one = complete(seer, first, slot=0, images=images)
    assert isinstance(one.final, JobDone), one.final
    assert seer.call(lambda e: e.counters.image_rows).result(10) - before == image.n_tokens
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
