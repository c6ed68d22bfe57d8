"""`/v1/embeddings` (OpenAI's shape; llama-server serves the same at `/embeddings` too): texts or token ids in, one
vector per input out, as floats or base64 of float32. Computed by a worker in a context of its own with the pooling
this HTTP API was started with (`--pooling`; by default the model's own, else mean; worker/embedder.py).

Fields: `input`, `encoding_format` and `model` (which served model, with several) are honoured; `user` is a hint;
`dimensions` is refused unless it is the model's own (this model has no shortened vectors), which is only known once
computed, so such a request is answered 400 after the work."""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np

from gateway.errors import RequestError
from gateway.fields import Policy, decode
from gateway.replies import inputs_usage
from protocol import MAX_EMBED_INPUTS, Embed, Embeddings, pack_tokens


class EmbeddingsBody(msgspec.Struct, forbid_unknown_fields=True):
    input: str | list[Any]  # a text, texts, token ids, or lists of token ids (checked below)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def embed_message(raw: dict[str, Any], policy: Policy, pooling: str) -> tuple[Embed, EmbeddingsBody]:
    """The `embed` of a body; RequestError naming the field that cannot be served."""
    body: EmbeddingsBody = decode(raw, EmbeddingsBody, policy)
    given: list[Any] = [body.input] if isinstance(body.input, str) else body.input
    if not given:
        raise RequestError("`input` must not be empty", param="input")
    if len(given) > MAX_EMBED_INPUTS:
        raise RequestError(f"at most {MAX_EMBED_INPUTS} inputs, got {len(given)}", param="input")
    if body.dimensions is not None and body.dimensions < 1:
        raise RequestError("`dimensions` must be at least 1", param="dimensions")
    if is_ids(given):  # one input as token ids
        given = [given]
    pool = None if pooling == "auto" else pooling  # (auto: the router picks the model's own)
    try:
        if all(isinstance(t, str) for t in given):
            if any(not t for t in given):
                raise RequestError("an input text must not be empty", param="input")
            return Embed(input=given, pooling=pool), body  # type: ignore[arg-type]
        if all(is_ids(t) and t for t in given):
            return Embed(tokens=[pack_tokens(t) for t in given], pooling=pool), body  # type: ignore[arg-type]
    except ValueError as exc:
        raise RequestError(str(exc), param="input") from None
    raise RequestError(
        "`input` must be a text, a list of texts, a list of token ids or a list of such lists (none empty)", param="input"
    )


def embeddings_reply(got: Embeddings, body: EmbeddingsBody, model: str) -> dict[str, Any]:
    if body.dimensions is not None and body.dimensions != got.dims:
        raise RequestError(
            f"`dimensions` {body.dimensions} is not supported: this model's vectors have {got.dims} dimensions",
            param="dimensions",
        )
    data = []
    for i, raw in enumerate(got.vectors):
        if body.encoding_format == "base64":
            vector: Any = base64.b64encode(raw).decode("ascii")
        else:
            vector = np.frombuffer(raw, dtype="<f4").tolist()
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {"object": "list", "data": data, "model": model, "usage": inputs_usage(got.prompt_tokens, got.cached_tokens)}
