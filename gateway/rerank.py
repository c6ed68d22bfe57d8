"""`/v1/rerank` (also `/rerank`, `/reranking`, `/v1/reranking` and Cohere's `/v2/rerank`): a query and documents in,
each document's relevance score out, best first. Served by a reranker model (one whose GGUF has `rank` pooling), as
llama-server serves it; any other model is refused with a 400 naming `model`.

Two shapes, picked as llama-server picks them: a body with `texts` is Text Embeddings Inference's (a bare list of
`{index, score}`, `text` with `return_text`); else Jina's, which Cohere's clients also read (`{model, object, usage,
results: [{index, relevance_score}]}`, `document: {text}` with `return_documents`).

Fields: `query`, `documents` (texts, or objects with a `text`, as Jina and Cohere take them), `texts`, `top_n`,
`return_documents`, `return_text` and `model` are honoured. Hints: `raw_scores` (scores are the model's raw output,
as llama-server gives them whatever it says: a monotonic sigmoid would not change the order), `truncate`,
`truncation_direction` (an input over the context is refused, naming it), Cohere's `rank_fields`,
`max_chunks_per_doc`, `max_tokens_per_doc`, a document object's other fields, and `user`."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import RequestError
from gateway.fields import Policy, decode
from gateway.replies import inputs_usage
from protocol import MAX_EMBED_INPUTS, Ranked, Rerank

RERANK_PATHS = ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking", "/v2/rerank")  # llama-server's four, Cohere's


class Document(msgspec.Struct, forbid_unknown_fields=True):  # (its other fields: hints, counted)
    text: str


class RerankBody(msgspec.Struct, forbid_unknown_fields=True):
    query: str
    documents: list[str | Document] | None = None
    texts: list[str] | None = None
    top_n: int | None = None
    return_documents: bool = False
    return_text: bool = False
    model: str | None = None


def rerank_message(raw: dict[str, Any], policy: Policy) -> tuple[Rerank, RerankBody]:
    """The `rerank` of a body; RequestError naming the field that cannot be served."""
    if "query" not in raw:
        raise RequestError("`query` must be provided", param="query")
    body: RerankBody = decode(raw, RerankBody, policy)
    name, given = ("texts", body.texts) if body.texts is not None else ("documents", body.documents)
    if not given:
        raise RequestError(f"`{name}` must be a non-empty array of texts", param=name)
    if len(given) > MAX_EMBED_INPUTS:
        raise RequestError(f"at most {MAX_EMBED_INPUTS} documents, got {len(given)}", param=name)
    if body.top_n is not None and body.top_n < 0:
        raise RequestError("`top_n` must not be negative", param="top_n")
    texts = [d.text if isinstance(d, Document) else d for d in given]
    return Rerank(query=body.query, documents=texts), body


def rerank_reply(got: Ranked, msg: Rerank, body: RerankBody, model: str) -> Any:
    """Jina's shape, or TEI's for a body with `texts`: the documents by score, best first, at most `top_n`."""
    order = sorted(range(len(got.scores)), key=lambda i: -got.scores[i])[: body.top_n]
    if body.texts is not None:
        return [{"index": i, "score": got.scores[i], **({"text": msg.documents[i]} if body.return_text else {})} for i in order]
    results = [
        {
            "index": i,
            "relevance_score": got.scores[i],
            **({"document": {"text": msg.documents[i]}} if body.return_documents else {}),
        }
        for i in order
    ]
    usage = inputs_usage(got.prompt_tokens, got.cached_tokens)
    return {"model": model, "object": "list", "usage": usage, "results": results}
