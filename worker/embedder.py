"""Embeddings: the vectors of whole inputs, computed in a llama context of their own on the worker's model (the
slots' context and its KV are not touched), with llama.cpp's pooling over each input's tokens.

One context per pooling kind, made at the first request that asks for it: `n_ctx` cells and a batch as large, since
llama.cpp pools a sequence only when all its tokens are in one ubatch. An input longer than that is refused
(`bad_request`, naming it). Each input is decoded alone, on cleared memory: its vector is the one llama.cpp alone gives
it (tested), whatever else the request holds. Used on the compute thread only.

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


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class InputTooLong(ValueError):
    pass


class Embedder:
    """A context with pooling on `model`; `embed` gives one float32 vector per input."""

    def __init__(self, model: object, pooling: str, threads: int, n_ctx_train: int) -> None:
        self.pooling = pooling
        self.n_ctx = min(MAX_CTX, n_ctx_train) if n_ctx_train > 0 else MAX_CTX
        cp = llama_cpp.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = POOLING[pooling]
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = self.n_ctx  # (a sequence is pooled only when it is whole in one ubatch)
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
        self.ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make an embedding context of {self.n_ctx} tokens ({pooling} pooling)")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.dims = llama_cpp.llama_model_n_cls_out(model) if rank else llama_cpp.llama_model_n_embd(model)
        # one row read, attending to those before it: a shared head's KV can be kept (the module's docstring)
        self.reuses = pooling == "last" or (rank and bool(llama_cpp.llama_get_causal_attn(self.ctx)))
        self.batch = Batch(self.n_ctx)
        self.held: list[int] = []  # when it reuses: the tokens whose KV the context holds
        self.reused_tokens = 0  # input tokens whose KV was kept, not computed
        log.info("embedding_context", pooling=pooling, n_ctx=self.n_ctx, dims=self.dims)

    def embed(self, inputs: list[list[int]], normalize: bool) -> list[np.ndarray]:
        """One vector per input, in order. InputTooLong for an input over the context."""
        self.check([len(t) for t in inputs])
        out = [self._decode(toks) for toks in inputs]
        if normalize:
            out = [v / n if (n := float(np.linalg.norm(v))) > 0 else v for v in out]
        return out

    def check(self, lengths: list[int]) -> None:
        """InputTooLong naming the first input over the context."""
        for i, n in enumerate(lengths):
            if n > self.n_ctx:
                raise InputTooLong(f"input {i} has {n} tokens; an embedding holds at most {self.n_ctx}")

    def _decode(self, toks: list[int]) -> np.ndarray:
        """One input alone in a decode: packing several moved each one's vector (cosine 0.999 to its own alone, the
        batch's shape choosing other CPU kernels), and an input's vector should not depend on its neighbours. With last
        (or causal rank) pooling, the part it shares with the previous input is kept when long enough (the module's docstring)."""
        keep = 0
        if self.reuses:
            keep = min(shared_prefix(self.held, toks), len(toks) - 1)  # (its last token is computed: its row is read)
            keep = keep if keep >= MIN_REUSE else 0
        if keep:
            llama_cpp.llama_memory_seq_rm(self.mem, 0, keep, -1)
        else:
            llama_cpp.llama_memory_clear(self.mem, True)
        self.held = list(toks) if self.reuses else []
        self.reused_tokens += keep
        rest = toks[keep:]
        self.batch.clear()
        self.batch.add_run(rest, keep, 0, True)
        self.batch.logits[: self.batch.n] = b"\x01" * self.batch.n  # (every row is pooled)
        self.batch.raw.n_tokens = self.batch.n
        rc = llama_cpp.llama_decode(self.ctx, self.batch.raw)
        if rc != 0:
            raise RuntimeError(f"llama_decode of a {len(toks)}-token input for embeddings returned {rc}")
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not ptr:
            raise RuntimeError("llama.cpp gave no pooled embedding")
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.dims,)).copy()

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        self.batch.free()
