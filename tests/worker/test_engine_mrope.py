"""Images on a model that places them with M-RoPE (issue 64: Qwen-VL's and Qwen 3.5's kind), in the engine: tiny
random-weight Qwen 3.5 (hybrid) and Qwen3-VL (attention alone) models (bench/tiny_archs.py) with the tiny Qwen2-VL
projector (bench/tiny_mmproj.py). An image of 4 x 2 merged patches takes 8 rows of KV but advances 4 positions; the
text after it must sit where llama.cpp's own multimodal helper puts it, on the slot's first turn, on a turn that
reuses the image, after the slot is cut back inside the text after it, and after its state comes back from the
host-RAM tier."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest
from worker_helpers import Run, assert_slot_invariant, complete, job, prompt_of
from worker_helpers import start as start_run

from bench import tiny_archs
from bench.tiny_mmproj import png, qwen2vl_grid, qwen2vl_mmproj
from common.media import mrope_spans
from common.projector import MARKER, Projector
from protocol import JobDone
from worker.config import WorkerConfig
from worker.engine import Engine

pytestmark = pytest.mark.model

WIDTH, HEIGHT = 32, 16  # 4 x 2 merged patches: 8 rows, 4 positions
TEXT = "Look at this picture: " + MARKER + " and tell me what it shows, in a few words."
N_GEN = 6


@pytest.fixture(scope="module", params=["qwen35", "qwen3vl"])
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # (weights of stdev 0.5, not 0.1: attention sharp enough that positions 4 apart give other tokens)
    proj = qwen2vl_mmproj(tmp_path_factory.mktemp("qwen-mmproj") / "tiny-qwen2vl.gguf")
    return tiny_archs.model(request.param, stdev=0.5), proj


@pytest.fixture(scope="module")
def seer(files: tuple[Path, Path]) -> Iterator[Engine]:
    model, proj = files
    cfg = WorkerConfig(model=str(model), slots=3, ctx_per_slot=256, threads=1, n_batch=64, host_cache_mb=64, mmproj=str(proj))
    eng = Engine(cfg).start()
    yield eng
    eng.stop()


def seer_text(engine: Engine) -> list[int]:
    return engine.vocab.tokenize("Count from one to fifty, slowly and with care.", add_special=False)


def reference(files: tuple[Path, Path], text: str, image: bytes, n: int, lag: int = 0) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities as llama.cpp computes them alone: mtmd's helper evaluates the
    prompt's chunks (the image at its M-RoPE positions, the text after it from start + n_pos), then each token is
    decoded at the next position.
    `lag`: a wrong placement to show the test tells them apart (every position after the image moved by it)."""
    model_path, proj_path = files
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
    cp.n_threads = cp.n_threads_batch = 1
    lctx = llama_cpp.llama_init_from_model(model, cp)
    proj = Projector(str(proj_path), model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    chunks = proj._chunks(text, True, [image])
    batch = llama_cpp.llama_batch_init(64, 0, 1)
    try:
        n_past = 0
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            new = llama_cpp.llama_pos(n_past)
            last = i == mtmd.mtmd_input_chunks_size(chunks) - 1
            assert mtmd.mtmd_helper_eval_chunk_single(proj.ctx, lctx, chunk, n_past, 0, 64, last, ctypes.byref(new)) == 0
            n_past = new.value + (lag if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE else 0)
        out: list[int] = []
        logprobs: list[float] = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,)).astype(np.float64)
            out.append(int(np.argmax(logits)))
            logprobs.append(float(logits[out[-1]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())))
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = out[-1], n_past, 1, True
            batch.seq_id[0][0] = 0
            assert llama_cpp.llama_decode(lctx, batch) == 0
            n_past += 1
        return out, logprobs
    finally:
        llama_cpp.llama_batch_free(batch)
        mtmd.mtmd_input_chunks_free(chunks)
        proj.close()
        llama_cpp.llama_free(lctx)
        llama_cpp.llama_model_free(model)


