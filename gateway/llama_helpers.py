"""llama-server's helper endpoints that tools call: /tokenize, /detokenize, /apply-template, /slots, /props."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import RequestError
from gateway.fields import Strict, validation_problem
from protocol import Detokenize, StatusReply, Submit, Tokenize, Tokens, pack_tokens, unpack_tokens


class TokenizeBody(Strict):
    """llama-server's /tokenize body (`model` allowed, as everywhere)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None

    @classmethod
    def decode(cls, body: dict[str, Any]) -> TokenizeBody:
        try:
            return msgspec.convert(body, cls)
        except msgspec.ValidationError as exc:
            param, where, _ = validation_problem(exc)
            raise RequestError(f"invalid /tokenize body: {exc}", param=param or where or None) from None

    def message(self) -> Tokenize:
        return Tokenize(
            prompt=self.content, add_special=self.add_special, parse_special=self.parse_special, with_pieces=self.with_pieces
        )


def tokenize_reply(tokens: Tokens, with_pieces: bool) -> dict[str, Any]:
    ids = unpack_tokens(tokens.tokens)
    if not with_pieces:
        return {"tokens": ids}
    out = []
    for tok, piece in zip(ids, tokens.pieces, strict=True):
        try:
            text: Any = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = list(piece)  # as llama-server: the bytes of a piece that is part of a character
        out.append({"id": tok, "piece": text})
    return {"tokens": out}


def detokenize_message(body: dict[str, Any]) -> Detokenize:
    tokens = body.get("tokens")
    extra = set(body) - {"tokens", "model"}
    if extra:
        field = sorted(extra)[0]
        raise RequestError(f"`{field}` is not supported by /detokenize", param=field)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):
        raise RequestError("`tokens` must be a list of token ids", param="tokens")
    # packed a part at a time: a million ids at once hold the GIL (and an event loop beside) 60 ms
    return Detokenize(tokens=b"".join(pack_tokens(tokens[i : i + PACK_AT]) for i in range(0, len(tokens), PACK_AT)))


PACK_AT = 1 << 16


def render_message(sub: Submit) -> Tokenize:
    """/apply-template: the prompt a chat request renders to (its messages, tools and template kwargs)."""
    return Tokenize(messages=sub.messages, tools=sub.tools, chat_template_kwargs=sub.chat_template_kwargs)


def slots_body(status: StatusReply) -> dict[str, Any]:
    """The router's view of every worker and slot, as `kvroute status --json` prints it."""
    out: dict[str, Any] = msgspec.to_builtins(status)
    out.pop("type", None)
    out.pop("v", None)
    out.pop("id", None)
    return out


def props_body(status: StatusReply, model: str | None) -> dict[str, Any]:
    """llama-server's /props for one model (`?model=NAME`, else the default): the generation settings a request that
    sets nothing gets (`params`: the sampling defaults, `n_predict` its output cap, -1 the slot's context), its slots,
    and where each sampling default came from (`sampling_sources`: flag, models file, gguf, llama-server) and the
    GGUF's samplers kvroute does not run (`sampling_not_applied`), and how tools reach the model (`tool_format`).
    Raises RequestError for a model not served."""
    name = model or status.model
    found = [m for m in status.models if name in (m.name, *m.aliases)]
    if not found:
        if model is not None and len(status.models) > 1:
            raise RequestError(f"model {model!r} is not served (see /v1/models)", param="model")
        found = [m for m in status.models if m.name == status.model] or status.models[:1]
    if not found:
        raise RequestError("no model is served yet", param="model")
    m = found[0]
    workers = [w for w in status.workers if w.worker in m.workers]
    params: dict[str, Any] = {k: v for k, v in m.sampling.items() if k != "seed"}
    params["seed"] = m.sampling.get("seed", -1)  # (llama-server's -1: a random seed per request)
    params["n_predict"] = m.default_max_tokens or -1
    return {
        "default_generation_settings": {"n_ctx": max((w.ctx_per_slot for w in workers), default=0), "params": params},
        "total_slots": sum(len(w.slots) for w in workers),
        "model_alias": m.name,
        "model": m.name,
        "modalities": {"vision": False, "audio": False},
        "sampling_sources": m.sampling_from,
        "sampling_not_applied": m.sampling_not_applied,
        "tool_format": m.tool_format,
    }
