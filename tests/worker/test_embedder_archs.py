"""Embeddings on tiny random-weight models of the hybrid, recurrent and sliding-window architectures
(bench/tiny_archs.py): an input computed in chunks gives the vector of the input computed whole (llama.cpp carries a
recurrent state across decodes as it carries KV), and last pooling's kept head falls back to a whole input on a memory
that cannot be cut back partially (seq_rm says so; before, the decode after the failed cut returned -1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import llama_cpp
import numpy as np
import pytest

from bench import tiny_archs
from worker import embedder
from worker.embedder import Embedder

pytestmark = pytest.mark.model  # (llama.cpp loads a model; tiny, but not the fast tier's business)

CUTS_BACK = {"gemma3"}  # the architectures whose memory keeps a head of a sequence (attention only)


@pytest.fixture(params=tiny_archs.ARCHS)
def model(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    llama_cpp.llama_backend_init()
    path = str(tiny_archs.model(request.param)).encode()
    m = llama_cpp.llama_model_load_from_file(path, llama_cpp.llama_model_default_params())
    assert m, request.param
    yield request.param, m
    llama_cpp.llama_model_free(m)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def whole(m: Any, pooling: str, tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with monkeypatch.context() as patched:
        patched.setattr(embedder, "MAX_CHUNK", 2048)  # (the input in one ubatch)
        e = Embedder(m, pooling, 2, 4096)
    try:
        return e.embed([tokens], False)[0]
    finally:
        e.close()


def chunked(e: Embedder, tokens: list[int]) -> tuple[np.ndarray, int]:
    inp = e.begin(tokens)
    while (v := e.advance(inp, 64)) is None:
        pass
    return v, inp.kept


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_chunks_and_a_kept_head_give_the_whole_inputs_vector(
    model: tuple[str, Any], pooling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, m = model
    rng = np.random.default_rng(61)
    first = [int(t) for t in rng.integers(1, 120, 300)]
    second = first[:200] + [int(t) for t in rng.integers(1, 120, 60)]  # (shares a head with the first)
    e = Embedder(m, pooling, 2, 4096)
    try:
        v1, _ = chunked(e, first)
        v2, kept = chunked(e, second)
    finally:
        e.close()
    assert cosine(v1, whole(m, pooling, first, monkeypatch)) > 0.9999, arch
    assert cosine(v2, whole(m, pooling, second, monkeypatch)) > 0.9999, arch
    assert kept == (200 if pooling == "last" and arch in CUTS_BACK else 0), (arch, kept)