def test_the_text_after_an_image_is_where_llama_cpp_puts_it(seer: Engine, files: tuple[Path, Path]) -> None:
    seer.reset()
    picture = png(WIDTH, HEIGHT, seed=1)
    nx, ny = qwen2vl_grid(WIDTH, HEIGHT)
    prompt, images = prompt_of(seer, TEXT, picture)
    (image,) = images
    assert (image.n_tokens, nx, ny) == (8, 4, 2)
    assert mrope_spans(prompt) == [(image.start, image.start + 8, 8 - 4)]  # (the ids say it: common/media.py)

    run = complete(seer, prompt, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True, logprobs=0)
    assert isinstance(run.final, JobDone), run.final
    assert_slot_invariant(seer, run)
    tokens, logprobs = reference(files, TEXT, picture, N_GEN)
    got = [lp.logprob for d in run.deltas for lp in d.logprobs]
    assert run.tokens == tokens and np.allclose(got, logprobs, atol=1e-3), (got, logprobs)
    _, misplaced = reference(files, TEXT, picture, N_GEN, lag=4)  # (as if one position a row: the test tells them apart)
    assert not np.allclose(misplaced, logprobs, atol=1e-3), (misplaced, logprobs)
    spans, held = seer.call(lambda e: (list(e.table[0].spans), e.llama.seq_len(0))).result(10)
    assert spans == [(image.start, image.start + 8, 4)] and held == len(prompt) + N_GEN - 1 - 4


