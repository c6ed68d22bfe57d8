"""A submit -> the prompt's tokens, the constraint on the reply, and how to read the reply (no sockets: pure work
that may run on the tokenizing thread)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chat.grammar import ChatError
from chat.output import OutputSpec
from chat.request import ChatFormat, prompt_constraint
from chat.template import TemplateError
from kvroute.vocab import Vocab
from protocol import Constraint, Detokenize, Submit, Tokenize, Tokens, pack_tokens
from router.prompt_tokens import PromptTokenizer

PLAIN = OutputSpec()


class PrepareError(ValueError):
    """The submit cannot be served; `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Prepared:
    tokens: np.ndarray
    constraint: Constraint | None
    output: OutputSpec


def text_chars(msg: Submit | Tokenize) -> int:
    """Characters of text the router must render and tokenize for `msg` (0 for token ids)."""
    if msg.prompt is not None:
        return len(msg.prompt)
    return sum(len(m.text()) + sum(len(c.arguments) for c in m.tool_calls or ()) for m in msg.messages or ())


def prepare(msg: Submit, vocab: Vocab, chat: ChatFormat, prompts: PromptTokenizer | None = None) -> Prepared:
    """Raises PrepareError naming the problem (and the field). `prompts` tokenizes texts reusing the tokens of
    recent prompts' heads (the router's); without it every text is tokenized whole."""

    def tokenize(text: str, add_special: bool) -> np.ndarray:
        if prompts is not None:
            return prompts.tokenize(text, add_special)
        return np.asarray(vocab.tokenize(text, add_special=add_special), dtype=np.int32)

    try:
        if msg.messages is not None:
            p = chat.prepare(msg)
            return Prepared(tokenize(p.text, p.add_bos), p.constraint, p.output)
        limit = prompt_constraint(msg)
    except ChatError as exc:
        raise PrepareError(str(exc), exc.param) from None
    except TemplateError as exc:
        raise PrepareError(f"chat template error: {exc}", "messages") from None
    if msg.prompt is not None:
        return Prepared(tokenize(msg.prompt, True), limit, PLAIN)
    assert msg.tokens is not None
    toks = np.frombuffer(msg.tokens, dtype="<i4").astype(np.int32)
    if len(toks) and (toks.min() < 0 or toks.max() >= vocab.n_vocab):
        bad = int(toks[(toks < 0) | (toks >= vocab.n_vocab)][0])
        raise PrepareError(f"token id {bad} is outside the vocabulary (0..{vocab.n_vocab - 1})", "tokens")
    return Prepared(toks, limit, PLAIN)


def tokens_reply(msg: Tokenize | Detokenize, vocab: Vocab, chat: ChatFormat) -> Tokens:
    """The answer to `tokenize` (a prompt, or messages rendered as a submit would be) or `detokenize`."""
    if isinstance(msg, Detokenize):
        ids = np.frombuffer(msg.tokens, dtype="<i4").tolist()
        bad = next((t for t in ids if not 0 <= t < vocab.n_vocab), None)
        if bad is not None:
            raise PrepareError(f"token id {bad} is outside the vocabulary (0..{vocab.n_vocab - 1})", "tokens")
        text = vocab.detokenize(ids)
    elif msg.messages is not None:
        sub = Submit(messages=msg.messages, tools=msg.tools, chat_template_kwargs=msg.chat_template_kwargs)
        try:
            p = chat.prepare(sub)
        except ChatError as exc:
            raise PrepareError(str(exc), exc.param) from None
        except TemplateError as exc:
            raise PrepareError(f"chat template error: {exc}", "messages") from None
        text = p.text
        ids = vocab.tokenize(text, add_special=p.add_bos and msg.add_special)
    else:
        assert msg.prompt is not None
        text = msg.prompt
        ids = vocab.tokenize(text, add_special=msg.add_special, parse_special=msg.parse_special)
    pieces = [vocab.piece(t) for t in ids] if isinstance(msg, Tokenize) and msg.with_pieces else []
    return Tokens(id=msg.id, tokens=pack_tokens(ids), text=text, pieces=pieces)
