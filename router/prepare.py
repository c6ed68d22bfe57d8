"""A submit -> the prompt's tokens, the constraint on the reply, and how to read the reply (no sockets: pure work,
done on the router's preparing threads, never on its event loop).

What it may cost is bounded (chat/limits.py): a value nested deeper than MAX_NESTING is refused before any work, and
the whole preparation has a deadline (`--prepare-timeout-s`), checked between its stages, inside template rendering
and before each tokenizing and grammar compile; a request that would pass it is refused naming the field whose work
was under way."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from chat.grammar import ChatError
from chat.limits import MAX_NESTING, Deadline, DeadlinePassed, nesting
from chat.output import OutputSpec
from chat.request import ChatFormat, prompt_constraint, shift_points, shifted
from chat.template import TemplateError
from common import logs
from common.projector import Projector, ProjectorError, PromptImage
from common.vocab import Vocab
from protocol import (
    ChatMessage,
    Constraint,
    Detokenize,
    Embed,
    ImagePart,
    Submit,
    Tokenize,
    Tokens,
    fits,
    outside_vocab,
    pack_tokens,
    token_array,
    unpack_tokens,
    vocab_message,
)
from router.prompt_tokens import PromptTokenizer, TokenizeCost

log = logs.get(__name__)

PLAIN = OutputSpec()


def tenant_of(cache_salt: str | None) -> str:
    """The tenant a request's `cache_salt` names, as the mirror and workers key on it: a digest (the salt may be
    derived from an API key, so it never leaves the router or shows in a log); "" for none."""
    return "" if not cache_salt else hashlib.blake2b(cache_salt.encode(), digest_size=12).hexdigest()


class PrepareError(ValueError):
    """The submit cannot be served; `param` names the field when one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OutOfTime(PrepareError):
    """The preparation ran out of its time (--prepare-timeout-s), or would have by the estimate of its tokenizing."""


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
    images: tuple[PromptImage, ...] = ()  # its images, whose ids `tokens` holds (common/media.py)


TokenizeFn = Callable[[str, bool], np.ndarray]


def check_nesting(msg: Submit | Tokenize) -> None:
    """Raise PrepareError naming the first value of `msg` nested deeper than MAX_NESTING (linear, no recursion)."""
    values: list[tuple[str, object]] = []
    fmt = getattr(msg, "response_format", None)
    if fmt is not None and fmt.schema is not None:
        values.append(("response_format", fmt.schema))
    values += [(f"tools[{i}].function.parameters", t.parameters) for i, t in enumerate(msg.tools or ())]
    if msg.chat_template_kwargs:
        values.append(("chat_template_kwargs", msg.chat_template_kwargs))
    for param, value in values:
        depth = nesting(value)
        if depth > MAX_NESTING:
            raise PrepareError(f"`{param}` nests more than {MAX_NESTING} levels deep; at most {MAX_NESTING} are served", param)


def first_image(messages: list[ChatMessage] | None) -> str | None:
    """Where the first image part of `messages` is (`messages[0].content[1]`), or None when they carry none."""
    for i, m in enumerate(messages or ()):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, ImagePart):
                    return f"messages[{i}].content[{j}]"
    return None


def check_images(msg: Submit | Tokenize, chat: ChatFormat) -> None:
    """Raise PrepareError naming the first image of `msg` when its model has no vision projector to read it."""
    if chat.vision is None and (where := first_image(msg.messages)) is not None:
        raise PrepareError(
            f"`{where}` is an image, and this model has no vision projector to read it: start it with `--mmproj FILE` "
            "(the model's multimodal projector GGUF, as llama-server names it)",
            where,
        )


@contextlib.contextmanager
def refused_as_prepare_errors() -> Iterator[None]:
    """A template's, a chat request's or the deadline's refusal while a request is rendered and tokenized, raised as
    the PrepareError naming its field (OutOfTime for the deadline)."""
    try:
        yield
    except ChatError as exc:
        raise PrepareError(str(exc), exc.param) from None
    except TemplateError as exc:
        raise PrepareError(f"chat template error: {exc}", "messages") from None
    except DeadlinePassed as exc:
        raise OutOfTime(str(exc), exc.param) from None


