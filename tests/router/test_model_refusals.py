"""router/admission.py's refusals of a model for a kind of request (the router's shell only acts on them)."""

from __future__ import annotations

from router.admission import not_generative, not_reranker


def test_an_encoder_cannot_take_a_submit_and_the_refusal_says_what_it_serves() -> None:
    assert not_generative("gemma", causal=True, pooling=None) is None
    assert not_generative("bge", causal=False, pooling="cls") == (
        "model 'bge' cannot generate text: it is an encoder (its attention is bidirectional); it serves embeddings"
    )
    assert not_generative("bge-reranker", causal=False, pooling="rank").endswith("it serves embeddings and reranking")


def test_only_a_model_with_rank_pooling_reranks_and_the_refusal_names_its_pooling() -> None:
    assert not_reranker("bge-reranker", "rank") is None
    assert "its GGUF declares mean pooling" in (not_reranker("e5", "mean") or "")
    assert "its GGUF declares no pooling" in (not_reranker("gemma", None) or "")
