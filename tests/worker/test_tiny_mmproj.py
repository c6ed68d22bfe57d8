"""Images through llama.cpp's multimodal library (mtmd, the bindings llama-cpp-python ships) on the default model
with the tiny random-weight Gemma 3 projector of bench/tiny_mmproj.py (issue 64: no real projector can be downloaded
here): the loader takes it, a prompt with a marker becomes text, image, text chunks, the image encodes to rows of the
model's width, the same bytes to the same rows, and the rows decode into a llama context as the positions say. The
same for its tiny Qwen2-VL projector on the tiny qwen35 model (M-RoPE: an image takes nx * ny rows, max(nx, ny)
positions)."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest
from llama_cpp import _logger

from bench import tiny_archs
from bench.tiny_mmproj import mmproj, png, qwen2vl_grid, qwen2vl_mmproj, tokens_per_image
from common.model import default_model_path
from common.vocab import Vocab, init_backend

pytestmark = pytest.mark.model

N_IMG = tokens_per_image()  # 16
MARKER = mtmd.mtmd_default_marker()  # b"<__media__>"
TEXT, IMAGE = mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE


@dataclass
class Chunk:
    type: int
    n_tokens: int
    n_pos: int
    id: bytes | None
    tokens: list[int]


class Mtmd:
    """A llama model (weights, or its vocabulary alone) and an mtmd context on the tiny projector."""

    def __init__(
        self, proj: Path, vocab_only: bool = False, model: Path | None = None, warmup: bool = True, min_tokens: int = 0
    ) -> None:
        init_backend()
        mtmd.mtmd_helper_log_set(_logger.llama_log_callback, None)  # (mtmd's own log, quiet as llama.cpp's)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = vocab_only
        path = model or default_model_path()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model
        self.vocab = Vocab.from_model(self.model, path)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        p = mtmd.mtmd_context_params_default()
        p.use_gpu, p.print_timings, p.n_threads, p.warmup = False, False, 1, warmup and not vocab_only
        p.image_min_tokens = min_tokens  # (0: the projector's own; llama-server's --image-min-tokens)
        self.ctx = mtmd.mtmd_init_from_file(str(proj).encode(), self.model, p)
        assert self.ctx, "mtmd_init_from_file refused the tiny projector"

    def close(self) -> None:
        mtmd.mtmd_free(self.ctx)  # (before the model it was made with)
        self.vocab.close()
        llama_cpp.llama_model_free(self.model)

    def bitmap(self, data: bytes) -> Any:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bmp = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        assert bmp
        return bmp

    def tokenize(self, text: bytes, images: list[bytes], placeholder: bool = False, size: tuple[int, int] = (48, 40)) -> Any:
        """The chunks (owned: mtmd_input_chunks_free) of `text` with one marker per image (placeholder: of `size`)."""
        bmps = [mtmd.mtmd_bitmap_init(*size, None) if placeholder else self.bitmap(d) for d in images]
        chunks = mtmd.mtmd_input_chunks_init()
        inp = mtmd.mtmd_input_text(text, len(text), True, True)
        try:
            rc = mtmd.mtmd_tokenize(
                self.ctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * len(bmps))(*bmps), len(bmps)
            )
        finally:
            for b in bmps:
                mtmd.mtmd_bitmap_free(b)  # (the chunks hold their own copy of the preprocessed image)
        if rc != 0:  # 2: markers and images differ in number (mtmd.h says 1), or an image could not be preprocessed
            mtmd.mtmd_input_chunks_free(chunks)
            raise ValueError(rc)
        return chunks

    def chunks(self, chunks: Any) -> list[Chunk]:
        out = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            c = mtmd.mtmd_input_chunks_get(chunks, i)
            kind, tokens = mtmd.mtmd_input_chunk_get_type(c), []
            if kind == TEXT:
                n = ctypes.c_size_t()
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens = [ptr[j] for j in range(n.value)]
            out.append(Chunk(kind, mtmd.mtmd_input_chunk_get_n_tokens(c), mtmd.mtmd_input_chunk_get_n_pos(c),
                             mtmd.mtmd_input_chunk_get_id(c), tokens))  # fmt: skip
        return out

    def embedding(self, data: bytes) -> np.ndarray:
        """The rows the image `data` encodes to (n_tokens x n_embd)."""
        chunks = self.tokenize(MARKER, [data])
        try:
            img = mtmd.mtmd_input_chunks_get(chunks, 1)
            n = mtmd.mtmd_input_chunk_get_n_tokens(img)
            assert mtmd.mtmd_encode_chunk(self.ctx, img) == 0
            ptr = mtmd.mtmd_get_output_embd(self.ctx)
            return np.ctypeslib.as_array(ptr, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
        finally:
            mtmd.mtmd_input_chunks_free(chunks)


@pytest.fixture(scope="module")
def proj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf", text_model_n_embd=640)


@pytest.fixture(scope="module")
def mm(proj: Path) -> Iterator[Mtmd]:
    m = Mtmd(proj)
    yield m
    m.close()


def _layout(m: Mtmd, chunks: list[Chunk], data: bytes | None) -> None:
    soi, eoi = (m.vocab.tokenize(t, add_special=False) for t in ("<start_of_image>", "<end_of_image>"))
    assert [c.type for c in chunks] == [TEXT, IMAGE, TEXT]
    before, image, after = chunks
    assert before.tokens == [m.vocab.bos, *m.vocab.tokenize("Look:", add_special=False), *soi]
    assert after.tokens == [*eoi, *m.vocab.tokenize(" what?", add_special=False)]
    assert (image.n_tokens, image.n_pos, image.tokens) == (N_IMG, N_IMG, [])  # no M-RoPE: a row, a position
    for c in (before, after):
        assert c.n_tokens == c.n_pos == len(c.tokens) and c.id is None
    # the helper names a bitmap by the SHA-256 of the file's bytes; a placeholder has none
    assert image.id == (hashlib.sha256(data).hexdigest().encode() if data else b"")


def test_a_marker_becomes_text_image_text(mm: Mtmd) -> None:
    assert mtmd.mtmd_support_vision(mm.ctx) and not mtmd.mtmd_support_audio(mm.ctx)
    assert not mtmd.mtmd_decode_use_mrope(mm.ctx)  # Gemma 3: plain positions
    data = png(48, 40, seed=1)
    chunks = mm.tokenize(b"Look:" + MARKER + b" what?", [data])
    try:
        _layout(mm, mm.chunks(chunks), data)
        assert mtmd.mtmd_decode_use_non_causal(mm.ctx, mtmd.mtmd_input_chunks_get(chunks, 1))  # Gemma 3's image rows
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == mtmd.mtmd_helper_get_n_pos(chunks)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)

    for text, images in ((b"Look:" + MARKER, []), (b"Look:", [data])):  # a marker without its image, and the reverse
        with pytest.raises(ValueError, match=r"^2$"):
            mm.tokenize(text, images)


def test_a_projector_of_another_width_is_refused(mm: Mtmd, tmp_path: Path) -> None:
    p = mtmd.mtmd_context_params_default()
    p.use_gpu, p.print_timings, p.n_threads, p.warmup = False, False, 1, False
    assert not mtmd.mtmd_init_from_file(str(mmproj(tmp_path / "p64.gguf", text_model_n_embd=64)).encode(), mm.model, p)


def test_an_image_encodes_to_rows_of_the_models_width(mm: Mtmd) -> None:
    a, b = png(48, 40, seed=1), png(64, 64, seed=2)
    ea = mm.embedding(a)
    assert ea.shape == (N_IMG, 640) and np.isfinite(ea).all() and ea.std() > 0
    assert np.array_equal(mm.embedding(a), ea)  # the same bytes: the same rows, bit for bit
    eb = mm.embedding(b)
    assert np.isfinite(eb).all() and not np.allclose(ea, eb)


def test_the_chunks_decode_into_a_context(mm: Mtmd) -> None:
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64  # (n_ubatch >= an image's rows: llama.cpp asserts it, non-causal)
    cp.n_threads = cp.n_threads_batch = 1
    lctx = llama_cpp.llama_init_from_model(mm.model, cp)
    assert lctx
    chunks = mm.tokenize(b"Look:" + MARKER + b" what?", [png(48, 40, seed=1)])
    try:
        mem = llama_cpp.llama_get_memory(lctx)
        n_past = 0
        for i, c in enumerate(mm.chunks(chunks)):
            new = llama_cpp.llama_pos(n_past)  # (a text chunk adds its tokens to it; an image sets it)
            last = i == mtmd.mtmd_input_chunks_size(chunks) - 1
            rc = mtmd.mtmd_helper_eval_chunk_single(
                mm.ctx, lctx, mtmd.mtmd_input_chunks_get(chunks, i), n_past, 0, 64, last, ctypes.byref(new)
            )
            assert rc == 0 and new.value == n_past + c.n_pos
            n_past = new.value
            assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n_past - 1
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(mm.vocab.n_vocab,))
        assert np.isfinite(logits).all()
        token = int(np.argmax(logits))
        assert llama_cpp.llama_decode(lctx, llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(token), 1)) == 0
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n_past
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        llama_cpp.llama_free(lctx)


def test_a_vocabulary_alone_counts_an_images_tokens(proj: Path) -> None:
    """What the router can do: mtmd on a vocab-only model lays out the chunks as the worker will (the projector is
    still loaded whole); a placeholder bitmap (no pixels) counts, and cannot be encoded."""
    m = Mtmd(proj, vocab_only=True)
    try:
        assert m.n_embd == 0  # (so mtmd skips its width check: any projector loads beside a vocabulary)
        chunks = m.tokenize(b"Look:" + MARKER + b" what?", [b""], placeholder=True)
        try:
            _layout(m, m.chunks(chunks), None)
            assert mtmd.mtmd_encode_chunk(m.ctx, mtmd.mtmd_input_chunks_get(chunks, 1)) != 0
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
    finally:
        m.close()


# --- Qwen2-VL (qwen2vl_merger) on the tiny qwen35 model: M-RoPE positions

QWEN_W, QWEN_H = 32, 16  # patch 4: a 4 x 2 grid of merged patches, the smallest with nx != ny mtmd does not resize
QWEN_N_EMBD = 256  # the tiny qwen35 model's width


@pytest.fixture(scope="module")
def qproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen2vl_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-qwen2vl-mmproj.gguf", text_model_n_embd=QWEN_N_EMBD)


@pytest.fixture(scope="module")
def qm(qproj: Path) -> Iterator[Mtmd]:
    m = Mtmd(qproj, model=tiny_archs.model("qwen35"), warmup=False)  # (params as common/projector.py sets them)
    yield m
    m.close()


def _grid(chunk: Any) -> tuple[int, int]:
    img = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
    return mtmd.mtmd_image_tokens_get_nx(img), mtmd.mtmd_image_tokens_get_ny(img)


def test_qwen2vl_loads_beside_an_mrope_model(qm: Mtmd, tmp_path: Path) -> None:
    assert qm.n_embd == QWEN_N_EMBD and mtmd.mtmd_support_vision(qm.ctx)
    assert mtmd.mtmd_decode_use_mrope(qm.ctx)  # (from the text model's rope type, IMROPE; not from the projector)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu, p.print_timings, p.n_threads, p.warmup = False, False, 1, False
    other = qwen2vl_mmproj(tmp_path / "q64.gguf", text_model_n_embd=64)
    assert not mtmd.mtmd_init_from_file(str(other).encode(), qm.model, p)  # another width: refused, as for Gemma 3


def test_qwen2vl_a_marker_becomes_text_image_text(qm: Mtmd) -> None:
    data = png(QWEN_W, QWEN_H, seed=1)
    chunks = qm.tokenize(b"Look:" + MARKER + b" what?", [data])
    try:
        before, image, after = qm.chunks(chunks)
        assert [c.type for c in (before, image, after)] == [TEXT, IMAGE, TEXT]
        # mtmd wraps the image in Qwen's markers, tokenized as text (the test vocabulary: no BOS, 5-character chunks)
        tok = qm.vocab.tokenize
        assert before.tokens == tok("Look:", add_special=False) + tok("<|vision_start|>", add_special=False)
        assert after.tokens == tok("<|vision_end|>", add_special=False) + tok(" what?", add_special=False)
        nx, ny = qwen2vl_grid(QWEN_W, QWEN_H)
        assert (nx, ny) == _grid(mtmd.mtmd_input_chunks_get(chunks, 1)) == (4, 2)
        assert (image.n_tokens, image.n_pos) == (nx * ny, max(nx, ny)) == (8, 4)  # rows (KV cells) vs positions
        assert image.id == hashlib.sha256(data).hexdigest().encode()
        assert not mtmd.mtmd_decode_use_non_causal(qm.ctx, mtmd.mtmd_input_chunks_get(chunks, 1))  # causal rows
        assert mtmd.mtmd_helper_get_n_tokens(chunks) == len(before.tokens) + 8 + len(after.tokens)
        assert mtmd.mtmd_helper_get_n_pos(chunks) == len(before.tokens) + 4 + len(after.tokens)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)


@pytest.mark.parametrize(
    ("width", "height", "grid"),
    [
        (32, 16, (4, 2)),  # as it is: 512 pixels = 8 tokens of 8x8, the minimum
        (16, 40, (2, 5)),  # portrait: ny > nx, n_pos 5
        (33, 17, (4, 2)),  # each side rounded to a multiple of 8
        (24, 16, (4, 3)),  # 3 x 2 = 6 < 8 tokens: scaled up (ceil) to 32 x 24
        (16, 8, (4, 2)),  # 2 x 1: scaled up to 32 x 16
        (1, 1, (3, 3)),  # rounded up to 8 x 8, then scaled up to 24 x 24
        (600, 451, (73, 55)),  # 75 x 56 > 4096 tokens: scaled down (floor) to 4015
        (1, 40000, (1, 12800)),  # the clamp exceeds 4096: the 1-pixel side first rounds up to 8 (transformers refuses)
    ],
)
def test_qwen2vl_image_counts_follow_the_smart_resize(qm: Mtmd, width: int, height: int, grid: tuple[int, int]) -> None:
    """n_tokens = nx * ny, n_pos = max(nx, ny) of the grid `qwen2vl_grid` computes (placeholder bitmaps: counting
    needs no pixels)."""
    assert qwen2vl_grid(width, height) == grid
    chunks = qm.tokenize(MARKER, [b""], placeholder=True, size=(width, height))
    try:
        start, image, end = qm.chunks(chunks)  # ("<|vision_start|>", the image, "<|vision_end|>")
        assert (start.type, image.type, end.type) == (TEXT, IMAGE, TEXT)
        assert _grid(mtmd.mtmd_input_chunks_get(chunks, 1)) == grid
        assert (image.n_tokens, image.n_pos) == (grid[0] * grid[1], max(grid))
    finally:
        mtmd.mtmd_input_chunks_free(chunks)


def test_qwen2vl_image_min_tokens_lowers_the_floor(qproj: Path) -> None:
    """The context's image_min_tokens replaces clip's 8: 24 x 16 pixels stay a 3 x 2 grid (6 rows, 3 positions)
    and encode."""
    m = Mtmd(qproj, model=tiny_archs.model("qwen35"), warmup=False, min_tokens=1)
    try:
        assert qwen2vl_grid(24, 16, min_tokens=1) == (3, 2)
        assert [(c.n_tokens, c.n_pos) for c in _images(m, png(24, 16, seed=3))] == [(6, 3)]
        assert m.embedding(png(24, 16, seed=3)).shape == (6, QWEN_N_EMBD)
    finally:
        m.close()


def _images(m: Mtmd, data: bytes) -> list[Chunk]:
    chunks = m.tokenize(MARKER, [data])
    try:
        return [c for c in m.chunks(chunks) if c.type == IMAGE]
    finally:
        mtmd.mtmd_input_chunks_free(chunks)


def test_qwen2vl_an_image_encodes_to_rows_of_the_models_width(qm: Mtmd) -> None:
    a, b = png(QWEN_W, QWEN_H, seed=1), png(QWEN_W, QWEN_H, seed=2)
    ea = qm.embedding(a)
    assert ea.shape == (8, QWEN_N_EMBD) and np.isfinite(ea).all() and ea.std() > 0
    assert np.array_equal(qm.embedding(a), ea)  # the same bytes: the same rows, bit for bit
    eb = qm.embedding(b)
    assert np.isfinite(eb).all() and not np.allclose(ea, eb)


def _qwen_context(m: Mtmd) -> Any:
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64  # (>= an image's rows; not asserted for causal rows, but whole)
    cp.n_threads = cp.n_threads_batch = 1
    lctx = llama_cpp.llama_init_from_model(m.model, cp)
    assert lctx
    return lctx


def test_qwen2vl_the_chunks_decode_at_mrope_positions(qm: Mtmd) -> None:
    """The image advances positions by max(nx, ny) = 4 while it takes nx * ny = 8 KV cells; its rows all sit at the
    temporal position it starts at (the cell's position), x/y offsets in the other sections."""
    lctx = _qwen_context(qm)
    chunks = qm.tokenize(b"Look:" + MARKER + b" what?", [png(QWEN_W, QWEN_H, seed=1)])
    try:
        before, image, after = qm.chunks(chunks)
        mem = llama_cpp.llama_get_memory(lctx)
        new = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(qm.ctx, lctx, chunks, 0, 0, 64, True, ctypes.byref(new)) == 0
        n_past = len(before.tokens) + image.n_pos + len(after.tokens)  # 5 + 4 + 5: positions, not rows (5 + 8 + 5)
        assert new.value == n_past == 14
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n_past - 1  # the last text token's position
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(qm.vocab.n_vocab,))
        assert np.isfinite(logits).all()

        # chunk by chunk: where each leaves the sequence, and the positions of the image's rows
        llama_cpp.llama_memory_clear(mem, True)
        start = len(before.tokens)
        img = mtmd.mtmd_input_chunk_get_tokens_image(mtmd.mtmd_input_chunks_get(chunks, 1))
        pos = [mtmd.mtmd_image_tokens_get_decoder_pos(img, start, i) for i in range(image.n_tokens)]
        assert [(p.t, p.x, p.y) for p in pos] == [(start, start + i % 4, start + i // 4) for i in range(8)]
        n_past, last = 0, []
        for i in range(3):
            new = llama_cpp.llama_pos(n_past)
            rc = mtmd.mtmd_helper_eval_chunk_single(
                qm.ctx, lctx, mtmd.mtmd_input_chunks_get(chunks, i), n_past, 0, 64, i == 2, ctypes.byref(new)
            )
            assert rc == 0
            n_past = new.value
            last.append(llama_cpp.llama_memory_seq_pos_max(mem, 0))
        # after the image the sequence's last position is still the image's start (every row's temporal position);
        # the text after it starts at start + n_pos
        assert last == [start - 1, start, n_past - 1] == [4, 5, 13]
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        llama_cpp.llama_free(lctx)


def test_qwen2vl_text_after_an_image_needs_its_positions(qm: Mtmd) -> None:
    """llama.cpp continues a batch without positions (llama_batch_get_one) at the sequence's last position + 1: after
    an M-RoPE image that is its start + 1, inside the image's span, not start + n_pos. A worker that decodes the
    text after an image itself must give it positions (the helper does)."""
    lctx = _qwen_context(qm)
    chunks = qm.tokenize(b"Look:" + MARKER, [png(QWEN_W, QWEN_H, seed=1)])
    try:
        before, image, after = qm.chunks(chunks)  # (mtmd closes the image with "<|vision_end|>" text)
        start, n = len(before.tokens), len(after.tokens)
        assert (start, image.n_pos, n) == (5, 4, 3)
        n_past = 0
        for i in range(2):
            new = llama_cpp.llama_pos(n_past)
            rc = mtmd.mtmd_helper_eval_chunk_single(
                qm.ctx, lctx, mtmd.mtmd_input_chunks_get(chunks, i), n_past, 0, 64, False, ctypes.byref(new)
            )
            assert rc == 0
            n_past = new.value
        assert n_past == start + image.n_pos
        mem = llama_cpp.llama_get_memory(lctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == start
        ids = (llama_cpp.llama_token * n)(*after.tokens)
        assert llama_cpp.llama_decode(lctx, llama_cpp.llama_batch_get_one(ids, n)) == 0
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == start + n  # 8 (the helper's: n_past + n - 1 = 11)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        llama_cpp.llama_free(lctx)


def test_qwen2vl_a_vocabulary_alone_counts_as_the_worker(qproj: Path) -> None:
    m = Mtmd(qproj, vocab_only=True, model=tiny_archs.model("qwen35"))
    try:
        assert m.n_embd == 0 and mtmd.mtmd_decode_use_mrope(m.ctx)  # (the rope type is in a vocab-only model)
        chunks = m.tokenize(b"Look:" + MARKER + b" what?", [b""], placeholder=True, size=(QWEN_W, QWEN_H))
        try:
            assert [(c.type, c.n_tokens, c.n_pos) for c in m.chunks(chunks)] == [(TEXT, 5, 5), (IMAGE, 8, 4), (TEXT, 5, 5)]
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
    finally:
        m.close()
