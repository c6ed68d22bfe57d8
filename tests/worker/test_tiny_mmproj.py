"""Images through llama.cpp's multimodal library (mtmd, the bindings llama-cpp-python ships) on the default model
with the tiny random-weight Gemma 3 projector of bench/tiny_mmproj.py (issue 64: no real projector can be downloaded
here): the loader takes it, a prompt with a marker becomes text, image, text chunks, the image encodes to rows of the
model's width, the same bytes to the same rows, and the rows decode into a llama context as the positions say."""

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

from bench.tiny_mmproj import mmproj, png, tokens_per_image
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

    def __init__(self, proj: Path, vocab_only: bool = False) -> None:
        init_backend()
        mtmd.mtmd_helper_log_set(_logger.llama_log_callback, None)  # (mtmd's own log, quiet as llama.cpp's)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = vocab_only
        self.model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(), params)
        assert self.model
        self.vocab = Vocab.from_model(self.model, default_model_path())
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        p = mtmd.mtmd_context_params_default()
        p.use_gpu, p.print_timings, p.n_threads, p.warmup = False, False, 1, not vocab_only
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

    def tokenize(self, text: bytes, images: list[bytes], placeholder: bool = False) -> Any:
        """The chunks (owned: mtmd_input_chunks_free) of `text` with one marker per image."""
        bmps = [mtmd.mtmd_bitmap_init(48, 40, None) if placeholder else self.bitmap(d) for d in images]
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
