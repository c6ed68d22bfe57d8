"""A reranker's scores on a worker (worker/embedder.py, `rank` pooling) and its inputs (common/vocab.py
`rerank_prompt`), on the tiny reranker GGUFs of bench/tiny_models.py (seeded random weights: no reranker can be
downloaded here; the front-door test compares the served scores with llama-server's). No default model needed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from bench.tiny_models import bert_reranker, qwen3_reranker
from common.vocab import Vocab, init_backend
from worker.embedder import MIN_REUSE, Embedder

QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "bananas are yellow.", "the river", ""]


class Loaded:
    def __init__(self, path: Path) -> None:
        init_backend()
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.vocab = Vocab.from_model(self.model, path)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)

    def scores(self, inputs: list[list[int]], embedder: Embedder | None = None) -> tuple[list[np.ndarray], int]:
        """Each input's rank output, by one embedder (kept prefixes and all), and the tokens it reused."""
        e = embedder or Embedder(self.model, "rank", 2, self.n_ctx_train)
        try:
            return e.embed(inputs, False), e.reused_tokens
        finally:
            if embedder is None:
                e.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Loaded]]:
    tmp = tmp_path_factory.mktemp("rerankers")
    loaded = {"qwen3": Loaded(qwen3_reranker(tmp / "q.gguf")), "bert": Loaded(bert_reranker(tmp / "b.gguf"))}
    yield loaded
    for m in loaded.values():
        llama_cpp.llama_model_free(m.model)


def test_inputs_are_made_as_llama_server_makes_them(models: dict[str, Loaded]) -> None:
    bert = models["bert"].vocab  # no template: [CLS] query [SEP] document (the vocabulary adds BOS and SEP, no EOS)
    assert bert.pooling == "rank" and not bert.causal and bert.rerank_template is None
    q = bert.tokenize(QUERY, add_special=False, parse_special=False)
    d = bert.tokenize(DOCS[0], add_special=False, parse_special=False)
    assert bert.rerank_prompt(QUERY, DOCS[0]) == [bert.bos, *q, bert.sep, *d]
    assert bert.rerank_prompt("[SEP]", "x")[1:-2] == bert.tokenize("[SEP]", add_special=False, parse_special=False)

    qwen = models["qwen3"].vocab  # the GGUF's `rerank` template, its special-token text read as such
    assert qwen.pooling == "rank" and qwen.causal and qwen.rerank_template is not None
    got = qwen.rerank_prompt("a {document} b", "DOC")
    start = qwen.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(start) == 1 and got[0] == start[0]
    assert "<Query>: a {document} b\n<Document>: DOC<|im_end|>" in qwen.detokenize(got)  # filled in one pass


def test_a_cross_encoders_score_is_its_head_on_the_whole_pair_alone(models: dict[str, Loaded]) -> None:
    m = models["bert"]
    inputs = [m.vocab.rerank_prompt(QUERY, d) for d in DOCS]
    together, reused = m.scores(inputs)
    assert reused == 0  # bidirectional: every row depends on every token, nothing is kept
    assert all(v.shape == (1,) for v in together)
    for inp, v in zip(inputs, together, strict=True):
        (alone,), _ = m.scores([inp])
        assert np.array_equal(v, alone)  # a document's score does not depend on the others


def test_a_causal_rerankers_shared_head_is_computed_once(models: dict[str, Loaded]) -> None:
    m = models["qwen3"]
    inputs = [m.vocab.rerank_prompt(QUERY, d) for d in DOCS]
    head = next(i for i in range(len(inputs[0])) if inputs[0][i] != inputs[1][i])
    assert head > MIN_REUSE  # the template and the query
    together, reused = m.scores(inputs)
    assert reused >= (len(DOCS) - 1) * (head - 8)  # each later document computed its own part only
    for inp, v in zip(inputs, together, strict=True):
        assert v.shape == (2,) and abs(float(v.sum()) - 1.0) < 1e-5  # P(yes), P(no): a softmax
        (alone,), _ = m.scores([inp])
        # not bit for bit (worker/embedder.py: CPU kernels by batch size), near: a score moves in its last digits
        assert abs(float(v[0]) - float(alone[0])) < 1e-4, (v, alone)