def text_chars(msg: Submit | Tokenize) -> int:
    """Characters of text the router must render and tokenize for `msg` (0 for token ids)."""
    if msg.prompt is not None:
        return len(msg.prompt)
    return sum(len(m.text()) + sum(len(c.arguments) for c in m.tool_calls or ()) for m in msg.messages or ())


def prepare(
    msg: Submit,
    vocab: Vocab,
    chat: ChatFormat,
    prompts: PromptTokenizer | None = None,
    *,
    shift_to: int | None = None,
    deadline: Deadline | None = None,
) -> Prepared:
    """Raises PrepareError naming the problem (and the field). `prompts` tokenizes texts reusing the tokens of
    recent prompts' heads of the request's tenant (the router's); without it every text is tokenized whole.
    `shift_to` (--context-shift): the slot size chat messages must fit, dropping the oldest ones if they do not.
    `deadline`: how long it may take (None: no limit)."""
    deadline = deadline or Deadline(None)
    tenant = tenant_of(msg.cache_salt)  # (as Req.salt: the key a finished reply is remembered under)

    def tokenize(text: str, add_special: bool) -> np.ndarray:
        if prompts is not None:
            return prompts.tokenize(text, add_special, tenant=tenant, deadline=deadline)
        return np.asarray(vocab.tokenize(text, add_special=add_special), dtype=np.int32)

    check_nesting(msg)
    check_images(msg, chat)
    with refused_as_prepare_errors(), deadline.running("messages" if msg.messages is not None else "prompt"):
        if msg.messages is not None:
            return _chat(msg, chat, tokenize, shift_to)
        limit = prompt_constraint(msg)
        if msg.prompt is not None:
            deadline.check("prompt")
            return Prepared(tokenize(msg.prompt, True), limit, PLAIN)
    assert msg.tokens is not None
    toks = token_array(msg.tokens)
    if (bad := outside_vocab(toks, vocab.n_vocab)) is not None:
        raise PrepareError(vocab_message(bad, vocab.n_vocab), "tokens")
    return Prepared(toks, limit, PLAIN)


def _chat(msg: Submit, chat: ChatFormat, tokenize: TokenizeFn, ctx: int | None) -> Prepared:
    offered = chat.offers(msg)  # (once: a shifted attempt may have dropped the turns that decide it)
    if not offered:
        chat.not_offered()
        log.info("tools_not_offered", template=chat.name, why="the chat template has no tool-call syntax (--generic-tools)")

    def build(m: Submit) -> Prepared:
        p = chat.prepare(m, offered)
        Deadline.check_running("messages")
        if isinstance(chat.vision, Projector) and first_image(m.messages) is not None:
            return _with_images(m, chat.vision, p.text, p.add_bos, p.constraint, p.output)
        return Prepared(tokenize(p.text, p.add_bos), p.constraint, p.output, text=p.text, add_bos=p.add_bos)

    whole = build(msg)
    if ctx is None or fits(len(whole.tokens), msg.sampling.max_tokens, ctx):
        return whole
    return _shift(msg, build, ctx, dataclasses.replace(whole, shift=Shift(0, 0), text="", add_bos=False))


def _with_images(
    msg: Submit, vision: Projector, text: str, add_bos: bool, constraint: Constraint | None, output: OutputSpec
) -> Prepared:
    """A prompt with images: its text and image rows laid out by the projector (as the workers will compute them).
    Not remembered for the next turn's tokenizing (`text` empty). --context-shift drops its oldest messages as it drops
    any's, their images with them."""
    parts = [(f"messages[{i}].content[{j}]", p) for i, m in enumerate(msg.messages or ()) if isinstance(m.content, list)
             for j, p in enumerate(m.content) if isinstance(p, ImagePart)]  # fmt: skip
    try:
        tokens, images = vision.tokenize(text, add_bos, [p.data for _, p in parts])
    except ProjectorError as exc:
        where = parts[exc.index][0] if exc.index is not None else "messages"
        raise PrepareError(f"`{where}`: {exc}", where) from None
    return Prepared(tokens, constraint, output, images=tuple(images))


