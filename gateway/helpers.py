"""llama-server's helper endpoints that tools call: /tokenize, /detokenize, /apply-template, /slots."""

from __future__ import annotations

from typing import Any

import msgspec

from common.config import keep_alive_seconds
from gateway.openai_chat import RequestError, Strict, validation_problem
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


def keep_alive_s(value: Any) -> float | None:
    """Ollama's `keep_alive` (honoured in every generating API): how long the model stays loaded after this request,
    as seconds or a duration ("5m", "1h30m", "300ms"); 0 unloads it once idle, a negative value keeps it. None: not
    given."""
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise RequestError(f"`keep_alive`: {exc}", param="keep_alive") from None