def test_a_turn_repeating_the_image_reuses_it_and_computes_what_a_cold_one_does(seer: Engine) -> None:
    seer.reset()
    picture = png(WIDTH, HEIGHT, seed=2)
    first, images = prompt_of(seer, TEXT, picture)
    one = complete(seer, first, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
    assert isinstance(one.final, JobDone), one.final
    more = seer.vocab.tokenize(" And the colours, and what is in the corner?", add_special=False, parse_special=False)
    second = first + one.tokens + more
    warm = complete(seer, second, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
    cold = complete(seer, second, slot=2, images=images, max_tokens=N_GEN, ignore_eos=True, prefix_cache=False)
    assert isinstance(warm.final, JobDone) and isinstance(cold.final, JobDone)
    assert warm.final.reused_tokens >= len(first) and cold.final.reused_tokens == 0
    assert warm.tokens == cold.tokens
    assert_slot_invariant(seer, warm)

    # the slot is taken by another prompt (its state kept in host RAM), then the conversation comes back to it
    other = seer.vocab.tokenize("Something else entirely, at some length, to take the slot.", add_special=False)
    assert isinstance(complete(seer, other * 3, slot=0, max_tokens=2).final, JobDone)
    third = second + warm.tokens + more
    back = complete(seer, third, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
    cold = complete(seer, third, slot=2, images=images, max_tokens=N_GEN, ignore_eos=True, prefix_cache=False)
    assert isinstance(back.final, JobDone) and isinstance(cold.final, JobDone)
    assert back.final.restored_tokens >= len(first) + N_GEN  # (from host RAM: its positions read from its ids)
    assert back.tokens == cold.tokens
    assert_slot_invariant(seer, back)


@pytest.mark.parametrize("files", ["qwen3vl"], indirect=True)  # (a hybrid memory is cut only at its checkpoints)
def test_a_turn_that_parts_after_the_image_is_cut_there_at_its_position(seer: Engine, files: tuple[Path, Path]) -> None:
    """Where the memory can be cut (attention alone), the slot is cut inside the text after the image: at the position
    of the first token that differs, which lies 4 before its index."""
    assert not seer.call(lambda e: e.uncut).result(10)
    seer.reset()
    picture = png(WIDTH, HEIGHT, seed=3)
    first, images = prompt_of(seer, TEXT, picture)
    one = complete(seer, first, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
    assert isinstance(one.final, JobDone), one.final
    other_text = TEXT.replace("in a few words.", "at great length, please.")
    second, images2 = prompt_of(seer, other_text, picture)
    parted = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert parted > images[0].start + images[0].n_tokens  # (inside the text after the image)
    warm = complete(seer, second, slot=0, images=images2, max_tokens=N_GEN, ignore_eos=True, logprobs=0)
    assert isinstance(warm.final, JobDone) and warm.final.reused_tokens == parted
    assert_slot_invariant(seer, warm)
    tokens, logprobs = reference(files, other_text, picture, N_GEN)
    got = [lp.logprob for d in warm.deltas for lp in d.logprobs]
    assert warm.tokens == tokens and np.allclose(got, logprobs, atol=1e-3), (got, logprobs)

    other = png(WIDTH, HEIGHT, seed=4)  # another image at the same place: reused up to its first row
    third, images3 = prompt_of(seer, other_text, other)
    again = complete(seer, third, slot=0, images=images3, max_tokens=N_GEN, ignore_eos=True)
    assert isinstance(again.final, JobDone) and again.final.reused_tokens == images3[0].start
    assert again.tokens == reference(files, other_text, other, N_GEN)[0]


@pytest.mark.parametrize("files", ["qwen3vl"], indirect=True)
def test_an_image_of_more_rows_than_a_batch_is_decoded_in_parts(files: tuple[Path, Path]) -> None:
    """Qwen-VL's rows are causal: an image of 120 rows (12 x 10) goes into a worker whose steps take 16 prompt rows in
    parts of 16, one a step (Gemma 3's rows attend to each other and go whole), while another slot's reply streams
    on; the reply is llama.cpp's own."""
    model, proj = files
    cfg = WorkerConfig(model=str(model), slots=2, ctx_per_slot=256, threads=1, n_batch=16, mmproj=str(proj))
    eng = Engine(cfg).start()
    parts: list[tuple[int, int, int]] = []  # (step, first row, rows) of each part decoded

    def recording(e: Any) -> None:
        real = e.projector.decode_rows

        def decode_rows(lctx: Any, image: Any, start_pos: int, seq: int, first: int, n: int) -> None:
            parts.append((e.progress, first, n))
            real(lctx, image, start_pos, seq, first, n)

        e.projector.decode_rows = decode_rows

    try:
        eng.call(recording).result(10)
        picture = png(96, 80, seed=5)
        prompt, images = prompt_of(eng, TEXT, picture)
        assert images[0].n_tokens == 120
        talking = start_run(eng, seer_text(eng), slot=1, max_tokens=40, ignore_eos=True)
        run = complete(eng, prompt, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True, logprobs=0)
        talking.wait()
        assert isinstance(talking.final, JobDone), talking.final
        assert [(first, n) for _, first, n in parts] == [(i, min(16, 120 - i)) for i in range(0, 120, 16)]
        assert len({step for step, _, _ in parts}) == len(parts)  # (a part a step)
        assert isinstance(run.final, JobDone), run.final
        tokens, logprobs = reference(files, TEXT, picture, N_GEN)
        got = [lp.logprob for d in run.deltas for lp in d.logprobs]
        assert run.tokens == tokens and np.allclose(got, logprobs, atol=1e-3), (got, logprobs)
        assert_slot_invariant(eng, run)
    finally:
        eng.stop()


@pytest.mark.parametrize("files", ["qwen3vl"], indirect=True)
def test_a_job_cancelled_while_its_images_rows_go_in_leaves_a_slot_that_serves_on(files: tuple[Path, Path]) -> None:
    """Cancelled after a part of its image's rows: the part's rows are freed, the slot holds a part of the image and
    says so (the invariant holds), and the same prompt again reuses the text before the image only, giving llama.cpp's
    own reply."""
    model, proj = files
    cfg = WorkerConfig(model=str(model), slots=1, ctx_per_slot=256, threads=1, n_batch=16, mmproj=str(proj))
    eng = Engine(cfg).start()
    try:
        picture = png(96, 80, seed=6)
        prompt, images = prompt_of(eng, TEXT, picture)
        gate = threading.Event()

        def holding(e: Any) -> None:
            real = e.projector.decode_rows

            def decode_rows(lctx: Any, image: Any, start_pos: int, seq: int, first: int, n: int) -> None:
                real(lctx, image, start_pos, seq, first, n)
                if first == 32:  # (three parts in: the cancel is taken before the next step: worker/engine.py)
                    gate.set()
                    eng.cancel(run_id[0])

            e.projector.decode_rows = decode_rows

        eng.call(holding).result(10)
        first = job(prompt, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
        run_id = [first.id]
        run = Run(prompt)
        eng.submit(first, run)
        assert gate.wait(30)
        run.wait()
        assert isinstance(run.final, JobDone) and run.final.finish_reason == "cancelled", run.final
        held, parts = eng.call(lambda e: (len(e.table[0].tokens), dict(e.encodings.parts))).result(10)
        assert held == images[0].start + 48 and not parts
        again = complete(eng, prompt, slot=0, images=images, max_tokens=N_GEN, ignore_eos=True)
        assert isinstance(again.final, JobDone) and again.final.reused_tokens == images[0].start
        assert again.tokens == reference(files, TEXT, picture, N_GEN)[0]
        assert_slot_invariant(eng, again)
    finally:
        eng.stop()