def _shift(msg: Submit, build: Callable[[Submit], Prepared], ctx: int, whole: Prepared) -> Prepared:
    """The history that drops the fewest messages and fits `ctx`, found by bisection over the places it may resume
    at (the prompt shortens as more is dropped); the one that drops the most when none fits (then the scheduler
    refuses it with both numbers). `build`: a request's prompt (its text's tokens, its images')."""
    assert msg.messages is not None
    messages = msg.messages
    points = shift_points(messages)

    def attempt(at: int) -> Prepared:
        kept = shifted(messages, at)
        p = build(msgspec.structs.replace(msg, messages=kept))
        shift = Shift(len(messages) - len(kept), max(0, len(whole.tokens) - len(p.tokens)))
        return dataclasses.replace(p, shift=shift, text="", add_bos=False)  # (a shortened prompt is not remembered)

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


def tokens_reply(
    msg: Tokenize | Detokenize, vocab: Vocab, chat: ChatFormat, cost: TokenizeCost | None = None, deadline: Deadline | None = None
) -> Tokens:
    """The answer to `tokenize` (a prompt, or messages rendered as a submit would be) or `detokenize`. `cost` and
    `deadline` bound the work as `prepare`'s are."""
    deadline = deadline or Deadline(None)
    if isinstance(msg, Detokenize):
        given = token_array(msg.tokens)
        if (bad := outside_vocab(given, vocab.n_vocab)) is not None:
            raise PrepareError(vocab_message(bad, vocab.n_vocab), "tokens")
        return Tokens(id=msg.id, tokens=msg.tokens, text=vocab.detokenize(given.tolist()))
    check_nesting(msg)
    check_images(msg, chat)
    with refused_as_prepare_errors(), deadline.running("messages" if msg.messages is not None else "prompt"):
        if msg.messages is not None:
            sub = Submit(messages=msg.messages, tools=msg.tools, chat_template_kwargs=msg.chat_template_kwargs)
            p = chat.prepare(sub)
            text, add_special, parse_special = p.text, p.add_bos and msg.add_special, True
        else:
            assert msg.prompt is not None
            text, add_special, parse_special = msg.prompt, msg.add_special, msg.parse_special
        if cost is not None and parse_special:
            cost.check(text, deadline)
    ids = vocab.tokenize(text, add_special=add_special, parse_special=parse_special)
    pieces = [vocab.piece(t) for t in ids] if msg.with_pieces else []
    return Tokens(id=msg.id, tokens=pack_tokens(ids), text=text, pieces=pieces)


def embed_inputs(msg: Embed, vocab: Vocab, cost: TokenizeCost, deadline: Deadline) -> list[list[int]]:
    """An embed request's inputs as tokens: token ids checked against the vocabulary, or texts tokenized as a prompt
    is (BOS by the model's rule, special-token text read as such)."""
    if msg.tokens is not None:
        inputs = [unpack_tokens(t) for t in msg.tokens]
        for i, ids in enumerate(inputs):
            if (bad := outside_vocab(ids, vocab.n_vocab)) is not None:
                raise PrepareError(f"input {i}: {vocab_message(bad, vocab.n_vocab)}", "tokens")
        return inputs
    out = []
    for i, text in enumerate(msg.input or []):
        deadline.check(f"input[{i}]")
        cost.check(text, deadline)
        out.append(vocab.tokenize(text, add_special=True, parse_special=True))
    return out


def rerank_inputs(query: str, documents: list[str], vocab: Vocab, cost: TokenizeCost, deadline: Deadline) -> list[list[int]]:
    """A reranker's (query, document) inputs made as llama-server makes them (common/vocab.py `rerank_prompt`); a query
    longer than the model's context is refused once, not once per document."""
    deadline.check("query")
    query_tokens = vocab.tokenize(query, add_special=False, parse_special=False)  # (once, not per document)
    trained = vocab.arch_meta_int("context_length")
    if trained and len(query_tokens) > trained:  # (every pair would be refused: none is built)
        raise PrepareError(f"`query` of {len(query_tokens)} tokens is longer than the model's context ({trained})", "query")
    out = []
    for i, d in enumerate(documents):
        deadline.check(f"documents[{i}]")
        if vocab.rerank_template is not None:  # (special-token text is read as such only in a template)
            cost.check(query + d, deadline)
        out.append(vocab.rerank_prompt(query, d, query_tokens=query_tokens))
    return out
