"""Rerank through a real `kvroute serve` (issue 34): two tiny rerankers (bench/tiny_models.py: Qwen3-Reranker's layout,
causal, and a BERT cross-encoder's) and the default model behind one router. The scores are llama-server's for the
same files and inputs, the shapes are Jina's and TEI's as llama-server answers them, Cohere's own client reads them,
and a model that is not a reranker (or cannot generate) is refused naming `model`.

The tiny models have seeded random weights (no reranker can be downloaded here), so what they rank first is noise;
the figures below are llama-server's answers on the same GGUFs, measured with the llama-server built from the pinned
llama-cpp-python's llama.cpp (`llama-server -m F --reranking -np 1`, POST /v1/rerank with QUERY and DOCS: its default
flash attention, as kvroute's reranking context has, and each document computed alone, as kvroute computes it; with
its default 4 slots it packs documents into one decode, which moves these scores by up to 1e-5)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import Served
from test_several_models import states, wait_for

from bench.tiny_models import bert_reranker, qwen3_reranker
from common.model import default_model_path
from kvroute.client import AsyncClient, Client
from protocol import Rerank

QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "bananas are yellow.", "the river", ""]
LLAMA_SERVER = {  # name: (usage.prompt_tokens, each document's relevance_score), measured as the docstring says
    "qwen": (381, [0.018288208171725273, 0.024486463516950607, 0.02141624502837658, 0.023736566305160522]),
    "bert": (52, [2.4174089431762695, -1.831227421760559, 0.08967859297990799, 1.1366993188858032]),
}
# the cross-encoder's scores are llama-server's bit for bit on this CPU (another CPU's kernels move the last digits);
# the causal reranker's later documents are computed after a kept head, in other batches, which flash attention's
# f16 sums feel: 3e-5 here
TOLERANCE = {"qwen": 1e-4, "bert": 1e-3}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("rerank"))
    qwen, bert = qwen3_reranker(tmp / "qwen.gguf"), bert_reranker(tmp / "bert.gguf")
    s = Served(
        *("--model", f"qwen={qwen}", "--model", f"bert={bert}", "--model", f"gemma={default_model_path()}"),
        *("--slots", "1", "--ctx-per-slot", "2048", "--threads", "1"),
        log=tmp / "serve.log",
    )
    with Client(s.zmq, timeout_s=60) as c:
        wait_for(lambda: set(states(c).values()) == {"loaded"}, "all three models loaded")
    yield s
    s.stop()


def rerank(s: Served, path: str = "/v1/rerank", **body: object) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json={"query": QUERY, **body}, timeout=60)


@pytest.mark.parametrize("model", ["qwen", "bert"])
def test_scores_are_llama_servers_best_first(served: Served, model: str) -> None:
    got = rerank(served, model=model, documents=DOCS)
    assert got.status_code == 200, got.text
    body = got.json()
    tokens, scores = LLAMA_SERVER[model]
    assert body["model"] == model and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens  # the same inputs
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    for r in results:
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=TOLERANCE[model]), (model, r)
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])


def test_a_causal_rerankers_template_and_query_are_computed_once(served: Served) -> None:
    body = rerank(served, model="qwen", documents=DOCS).json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(DOCS) - 1) * 60  # each later document reused the ~75 tokens before it
    body = rerank(served, model="bert", documents=DOCS).json()
    assert "prompt_tokens_details" not in body["usage"]  # a cross-encoder attends both ways: nothing to keep


def test_shapes_top_n_and_documents_back(served: Served) -> None:
    _, scores = LLAMA_SERVER["bert"]
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[2], DOCS[3]]  # Jina and Cohere take objects with a `text`
    body = rerank(served, "/rerank", model="bert", documents=docs, top_n=2, return_documents=True).json()
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(i, DOCS[i]) for i in best[:2]]
    tei = rerank(served, "/reranking", model="bert", texts=DOCS, return_text=True, raw_scores=True).json()  # TEI's
    assert [(r["index"], r["text"]) for r in tei] == [(i, DOCS[i]) for i in best] and set(tei[0]) == {"index", "score", "text"}
    tei = rerank(served, "/v1/reranking", model="bert", texts=DOCS, top_n=1).json()
    assert [set(r) for r in tei] == [{"index", "score"}]
    assert rerank(served, model="bert", documents=DOCS, top_n=0).json()["results"] == []


def test_cohere_client_reranks(served: Served) -> None:
    import cohere

    _, scores = LLAMA_SERVER["bert"]
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    v2 = cohere.ClientV2(api_key="none", base_url=served.url).rerank(model="bert", query=QUERY, documents=DOCS, top_n=3)
    assert [r.index for r in v2.results] == best[:3]  # (POST /v2/rerank)
    v1 = cohere.Client(api_key="none", base_url=served.url).rerank(
        model="bert", query=QUERY, documents=DOCS, return_documents=True
    )
    assert [r.index for r in v1.results] == best  # (POST /v1/rerank)
    assert all(r.document is not None and r.document.text == DOCS[r.index] for r in v1.results)


def test_over_zmq(served: Served) -> None:
    async def ask() -> tuple[list[float], int]:
        client = AsyncClient(served.zmq)
        try:
            got = await client.rerank(Rerank(query=QUERY, documents=DOCS, model="bert"))
            return got.scores, got.prompt_tokens
        finally:
            await client.close()

    scores, tokens = asyncio.run(ask())
    assert tokens == LLAMA_SERVER["bert"][0]
    assert scores == pytest.approx(LLAMA_SERVER["bert"][1], abs=TOLERANCE["bert"])


def test_bad_requests_name_the_field_and_others_are_served(served: Served) -> None:
    got = rerank(served, model="gemma", documents=DOCS)
    assert got.status_code == 400 and got.json()["error"]["param"] == "model", got.text
    assert "not a reranker" in got.json()["error"]["message"]
    chat = {"model": "bert", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    got = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "model", got.text
    assert "cannot generate" in got.json()["error"]["message"]
    for body, param in (({"documents": []}, "documents"), ({"texts": "x"}, "texts"), ({"top_n": -2, "documents": DOCS}, "top_n")):
        got = rerank(served, model="bert", **body)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    got = httpx.post(f"{served.url}/v1/rerank", json={"documents": DOCS, "model": "bert"}, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "query"
    long = "word " * 3000  # over the cross-encoder's 512-token context
    got = rerank(served, model="bert", documents=["short", long])
    assert got.status_code == 400 and got.json()["error"]["param"] == "documents" and "512" in got.text, got.text
    chat["model"] = "gemma"  # the others are served on
    assert httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    assert rerank(served, model="bert", documents=DOCS).status_code == 200


def test_a_rerank_for_a_model_not_loaded_loads_it_and_waits(tmp_path: Path) -> None:
    qwen, bert = qwen3_reranker(tmp_path / "qwen.gguf"), bert_reranker(tmp_path / "bert.gguf")
    flags = ("--model", f"qwen={qwen}", "--model", f"bert={bert}", "--models-max", "1", "--slots", "1", "--threads", "1")
    s = Served(*flags, log=tmp_path / "serve.log")
    try:
        with Client(s.zmq, timeout_s=60) as c:
            wait_for(lambda: states(c) == {"qwen": "loaded", "bert": "unloaded"}, "qwen loaded alone")
            got = rerank(s, model="bert", documents=DOCS)  # (before: no_workers at once)
            assert got.status_code == 200, got.text
            best = got.json()["results"][0]["relevance_score"]
            assert best == pytest.approx(max(LLAMA_SERVER["bert"][1]), abs=TOLERANCE["bert"])
            got = httpx.post(f"{s.url}/v1/embeddings", json={"model": "qwen", "input": "hello"}, timeout=60)
            assert got.status_code == 200 and states(c) == {"qwen": "loaded", "bert": "unloaded"}, got.text
    finally:
        s.stop()


REAL = os.environ.get("KVROUTE_TEST_RERANKER", "")  # a real reranker GGUF (bge-reranker-v2-m3, Qwen3-Reranker, ...)
ML_DOCUMENTS = [  # llama.cpp's own rerank test (tools/server/tests/unit/test_rerank.py): its known easy case
    "A machine is a physical system that uses power to apply forces and control movement to perform an action. The term "
    "is commonly applied to artificial devices, such as those employing engines or motors, but also to natural "
    "biological macromolecules, such as molecular machines.",
    "Learning is the process of acquiring new understanding, knowledge, behaviors, skills, values, attitudes, and "
    "preferences. The ability to learn is possessed by humans, non-human animals, and some machines; there is also "
    "evidence for some kind of learning in certain plants.",
    "Machine learning is a field of study in artificial intelligence concerned with the development and study of "
    "statistical algorithms that can learn from data and generalize to unseen data, and thus perform tasks without "
    "explicit instructions.",
    "Paris, capitale de la France, est une grande ville européenne et un centre mondial de l'art, de la mode, de la "
    "gastronomie et de la culture. Son paysage urbain du XIXe siècle est traversé par de larges boulevards et la Seine.",
]


@pytest.mark.skipif(not REAL, reason="needs KVROUTE_TEST_RERANKER=FILE.gguf: no reranker can be downloaded here")
def test_a_real_reranker_orders_an_easy_case(tmp_path: Path) -> None:
    s = Served("--model", f"reranker={REAL}", "--slots", "1", "--threads", "2", log=tmp_path / "serve.log")
    try:
        body = httpx.post(f"{s.url}/v1/rerank", json={"query": "Machine learning is", "documents": ML_DOCUMENTS}, timeout=300)
        order = [r["index"] for r in body.json()["results"]]
        assert order[0] == 2 and order[-1] == 3, body.text
    finally:
        s.stop()
