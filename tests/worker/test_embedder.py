"""Embeddings on a worker (worker/embedder.py): a context of their own on the worker's model, each input alone, so that
its vector is llama.cpp's own for it with the same pooling, whatever else the request holds."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import numpy as np
import pytest

from worker.embedder import MAX_CTX, Embedder, InputTooLong
from worker.engine import Engine

TEXTS = ["The sea is calm tonight.", "A lighthouse keeper writes in his log every night.", "hello"]
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


@pytest.fixture(scope="module")
def reference(fast_engine: Engine) -> Iterator[dict[str, llama_cpp.Llama]]:
    """llama.cpp alone (llama-cpp-python's high-level Llama) with each pooling, on the same file."""
    path = str(fast_engine.llama.path)
    refs = {
        p: llama_cpp.Llama(path, embedding=True, pooling_type=t, n_ctx=2048, n_threads=2, verbose=False)
        for p, t in POOLING.items()
    }
    yield refs
    for r in refs.values():
        r.close()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_vectors_are_llama_cpps_and_batched_equals_one_by_one(
    fast_engine: Engine, reference: dict[str, llama_cpp.Llama], pooling: str
) -> None:
    llama = fast_engine.llama
    tokens = [llama.vocab.tokenize(t, add_special=True, parse_special=True) for t in TEXTS]

    def run(core: object) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        e = Embedder(llama.model, pooling, 2, llama.n_ctx_train)
        try:
            return e.embed(tokens, True), [e.embed([t], True)[0] for t in tokens], e.dims
        finally:
            e.close()

    together, alone, dims = fast_engine.call(run).result(timeout=120)
    assert dims == llama_cpp.llama_model_n_embd(llama.model) and all(v.shape == (dims,) for v in together)
    for a, b in zip(together, alone, strict=True):
        assert np.array_equal(a, b)  # an input's vector does not depend on the others in its request
    for text, v in zip(TEXTS, together, strict=True):
        ref = np.asarray(reference[pooling].embed(text, normalize=True), dtype=np.float32)
        assert cosine(v, ref) >= 0.9999, (pooling, text, cosine(v, ref))
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5


def test_an_input_over_the_context_is_refused_by_name(fast_engine: Engine) -> None:
    llama = fast_engine.llama

    def run(core: object) -> str:
        e = Embedder(llama.model, "mean", 2, llama.n_ctx_train)
        try:
            e.embed([[2, 100], [5] * (min(MAX_CTX, llama.n_ctx_train) + 1)], True)
        except InputTooLong as exc:
            return str(exc)
        finally:
            e.close()
        return "accepted"

    assert "input 1 has" in fast_engine.call(run).result(timeout=60)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_last_pooling_keeps_a_shared_prefix_and_gives_the_same_vector(
    fast_engine: Engine, reference: dict[str, llama_cpp.Llama], pooling: str
) -> None:
    llama = fast_engine.llama
    doc = "The lighthouse keeper wrote in his log every night about the ships that passed. " * 8
    texts = [doc + "Who wrote the log?", doc + "What passed by at night?"]
    tokens = [llama.vocab.tokenize(t, add_special=True, parse_special=True) for t in texts]

    def run(core: object) -> tuple[list[np.ndarray], np.ndarray, int]:
        e = Embedder(llama.model, pooling, 2, llama.n_ctx_train)
        try:
            together = e.embed(tokens, True)
            reused = e.reused_tokens
            e.embed([[2, 100, 200]], True)  # something else between: the second input alone, computed whole
            return together, e.embed([tokens[1]], True)[0], reused
        finally:
            e.close()

    together, alone, reused = fast_engine.call(run).result(timeout=120)
    if pooling == "mean":
        assert reused == 0 and np.array_equal(together[1], alone)  # every row is read: nothing is kept
        return
    assert reused >= len(tokens[0]) - 8  # the document's tokens were not computed again
    # not bit for bit (worker/embedder.py says why: CPU kernels by batch size), as near as flash attention's choice
    assert cosine(together[1], alone) >= 0.995, cosine(together[1], alone)
    ref = np.asarray(reference["last"].embed(texts[1], normalize=True), dtype=np.float32)
    assert cosine(alone, ref) >= 0.9999 and cosine(together[1], ref) >= 0.995


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_an_input_computed_in_chunks_gives_the_vector_of_it_whole(
    fast_engine: Engine, monkeypatch: pytest.MonkeyPatch, pooling: str
) -> None:
    """Issue 61: an input is computed a chunk at a time beside generating slots (worker/embed_jobs.py). Its vector is
    the one of the input decoded in one ubatch: the chunks' means weighted by their lengths, the last chunk's last row,
    the first chunk's first row."""
    from worker import embedder

    llama = fast_engine.llama
    rng = np.random.default_rng(61)
    tokens = [2, *(int(t) for t in rng.integers(100, 20000, 599))]

    def run(core: object) -> tuple[np.ndarray, list[np.ndarray], list[int]]:
        monkeypatch.setattr(embedder, "MAX_CHUNK", 2048)
        whole_e = Embedder(llama.model, pooling, 2, llama.n_ctx_train)  # (the input in one ubatch)
        monkeypatch.undo()
        chunked_e = Embedder(llama.model, pooling, 2, llama.n_ctx_train)
        try:
            (whole,) = whole_e.embed([tokens], False)
            chunks, vectors = [], []
            for most in (100, 512):
                chunked_e.held = []  # (last pooling would keep the input before: computed whole each time here)
                inp = chunked_e.begin(tokens)
                n = 0
                while (v := chunked_e.advance(inp, most)) is None:
                    n += 1
                chunks.append(n + 1)
                vectors.append(v)
            return whole, vectors, chunks
        finally:
            whole_e.close()
            chunked_e.close()

    whole, vectors, chunks = fast_engine.call(run).result(timeout=300)
    expected = [1, 1] if pooling == "cls" else [6, 2]  # (cls: the first chunk alone)
    assert chunks == expected, chunks
    # (last: one row, which a batch of another shape moves as keeping a shared head's KV does: the module's docstring)
    near = 0.995 if pooling == "last" else 0.9999
    for v in vectors:
        assert cosine(v, whole) >= near, (pooling, cosine(v, whole))
        assert abs(float(np.linalg.norm(v)) / float(np.linalg.norm(whole)) - 1) < 1e-3
