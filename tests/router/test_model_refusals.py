"""router/admission.py's refusals of a model for a kind of request (the router's shell only acts on them)."""

from __future__ import annotations

from protocol import ErrorCode, Overflow, Refusal
from router.admission import not_generative, not_reranker


def test_an_encoder_cannot_take_a_submit_and_the_refusal_says_what_it_serves() -> None:
    assert not_generative("gemma", causal=True, pooling=None) is None
    text = "model 'bge' cannot generate text: it is an encoder (its attention is bidirectional); it serves embeddings"
    assert not_generative("bge", causal=False, pooling="cls") == Refusal(ErrorCode.BAD_REQUEST, text, param="model")
    refusal = not_generative("bge-reranker", causal=False, pooling="rank")
    assert refusal is not None and refusal.message.endswith("it serves embeddings and reranking")


def test_only_a_model_with_rank_pooling_reranks_and_the_refusal_names_its_pooling() -> None:
    assert not_reranker("bge-reranker", "rank") is None
    mean, none = not_reranker("e5", "mean"), not_reranker("gemma", None)
    assert mean is not None and "its GGUF declares mean pooling" in mean.message and mean.param == "model"
    assert none is not None and "its GGUF declares no pooling" in none.message


def test_a_refusal_is_the_clients_error_and_the_routers_job_error() -> None:
    numbers = Overflow(prompt_tokens=9, max_tokens=4, context=8)
    refusal = Refusal(ErrorCode.CONTEXT_OVERFLOW, "too long", param="messages", overflow=numbers)
    error = refusal.error("r1")
    assert (error.id, error.code, error.message, error.param, error.overflow) == (
        "r1",
        "context_overflow",
        "too long",
        "messages",
        numbers,
    )
    job = refusal.job_error("j1")
    assert (job.id, job.code, job.message, job.overflow) == ("j1", "context_overflow", "too long", numbers)
    assert Refusal(ErrorCode.QUEUE_FULL, "full", retry_after_ms=1000).error(None).retry_after_ms == 1000
