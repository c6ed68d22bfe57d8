"""Embeddings: the vectors of whole inputs, computed in a llama context of their own on the worker's model (the
slots' context and its KV are not touched), with llama.cpp's pooling over each input's tokens.

One context per pooling kind, made at the first request that asks for it, of `n_ctx` cells. An input longer than that
is refused (`bad_request`, naming it). Each input is decoded alone, on cleared memory: its vector is the one llama.cpp
alone gives it (tested), whatever else the request holds. Used on the compute thread only.

An input is computed a chunk at a time (`begin`, then `advance` with the most tokens the caller can spare), so that the
slots' decoding beside it waits for a chunk, not for the whole input (worker/embed_jobs.py sizes the chunks). llama.cpp
pools a sequence over the rows of one ubatch; on a causal model, a row attends only to those before it, whose KV the
earlier chunks left in the context, so each chunk's pooled rows are the input's: mean pooling is the chunks' means
weighted by their lengths, last pooling (and causal rank pooling) the last chunk's, cls pooling the first chunk's (the
first token attends to nothing else: the rest of the input is not computed). Measured on the default model, a
1,200-token input in chunks of 100, 333 and 512 tokens against it decoded whole: a cosine of 0.999995 to 1 with mean
pooling, 1 with cls, 0.9988 to 1 with last (its one row moves with the chunks' matrix shapes, as below; tested). An encoder
(bidirectional attention: every row attends to every other) takes its input in one ubatch as large as the context.

Rank pooling is a reranker's (a `rerank` request's inputs): llama.cpp's classification head over one row, its
outputs (one score, or Qwen3-Reranker's "yes" and "no" probabilities) the "vector".

Last-token pooling, and rank pooling on a causal model (Qwen3-Reranker: the row read is the last), read one row,
which attends to the tokens before it: there, an input that starts with at least MIN_REUSE tokens of the previous
input (an instruction, a document's head; a reranker's template and query, shared by all its documents) keeps their
KV and computes only the rest. Its vector then is not bit for bit the one computed alone: llama.cpp's CPU kernels group a
batch's rows by its size, so the same row computed in another batch differs in its last bits, which the model's
layers grow; measured here, a cosine between 0.997 and 1 to the vector computed alone, as near as llama.cpp's own
flash-attention choice moves it (0.998). Inputs sharing less are computed alone, as every input is with mean and cls
pooling and non-causal rerankers, which read every row of one decode (or attend to all of them).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from common import logs
from worker.llama import Batch

log = logs.get(__name__)

POOLING = {
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
    "rank": llama_cpp.LLAMA_POOLING_TYPE_RANK,
}
MAX_CTX = 8192  # cells of an embedding context (the longest input it takes), at most the trained length
MIN_REUSE = 32  # last (and causal rank) pooling: fewest tokens shared with the previous input before their KV is kept
MAX_CHUNK = 512  # a causal model's ubatch: the most tokens one `advance` decodes (and its compute buffer's size)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def normalized(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


class InputTooLong(ValueError):
    pass


class EmbedInput:
    """One input being computed: its tokens, how far, and what its chunks pooled so far."""

    def __init__(self, tokens: list[int], keep: int) -> None:
        self.tokens = tokens
        self.pos = keep  # the next token to compute (those before are in the context's KV)
        self.kept = keep  # tokens whose KV was kept from the input before
        self.total = np.zeros(0, dtype=np.float64)  # mean pooling: the chunks' pooled rows times their lengths
        self.vector: np.ndarray | None = None  # once computed

    @property
    def left(self) -> int:
        return len(self.tokens) - self.pos


class Embedder:
    """A context with pooling on `model`; `embed` gives one float32 vector per input (`begin` and `advance`: one a
    chunk at a time)."""

    def __init__(self, model: object, pooling: str, threads: int, n_ctx_train: int) -> None:
        self.pooling = pooling
        self.n_ctx = min(MAX_CTX, n_ctx_train) if n_ctx_train > 0 else MAX_CTX
        self.ctx = self._context(model, pooling, threads, min(MAX_CHUNK, self.n_ctx))
        self.chunked = bool(llama_cpp.llama_get_causal_attn(self.ctx))  # (the module's docstring)
        if not self.chunked:  # an encoder pools the input whole: one ubatch of the context's size
            llama_cpp.llama_free(self.ctx)
            self.ctx = self._context(model, pooling, threads, self.n_ctx)
        self.n_batch = min(MAX_CHUNK, self.n_ctx) if self.chunked else self.n_ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        rank = pooling == "rank"
        self.dims = llama_cpp.llama_model_n_cls_out(model) if rank else llama_cpp.llama_model_n_embd(model)
        # one row read, attending to those before it: a shared head's KV can be kept (the module's docstring)
        self.reuses = pooling == "last" or (rank and self.chunked)
        self.batch = Batch(self.n_batch)
        self.held: list[int] = []  # when it reuses: the tokens whose KV the context holds
        self.reused_tokens = 0  # input tokens whose KV was kept, not computed
        log.info("embedding_context", pooling=pooling, n_ctx=self.n_ctx, dims=self.dims, chunk=self.n_batch)

    def _context(self, model: object, pooling: str, threads: int, n_batch: int) -> object:
        cp = llama_cpp.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = POOLING[pooling]
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        # embeddings without flash attention: on CPU it accumulates in f16, which moved vectors to a cosine of 0.998 of
        # the same input's without (the reference they are tested against: llama-cpp-python's `embed`, which has it
        # off). A reranker's scores with llama-server's default (auto: on where the device has it; 5 % faster here),
        # so that they are the ones llama-server gives.
        rank = pooling == "rank"
        off, auto = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        cp.flash_attn_type = auto if rank else off
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make an embedding context of {self.n_ctx} tokens ({pooling} pooling)")
        return ctx

    def embed(self, inputs: list[list[int]], normalize: bool) -> list[np.ndarray]:
        """One vector per input, in order. InputTooLong for an input over the context."""
        self.check([len(t) for t in inputs])
        out = []
        for toks in inputs:
            inp = self.begin(toks)
            while (vector := self.advance(inp, len(toks))) is None:
                pass
            out.append(vector)
        return [normalized(v) for v in out] if normalize else out

    def check(self, lengths: list[int]) -> None:
        """InputTooLong naming the first input over the context."""
        for i, n in enumerate(lengths):
            if n > self.n_ctx:
                raise InputTooLong(f"input {i} has {n} tokens; an embedding holds at most {self.n_ctx}")

    def begin(self, toks: list[int]) -> EmbedInput:
        """An input to compute alone, on memory cleared of the one before: packing several moved each one's vector
        (cosine 0.999 to its own alone, the batch's shape choosing other CPU kernels), and an input's vector should not
        depend on its neighbours. With last (or causal rank) pooling, the part it shares with the previous input is kept
        when long enough (the module's docstring)."""
        keep = 0
        if self.reuses:
            keep = min(shared_prefix(self.held, toks), len(toks) - 1)  # (its last token is computed: its row is read)
            keep = keep if keep >= MIN_REUSE else 0
        # (a recurrent or hybrid memory cannot be cut back partially: seq_rm says so, and the input is computed whole)
        if not keep or not llama_cpp.llama_memory_seq_rm(self.mem, 0, keep, -1):
            keep = 0
            llama_cpp.llama_memory_clear(self.mem, True)
        self.held = toks[:keep]
        self.reused_tokens += keep
        return EmbedInput(list(toks), keep)

    def advance(self, inp: EmbedInput, most: int) -> np.ndarray | None:
        """Compute the next chunk of `inp`, at most `most` tokens (at least one; an encoder's input whole); its vector
        (not normalized) once the input is done, else None."""
        n = inp.left if not self.chunked else max(1, min(most, inp.left, self.n_batch))
        pooled = self._decode(inp.tokens[inp.pos : inp.pos + n], inp.pos)
        first = inp.pos == 0
        inp.pos += n
        if self.reuses:  # (what the KV holds now: an input dropped half way leaves its head)
            self.held = inp.tokens[: inp.pos]
        if self.pooling == "mean":  # (the chunks' means weighted by their lengths: the input's mean)
            inp.total = pooled.astype(np.float64) * n if not len(inp.total) else inp.total + pooled.astype(np.float64) * n
            if not inp.left:
                inp.vector = (inp.total / (len(inp.tokens) - inp.kept)).astype(np.float32)
        elif self.pooling == "cls" and first:  # (the first token's row: the rest changes nothing)
            inp.pos = len(inp.tokens)
            self.held = []
            inp.vector = pooled
        elif not inp.left:  # last, and rank: the last row, in the last chunk
            inp.vector = pooled
        return inp.vector

    def _decode(self, toks: list[int], pos0: int) -> np.ndarray:
        """A chunk of one input (every row pooled); the pooled vector of its rows."""
        self.batch.clear()
        self.batch.add_run(toks, pos0, 0, True)
        self.batch.logits[: self.batch.n] = b"\x01" * self.batch.n  # (every row is pooled)
        self.batch.raw.n_tokens = self.batch.n
        rc = llama_cpp.llama_decode(self.ctx, self.batch.raw)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(toks)} tokens of an input for embeddings returned {rc}")
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not ptr:
            raise RuntimeError("llama.cpp gave no pooled embedding")
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.dims,)).copy()

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        self.batch.free()
