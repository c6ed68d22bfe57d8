"""A submit -> the prompt's tokens, the constraint on the reply, and how to read the reply (no sockets: pure work
that may run on the tokenizing thread)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from chat.grammar import ChatError
from chat.output import OutputSpec
from chat.request import ChatFormat, prompt_constraint, shift_points, shifted
from chat.template import TemplateError
from kvroute.vocab import Vocab
from protocol import Constraint, Detokenize, Submit, Tokenize, Tokens, pack_tokens
from router.prompt_tokens import PromptTokenizer
from router.tokens import tokens_from_wire, tokens_to_list

PLAIN = OutputSpec()


class PrepareError(ValueError):
    """The submit cannot be served; `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Shift:
    """What --context-shift dropped from a chat request that did not fit (0 messages: nothing could be dropped)."""

    messages: int
    tokens: int  # prompt tokens before minus after


@dataclass(frozen=True)
class Prepared:
    tokens: np.ndarray
    constraint: Constraint | None
    output: OutputSpec
    shift: Shift | None = None  # set when --context-shift had to shorten the messages
    text: str = ""  # a chat prompt's rendered text (its reply is remembered with it: router/prompt_tokens.py)
    add_bos: bool = False


TokenizeFn = Callable[[str, bool], np.ndarray]


def fits(n_prompt: int, max_tokens: int | None, ctx: int) -> bool:
    """Whether a prompt and its max_tokens fit a slot of `ctx` tokens (without max_tokens, one token at least)."""
    return n_prompt < ctx and n_prompt + (max_tokens or 0) <= ctx


def text_chars(msg: Submit | Tokenize) -> int:
    """Characters of text the router must render and tokenize for `msg` (0 for token ids)."""
    if msg.prompt is not None:
        return len(msg.prompt)
    return sum(len(m.text()) + sum(len(c.arguments) for c in m.tool_calls or ()) for m in msg.messages or ())


def prepare(
    msg: Submit, vocab: Vocab, chat: ChatFormat, prompts: PromptTokenizer | None = None, *, shift_to: int | None = None
) -> Prepared:
    """Raises PrepareError naming the problem (and the field). `prompts` tokenizes texts reusing the tokens of
    recent prompts' heads (the router's); without it every text is tokenized whole. `shift_to` (--context-shift):
    the slot size chat messages must fit, dropping the oldest ones if they do not."""

    def tokenize(text: str, add_special: bool) -> np.ndarray:
        if prompts is not None:
            return prompts.tokenize(text, add_special)
        return np.asarray(vocab.tokenize(text, add_special=add_special), dtype=np.int32)

    try:
        if msg.messages is not None:
            return _chat(msg, chat, tokenize, shift_to)
        limit = prompt_constraint(msg)
    except ChatError as exc:
        raise PrepareError(str(exc), exc.param) from None
    except TemplateError as exc:
        raise PrepareError(f"chat template error: {exc}", "messages") from None
    if msg.prompt is not None:
        return Prepared(tokenize(msg.prompt, True), limit, PLAIN)
    assert msg.tokens is not None
    toks = tokens_from_wire(msg.tokens)
    if len(toks) and (toks.min() < 0 or toks.max() >= vocab.n_vocab):
        bad = int(toks[(toks < 0) | (toks >= vocab.n_vocab)][0])
        raise PrepareError(f"token id {bad} is outside the vocabulary (0..{vocab.n_vocab - 1})", "tokens")
    return Prepared(toks, limit, PLAIN)


def _chat(msg: Submit, chat: ChatFormat, tokenize: TokenizeFn, ctx: int | None) -> Prepared:
    p = chat.prepare(msg)
    tokens = tokenize(p.text, p.add_bos)
    if ctx is None or fits(len(tokens), msg.sampling.max_tokens, ctx):
        return Prepared(tokens, p.constraint, p.output, text=p.text, add_bos=p.add_bos)
    return _shift(msg, chat, tokenize, ctx, Prepared(tokens, p.constraint, p.output, Shift(0, 0)))


def _shift(msg: Submit, chat: ChatFormat, tokenize: TokenizeFn, ctx: int, whole: Prepared) -> Prepared:
    """The history that drops the fewest messages and fits `ctx`, found by bisection over the places it may resume
    at (the prompt shortens as more is dropped); the one that drops the most when none fits (then the scheduler
    refuses it with both numbers)."""
    assert msg.messages is not None
    messages = msg.messages
    points = shift_points(messages)

    def attempt(at: int) -> Prepared:
        kept = shifted(messages, at)
        p = chat.prepare(msgspec.structs.replace(msg, messages=kept))
        tokens = tokenize(p.text, p.add_bos)
        shift = Shift(len(messages) - len(kept), max(0, len(whole.tokens) - len(tokens)))
        return Prepared(tokens, p.constraint, p.output, shift)

    def fit(p: Prepared) -> bool:
        return fits(len(p.tokens), msg.sampling.max_tokens, ctx)

    if not points:
        return whole
    lo, hi = 0, len(points) - 1
    best = attempt(points[hi])
    if not fit(best):
        return best
    while lo < hi:  # invariant: points[hi] fits (best is its prompt), points[:lo] do not
        mid = (lo + hi) // 2
        tried = attempt(points[mid])
        if fit(tried):
            hi, best = mid, tried
        else:
            lo = mid + 1
    return best


def tokens_reply(msg: Tokenize | Detokenize, vocab: Vocab, chat: ChatFormat) -> Tokens:
    """The answer to `tokenize` (a prompt, or messages rendered as a submit would be) or `detokenize`."""
    if isinstance(msg, Detokenize):
        ids = tokens_to_list(msg.tokens)
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
