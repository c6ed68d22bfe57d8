"""A model's vision projector (`--mmproj`, llama-server's flag) through llama.cpp's multimodal library, mtmd.

The router loads it beside its vocabulary (a vocab-only model serves: mtmd lays out the chunks and counts an image's
rows as the worker will) to turn a rendered prompt with one media marker per image into token ids, each image as the
ids common/media.py makes from its bytes. The worker loads it beside its weights to compute an image's rows into a
slot's sequence: `encode_image` (on a thread of its own: worker/images.py), then `decode_image` (on the compute thread).
mtmd facts and gotchas: bench/tiny_mmproj.py's docstring.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Any

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from common.media import digest, image_tokens

MARKER = mtmd.mtmd_default_marker().decode()  # "<__media__>": where a rendered prompt has an image
TEXT, IMAGE = mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
NO_CALLBACK = mtmd.mtmd_helper_post_decode_callback()  # (a NULL one: what mtmd_helper_eval_chunk_single passes)


class ProjectorError(ValueError):
    """The projector cannot be loaded, or an image cannot be read (`index`: which of the request's, when one)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: where its rows start, how many, and its file's bytes (the worker encodes them)."""

    start: int
    n_tokens: int
    data: bytes


class EncodedImage:
    """An image's rows as the projector encoded them (n_tokens x the text model's input width floats), with the mtmd
    chunk they belong to (decoding them needs it); `free` once decoded or no longer wanted (twice is harmless)."""

    def __init__(self, chunks: Any, chunk: Any, n_tokens: int, rows: ctypes.Array[ctypes.c_float]) -> None:
        self._chunks, self.chunk, self.n_tokens, self.rows = chunks, chunk, n_tokens, rows
        self.encode_s = 0.0  # what its encode took
        self.n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))  # the positions it advances (common/media.py)

    def free(self) -> None:
        if self._chunks is not None:
            mtmd.mtmd_input_chunks_free(self._chunks)
            self._chunks = self.chunk = None


class Projector:
    """One mtmd context. Not thread-safe: calls are serialised (the router prepares on several threads)."""

    def __init__(self, path: str, model: Any, *, threads: int = 1, use_gpu: bool = False, warmup: bool = False) -> None:
        mtmd.mtmd_helper_log_set(llama_cpp._logger.llama_log_callback, None)  # (quiet as llama.cpp's own log)
        p = mtmd.mtmd_context_params_default()
        p.use_gpu, p.print_timings, p.n_threads, p.warmup = use_gpu, False, threads, warmup
        self.ctx = mtmd.mtmd_init_from_file(path.encode(), model, p)
        if not self.ctx:
            raise ProjectorError(
                f"--mmproj {path}: llama.cpp's multimodal library could not load it as a projector for this model "
                "(not a projector GGUF, or one made for another model's width)"
            )
        self.path = path
        if not mtmd.mtmd_support_vision(self.ctx):
            self.close()
            raise ProjectorError(f"--mmproj {path}: this projector reads no images (audio only)")
        # Qwen-VL's M-RoPE: an image's rows share a position and advance fewer than their number (common/media.py)
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self.n_embd = llama_cpp.llama_model_n_embd_inp(model)  # (an encoded image's row: what the text model reads)
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def _chunks(self, text: str, add_special: bool, images: list[bytes]) -> Any:
        """mtmd's chunks of `text` (one MARKER per image, in order); the caller frees them."""
        bitmaps = []
        try:
            for i, data in enumerate(images):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bmp = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                if not bmp:
                    raise ProjectorError(f"image {i}: not an image llama.cpp can decode (PNG, JPEG, GIF, BMP)", i)
                bitmaps.append(bmp)
            chunks = mtmd.mtmd_input_chunks_init()
            raw = text.encode()
            inp = mtmd.mtmd_input_text(raw, len(raw), add_special, True)
            arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
        finally:
            for bmp in bitmaps:
                mtmd.mtmd_bitmap_free(bmp)  # (the chunks hold the preprocessed image)
        if rc != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            markers = text.count(MARKER)
            if markers != len(images):
                raise ProjectorError(f"the prompt has {markers} image markers ({MARKER}) for {len(images)} images")
            raise ProjectorError(f"an image could not be prepared for the projector (mtmd_tokenize returned {rc})")
        return chunks

    def tokenize(self, text: str, add_special: bool, images: list[bytes]) -> tuple[np.ndarray, list[PromptImage]]:
        """The prompt's token ids (each image as common/media.py's ids) and where its images are."""
        with self._lock:
            chunks = self._chunks(text, add_special, images)
            try:
                parts: list[np.ndarray] = []
                placed: list[PromptImage] = []
                at = 0
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    c = mtmd.mtmd_input_chunks_get(chunks, i)
                    if mtmd.mtmd_input_chunk_get_type(c) == TEXT:
                        n = ctypes.c_size_t()
                        ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                        part = np.ctypeslib.as_array(ptr, shape=(n.value,)).astype(np.int32) if n.value else np.empty(0, np.int32)
                    else:
                        data = images[len(placed)]
                        n, n_pos = mtmd.mtmd_input_chunk_get_n_tokens(c), mtmd.mtmd_input_chunk_get_n_pos(c)
                        part = image_tokens(digest(data), n, n_pos)
                        placed.append(PromptImage(at, len(part), data))
                    parts.append(part)
                    at += len(part)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
        return (np.concatenate(parts) if parts else np.empty(0, np.int32)), placed

    def encode_image(self, data: bytes, n_batch: int) -> EncodedImage:
        """Encode the image `data` with the projector (mtmd_encode_chunk: the projector's forward, which does not touch
        any llama context, so it may run on another thread than the one decoding) and copy its rows out; the caller
        decodes them (`decode_image`) or frees them. For an image whose rows attend to each other (Gemma 3's), `n_batch`
        and the context's n_batch and n_ubatch must be at least its rows (llama.cpp asserts it: bench/tiny_mmproj.py);
        causal rows (Qwen-VL's) are decoded n_batch at a time."""
        with self._lock:
            chunks = self._chunks(MARKER, False, [data])
            try:
                image = next(
                    mtmd.mtmd_input_chunks_get(chunks, i)
                    for i in range(mtmd.mtmd_input_chunks_size(chunks))
                    if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i)) == IMAGE
                )
                n = mtmd.mtmd_input_chunk_get_n_tokens(image)
                if n > n_batch and mtmd.mtmd_decode_use_non_causal(self.ctx, image):  # (causal rows: split over decodes)
                    raise ProjectorError(f"an image of {n} rows does not fit a batch of {n_batch}")
                t0 = time.perf_counter()
                rc = mtmd.mtmd_encode_chunk(self.ctx, image)
                if rc != 0:
                    raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
                # (the output is the context's, overwritten by the next encode: copied while the lock is held)
                rows = (ctypes.c_float * (n * self.n_embd))()
                ctypes.memmove(rows, mtmd.mtmd_get_output_embd(self.ctx), ctypes.sizeof(rows))
                encoded = EncodedImage(chunks, image, n, rows)
                encoded.encode_s = time.perf_counter() - t0
                return encoded
            except BaseException:
                mtmd.mtmd_input_chunks_free(chunks)
                raise

    def causal(self, image: EncodedImage) -> bool:
        """Whether the image's rows are causal (Qwen-VL's), so they may be decoded a part at a time (`decode_rows`);
        Gemma 3's attend to each other and are decoded whole (`decode_image`)."""
        return not mtmd.mtmd_decode_use_non_causal(self.ctx, image.chunk)

    def decode_rows(self, lctx: Any, image: EncodedImage, start_pos: int, seq: int, first: int, n: int) -> None:
        """Decode rows first..first+n-1 of a causal image into sequence `seq`, its first row at position `start_pos`,
        as mtmd_helper_decode_image_chunk decodes each of its batches (each row's positions from mtmd: M-RoPE's four
        where the model has them, laid out section by section), so that an image of many rows takes several steps."""
        per = 4 if self.mrope else 1
        pos = (llama_cpp.llama_pos * (n * per))()
        if self.mrope:
            grid = mtmd.mtmd_input_chunk_get_tokens_image(image.chunk)
            for i in range(n):
                p = mtmd.mtmd_image_tokens_get_decoder_pos(grid, start_pos, first + i)
                pos[i], pos[i + n], pos[i + 2 * n], pos[i + 3 * n] = p.t, p.y, p.x, p.z
        else:
            pos[:n] = list(range(start_pos + first, start_pos + first + n))
        seq_id = ctypes.pointer(llama_cpp.llama_seq_id(seq))
        seq_ids = (ctypes.POINTER(llama_cpp.llama_seq_id) * n)(*([seq_id] * n))
        batch = llama_cpp.llama_batch(
            n_tokens=n,
            token=None,
            embd=ctypes.cast(ctypes.byref(image.rows, 4 * first * self.n_embd), ctypes.POINTER(ctypes.c_float)),
            pos=pos,
            n_seq_id=(ctypes.c_int32 * n)(*([1] * n)),
            seq_id=seq_ids,
            logits=(ctypes.c_int8 * n)(),
        )
        rc = llama_cpp.llama_decode(lctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode of an image's rows {first}..{first + n - 1} returned {rc}")

    def decode_image(self, lctx: Any, image: EncodedImage, n_past: int, seq: int, n_batch: int) -> int:
        """Decode an encoded image's rows into sequence `seq` from position `n_past` (no logits: a text token after it
        is sampled), as mtmd_helper_eval_chunk_single does after its encode (mtmd_helper_decode_image_chunk: causal
        attention off around it where the projector asks, as for Gemma 3; M-RoPE's positions where the model has
        them); the positions it advanced (`image.n_pos`; its rows take `image.n_tokens` cells). Not under the lock: it
        reads only the projector's type, never what an encode writes, so another image may be encoding meanwhile."""
        new_past = llama_cpp.llama_pos(n_past)
        rc = mtmd.mtmd_helper_decode_image_chunk(
            self.ctx, lctx, image.chunk, image.rows, n_past, seq, n_batch, ctypes.byref(new_past), NO_CALLBACK, None
        )
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_decode_image_chunk returned {rc}")
        return int(new_past.value) - n_past
