"""Tokenizing a conversation's prompt without tokenizing its whole history again every turn.

A chat prompt is the previous turn's prompt, the reply, and a few new messages, rendered with the model's turn
markers (`<start_of_turn>`, `<|im_end|>`...). llama.cpp's tokenizer first cuts a text at its special tokens and
tokenizes the pieces between them on their own (`tokenizer_st_partition` in src/llama-vocab.cpp), so the tokens of
a text are the tokens of its part up to the end of a special token, followed by the tokens of the rest tokenized
without BOS. `PromptTokenizer` keeps, for recent prompts, the tokens of their part up to their last such cut, and
tokenizes a prompt that starts with one of those parts from there on: a 3,800-token prompt takes 12 ms to
tokenize whole on this project's machine, about 0.5 ms as a next turn.

A cut after special token S gives the same tokens only if nothing reaches across it, so S must be a control token
(parsed as special in chat prompts) that strips no whitespace (no LSTRIP/RSTRIP attribute), whose text overlaps no
other special token's text (no special that starts inside S or ends inside it, none that contains it), in a
vocabulary that adds no token at the end of a text (EOS) and tokenizes with SentencePiece or BPE (where a piece
after a special token is tokenized the same with or without what came before it). Any other vocabulary, or a text
with no such cut, is tokenized whole. The cuts are learnt from the prompts themselves: the control tokens found in
a prompt tokenized whole (a template's turn markers, out of Gemma's 6,250 control tokens) become cut points once
checked.

A finished chat reply is remembered too (`remember`): the next turn's prompt holds the prompt's text and the reply's
(the template writes the reply back as the model wrote it), so that text is kept with the tokens the slot holds, the
reply's as the model wrote them. Re-tokenizing the reply's text need not give those (a grammar's literals, a model
spelling a word otherwise than the tokenizer would), and a prompt that differed from the slot there would recompute
the reply and all after it. Such a head ends where the next prompt goes on with a control token (its turn end).

The cache is per tenant (a request's `cache_salt`): how fast a prompt is tokenized tells nothing of another tenant's
prompts.

What llama_tokenize costs with special tokens parsed (`TokenizeCost`): its partition looks for each special token of
the vocabulary (Gemma: 6,414, most starting with `<`, its whitespace runs with a newline, tab or space) at each place
its first character is, and then again in every piece the text was cut into. That is linear in the text but with a
large factor: on this project's machine 80 kB of `<` take 11 s and 40 kB of "x\n" 6 s (8 MB, a frame's worth, would
take hours). A text whose estimate is over what is left of its request's deadline is refused before it is tokenized.

A prompt sent as plain text (`/v1/completions`) has no turn markers. In a SentencePiece vocabulary that adds no space
before a text (`tokenizer.ggml.add_space_prefix` false, as Gemma's), a text can also be cut just before a space
between two words: SentencePiece merges only neighbouring pieces into pieces of the vocabulary, so no piece reaches
across the cut if no piece of the vocabulary holds that space after the letter before it (Gemma's 262k pieces hold
"X▁" for one character X only, in `>▁</`). So a space is a cut when letters or digits stand on both sides of it and
neither is a character some piece (or special token) has just before a space, or a special token starts or ends with.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import llama_cpp
import numpy as np

from chat.limits import Deadline, DeadlinePassed
from common.vocab import Vocab

CUTS_TRIED = 32  # cut points looked up per prompt, from its end: a next turn finds its previous prompt in a few
SPACE = "\u2581"  # how SentencePiece writes a space inside a piece
SPACES = (SPACE.encode(), b" ")
# llama_tokenize's partition, measured here: per special token and place of its first character, and per special token
# and special token found in the text (each cuts the text into one more piece, searched again for every special token)
CANDIDATE_S = 22e-9
PIECE_S = 35e-9
WINDOW = 1 << 16  # characters scanned for special tokens at a time
SPECIAL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
STRIPS = llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP | llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP
CONTROL = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
_SPACE_AFTER = re.compile(b"|".join(re.escape(s) for s in SPACES))  # searched from a piece's second byte


def special_texts(vocab: Vocab) -> dict[int, str]:
    """The special tokens (control, user-defined, unknown) of `vocab`: token id -> its text."""
    ids = np.flatnonzero(vocab.attrs & SPECIAL)
    return {int(t): vocab.text(int(t)).decode("utf-8", "replace") for t in ids}


class TokenizeCost:
    """About how long llama_tokenize takes for a text with its special tokens parsed (the module docstring says why)."""

    def __init__(self, special_texts: Iterable[str]) -> None:
        """`special_texts`: the texts of the vocabulary's special tokens (`special_texts`)."""
        texts = [t for t in special_texts if t]
        self.n_special = len(texts)
        self.first = Counter(t[0] for t in texts)  # first character -> special tokens starting with it
        # first character -> what every special token starting with it starts with (Gemma's space runs: two spaces,
        # so the single spaces of prose count for nothing in the bound)
        self.prefix = {c: _common_start([t for t in texts if t[0] == c]) for c in self.first}
        self.longest = max(map(len, texts), default=0)
        self._texts = texts
        self._found: re.Pattern[str] | None = None  # every special token's text (a trie: linear to scan), made once needed
        self._lock = threading.Lock()

    def seconds(self, text: str, *, exact: bool = True) -> float:
        """The estimate for `text`; with `exact` False an upper bound, without finding the special tokens in it (it
        counts a piece for every character a special token starts with)."""
        at_first = CANDIDATE_S * sum(n * text.count(c) for c, n in self.first.items())
        found = self.found(text) if exact else sum(text.count(p) for p in self.prefix.values())
        return at_first + PIECE_S * self.n_special * (found + 1)

    def found(self, text: str) -> int:
        """How many special tokens' texts `text` holds, counted a window at a time (a regular expression holds the
        GIL while it scans: 8 MB at once would hold the event loop too, for most of a second)."""
        pattern, longest, n = self.pattern(), self.longest, 0
        for start in range(0, len(text), WINDOW):
            end = start + WINDOW
            n += sum(1 for m in pattern.finditer(text, start, end + longest) if m.start() < end)
        return n

    def check(self, text: str, deadline: Deadline | None) -> None:
        """Raise DeadlinePassed when tokenizing `text` would take longer than what is left of `deadline`."""
        if deadline is None or deadline.at is None or not self.n_special:
            return
        left = deadline.left()
        bound = self.seconds(text, exact=False)
        if bound <= left:
            return
        need = self.seconds(text, exact=CANDIDATE_S * sum(self.first[c] * text.count(c) for c in self.first) <= left)
        if need > left:
            raise DeadlinePassed(
                f"tokenizing `{deadline.param or 'the text'}` ({len(text)} characters) would take about {need:.1f} s here,"
                f" more than the {max(left, 0):.1f} s left of the {deadline.seconds:g} s a request's preparation may take"
                " (llama.cpp looks for each of the model's special tokens wherever its first character is, such as"
                " `<` and newlines)",
                deadline.param,
            )

    def pattern(self) -> re.Pattern[str]:
        with self._lock:
            if self._found is None:
                self._found = re.compile(_trie(self._texts))
            return self._found


def _last_match(pattern: re.Pattern[str], text: str, overlap: int) -> re.Match[str] | None:
    """The last match of `pattern` (whose matches are at most `overlap` long and never overlap one another) in `text`,
    searched WINDOW characters at a time from the end: each search holds the GIL for a window, not the whole text."""
    end = len(text)
    while end > 0:
        last = None
        for m in pattern.finditer(text, max(0, end - WINDOW - overlap), end + overlap):
            if m.start() < end:
                last = m
        if last is not None:
            return last
        end -= WINDOW
    return None


def _common_start(texts: list[str]) -> str:
    """The longest text every one of `texts` starts with."""
    low, high = min(texts), max(texts)
    n = 0
    while n < len(low) and low[n] == high[n]:
        n += 1
    return low[:n]


def _trie(words: list[str]) -> str:
    """A regular expression matching any of `words`, as a trie (a scan tries one branch per character, not every word)."""
    root: dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        ends = "" in node
        alts = [re.escape(ch) + emit(sub) for ch, sub in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 and not ends else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if ends else body

    return emit(root)


class Overlaps:
    """How many distinct special texts start with, end with and contain each piece of one: counted for the texts up to
    SHORT characters (all their pieces: Gemma's 6,414, most a few characters, take about a second), the rare longer
    ones compared one by one."""

    SHORT = 64

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = {t for t in texts if t}
        self.long = [t for t in self.texts if len(t) > self.SHORT]
        self.starts: Counter[str] = Counter()
        self.ends: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        for t in self.texts:
            n = len(t)
            if n > self.SHORT:
                continue
            self.starts.update({t[:i] for i in range(1, n + 1)})
            self.ends.update({t[i:] for i in range(n)})
            self.inside.update({t[i:j] for i in range(n) for j in range(i + 1, n + 1)})

    def alone(self, s: str) -> bool:
        """No special text but `s` itself contains it, starts with a piece `s` ends with, or ends with one it starts
        with (pieces shorter than `s`)."""
        if not s:
            return True
        counted = s in self.texts and len(s) <= self.SHORT  # (then `s` counted itself)
        if self.inside[s] - counted > 0:
            return False
        for k in range(1, len(s)):
            tail, head = s[k:], s[:k]
            if self.starts[tail] - (counted and s.startswith(tail)) > 0:
                return False
            if self.ends[head] - (counted and s.endswith(head)) > 0:
                return False
        for t in self.long:
            if t != s and (s in t or any(t.startswith(s[k:]) or t.endswith(s[:k]) for k in range(1, len(s)))):
                return False
        return True


class PromptTokenizer:
    """`tokenize(text, add_special)` as `Vocab.tokenize(text, add_special=..., parse_special=True)`, reusing the
    tokens of recent prompts' heads of the same tenant. Safe to call from several threads."""

    def __init__(self, vocab: Vocab, *, max_entries: int = 512, max_chars: int = 64 << 20) -> None:
        self.vocab = vocab
        special = special_texts(vocab)
        self.cost = TokenizeCost(special.values())
        self.max_entries, self.max_chars = max_entries, max_chars
        # LRU: (tenant, add_special, head) -> tokens
        self._entries: OrderedDict[tuple[str, bool, str], np.ndarray] = OrderedDict()
        self._chars = 0
        self._lengths: Counter[int] = Counter()  # lengths of the kept heads: a cut of another length is no lookup
        self._lock = threading.Lock()
        self.reused_tokens = 0  # tokens taken from a kept head instead of tokenized again (for tests and metrics)
        self.remembered = 0  # replies kept with their own tokens (`remember`)
        self._reply_ends: Counter[int] = Counter()  # lengths of the kept replies' texts (cuts before a control token)
        self._replies: set[tuple[str, bool, str]] = set()  # the kept entries that are replies
        self._overlaps: Overlaps | None = None  # which special texts overlap others (`_alone`), made once needed
        self._overlaps_lock = threading.Lock()
        v = vocab.pointer
        kind = llama_cpp.llama_vocab_type(v)
        usable = kind in (
            llama_cpp.LLAMA_VOCAB_TYPE_SPM,
            llama_cpp.LLAMA_VOCAB_TYPE_BPE,
        ) and not llama_cpp.llama_vocab_get_add_eos(v)
        self._text: dict[int, str] = special if usable else {}  # special token id -> its text
        attrs = vocab.attrs
        # control tokens that strip no whitespace
        candidates = [t for t, text in self._text.items() if attrs[t] & CONTROL and not attrs[t] & STRIPS and text]
        # cuts between words need every piece's text (~0.15 s for Gemma's 262k at start), so only where they can be used
        words = usable and kind == llama_cpp.LLAMA_VOCAB_TYPE_SPM and not vocab.add_space_prefix
        near_space: set[str] = set()  # characters a piece has just before a space, or a special token at an end
        for text in self._text.values():
            near_space.update(text[:1] + text[-1:])
        # where to look for characters just before a space: the special texts, and every piece with a space past its start
        spaced = list(self._text.values())
        if words:  # (most pieces have a space first at most: only those with one further on are decoded)
            get_text, space_after = llama_cpp.llama_vocab_get_text, _SPACE_AFTER.search
            pieces = [get_text(v, t) or b"" for t in range(vocab.n_vocab)]
            spaced += [p.decode("utf-8", "replace") for p in pieces if space_after(p, 1)]
        for text in spaced:
            near_space.update(text[i - 1] for i in range(1, len(text)) if text[i] in (SPACE, " ") and text[i - 1] != text[i])
        self._candidate = np.zeros(vocab.n_vocab if usable else 0, dtype=bool)  # token id -> one of those (O(1) test)
        self._candidate[candidates] = True
        # the control texts a remembered reply may end before (`_before_control`), and their lengths, longest first
        self._control_texts = {self._text[t] for t in candidates}
        self._control_lengths = sorted({len(t) for t in self._control_texts}, reverse=True)
        # every special text's proper heads: a text that ends with one may end inside a special token
        # (`_ends_before_special`, once per finished chat reply on the router's loop: a set lookup a length, where
        # comparing each of Gemma's 6,414 texts' heads took 15-18 ms)
        self._heads = {t[:k] for t in self._text.values() for k in range(1, len(t))}
        self._longest_head = max(map(len, self._heads), default=0)
        self._alone_memo: dict[str, bool] = {}  # special text -> `_alone` (read without a lock: a bool, set once)
        self._judged: dict[str, bool] = {}  # special text -> whether prompts may be cut after it
        self._cut: re.Pattern[str] | None = None
        self._safe: tuple[str, ...] = ()  # the special texts a prompt may be cut after
        # where a space between two words is a cut (its position is the match's start); None: this vocabulary has none
        self._word_cut: re.Pattern[str] | None = None
        if words:
            bad = "".join(sorted(re.escape(c) for c in near_space if c.isalnum()))
            self._word_cut = re.compile(f"(?<=[^\\W_{bad}]) (?=[^\\W_{bad}])" if bad else r"(?<=[^\W_]) (?=[^\W_])")

    def warm(self) -> None:
        """Make the index `_alone` reads now (0.2-0.3 s for Gemma's special texts on 2 cores) rather than in the first
        chat request's time (the router runs this on a thread at start)."""
        self._index()

    def _index(self) -> Overlaps:
        with self._overlaps_lock:  # (not self._lock: _learn holds that while it asks)
            if self._overlaps is None:
                self._overlaps = Overlaps(self._text.values())
            return self._overlaps

    def _alone(self, s: str) -> bool:
        """No other special token's text overlaps `s`: none contains it, starts inside it or ends inside it. Read from
        an index of every special text's pieces (made once: asking each of Gemma's 6,250 control tokens against its
        6,414 special texts one pair at a time took five minutes, a remembered reply's first cut)."""
        alone = self._alone_memo.get(s)
        if alone is None:
            alone = self._alone_memo[s] = self._index().alone(s)
        return alone

    def _learn(self, tokens: np.ndarray) -> bool:
        """Judge the control tokens in a prompt tokenized whole; new safe ones become cut points (then True)."""
        if not self._candidate.any():
            return False
        ids = tokens[(tokens >= 0) & (tokens < len(self._candidate))]
        found = np.unique(ids[self._candidate[ids]])
        texts = [self._text[int(t)] for t in found]
        with self._lock:
            new = [s for s in texts if s not in self._judged]
            for s in new:
                self._judged[s] = self._alone(s)
            if not any(self._judged[s] for s in new):
                return False
            safe = sorted((s for s, ok in self._judged.items() if ok), key=len, reverse=True)
            self._cut = re.compile("|".join(re.escape(s) for s in safe))
            self._safe = tuple(safe)
            return True

    def tokenize(self, text: str, add_special: bool, *, tenant: str = "", deadline: Deadline | None = None) -> np.ndarray:
        """The tokens of `text`, reusing a kept head of `tenant`'s prompts. Raises DeadlinePassed (before the work)
        when what is to be tokenized would take longer than what is left of `deadline`."""
        last = self._last_cut(text)
        if not last:
            tokens = self._whole(text, add_special, deadline)
            if self._learn(tokens):  # the first prompt with these turn markers: keep its head for the next
                return self.tokenize(text, add_special, tenant=tenant, deadline=deadline)
            return tokens
        kept, at = None, 0
        with self._lock:
            tried = 0
            for c in sorted((n for n in self._lengths if n <= last), reverse=True):
                if not self._is_cut(text, c):
                    continue
                kept = self._entries.get((tenant, add_special, text[:c]))
                if kept is not None:
                    self._entries.move_to_end((tenant, add_special, text[:c]))
                    self.reused_tokens += len(kept)
                    at = c
                    break
                tried += 1
                if tried == CUTS_TRIED:
                    break
        if kept is None:
            self.cost.check(text, deadline)  # (all of it is tokenized: checked once, not per part)
            head = self._whole(text[:last], add_special)
            if self._learn(head):  # turn markers seen for the first time: the head may end at the last one now
                return self.tokenize(text, add_special, tenant=tenant)
        else:
            self.cost.check(text[at:], deadline)
            head = kept if at == last else np.concatenate([kept, self._whole(text[at:last], False)])
        self._keep(tenant, add_special, text[:last], head)
        return np.concatenate([head, self._whole(text[last:], False)])

    def _last_cut(self, text: str) -> int:
        """The last place `text` may be cut (0: none): after a checked special token, or before a space between words.
        Searched a window at a time from the end (a regular expression holds the GIL for all the text it scans)."""
        last = 0
        if self._cut is not None:
            longest = max(map(len, self._safe), default=0)
            m = _last_match(self._cut, text, longest)
            last = m.end() if m is not None else 0
        if self._word_cut is not None:
            m = _last_match(self._word_cut, text, 2)
            last = max(last, m.start() if m is not None else 0)
        with self._lock:
            ends = [c for c in self._reply_ends if last < c < len(text)]
        for c in ends:  # (a remembered reply's end, where the next prompt goes on with its turn end)
            if c > last and self._before_control(text, c):
                last = c
        return last

    def _is_cut(self, text: str, c: int) -> bool:
        """Whether `text` may be cut at `c` (see `_last_cut`): also just before a checked special token (the text up to
        it is tokenized on its own, which is where a remembered reply ends)."""
        if self._safe and text.endswith(self._safe, 0, c):
            return True
        if c in self._reply_ends and self._before_control(text, c):
            return True
        return self._word_cut is not None and self._word_cut.match(text, c, c + 2) is not None and c > 0

    def remember(self, prompt: str, add_special: bool, tokens: np.ndarray, reply: np.ndarray, tenant: str = "") -> None:
        """A finished reply: the next turn's prompt holds the prompt's text and the reply's (the template writes the
        reply back as the model wrote it), so that text is kept with the tokens the slot holds, the reply's as the
        model wrote them, which re-tokenizing its text need not give (a grammar writes markers, or a model spells a
        word, otherwise than the tokenizer would): the next prompt then starts with exactly the slot's tokens. Kept
        only where a prompt may be cut (after a checked special token, or before one: the next prompt's turn end)."""
        if not self._candidate.any() or not len(reply):
            return
        text = prompt + self.vocab.detokenize([int(t) for t in reply])
        if "\ufffd" in text[len(prompt) :]:
            return  # (a reply cut inside a character)
        if not (self._safe and text.endswith(self._safe)) and not self._ends_before_special(text):
            return
        joined = np.concatenate([np.asarray(tokens, dtype=np.int32), np.asarray(reply, dtype=np.int32)])
        self._keep(tenant, add_special, text, joined, reply=True)
        self.remembered += 1

    def _before_control(self, text: str, c: int) -> bool:
        """Whether a control token that overlaps no other special token starts at text[c] (a cut just before it): the
        text there, at each control text's length, looked up (a regular expression of Gemma's 6,250 control texts took
        0.2 s to make, in the request that first needed it)."""
        for n in self._control_lengths:
            piece = text[c : c + n]
            if len(piece) == n and piece in self._control_texts and self._alone(piece):
                return True
        return False

    def _ends_before_special(self, text: str) -> bool:
        """Whether a reply's text ends where the next prompt's text continues with a checked special token: the reply
        ends with no special token of its own, and no special token's text could be cut in two there."""
        if "\ufffd" in text[-8:]:
            return False
        return not any(text[-k:] in self._heads for k in range(1, min(self._longest_head, len(text)) + 1))

    def _whole(self, text: str, add_special: bool, deadline: Deadline | None = None) -> np.ndarray:
        self.cost.check(text, deadline)
        return np.asarray(self.vocab.tokenize(text, add_special=add_special), dtype=np.int32)

    def _keep(self, tenant: str, add_special: bool, head: str, tokens: np.ndarray, reply: bool = False) -> None:
        key = (tenant, add_special, head)
        with self._lock:
            if key in self._entries:
                self._entries[key] = tokens if reply else self._entries[key]  # (a reply's own tokens win)
                self._entries.move_to_end(key)
                return
            self._entries[key] = tokens
            self._chars += len(head)
            self._lengths[len(head)] += 1
            if reply:
                self._replies.add(key)
                self._reply_ends[len(head)] += 1
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                old_key, _ = self._entries.popitem(last=False)
                old = old_key[2]
                self._chars -= len(old)
                self._lengths[len(old)] -= 1
                if not self._lengths[len(old)]:
                    del self._lengths[len(old)]
                if old_key in self._replies:
                    self._replies.discard(old_key)
                    self._reply_ends[len(old)] -= 1
                    if not self._reply_ends[len(old)]:
                        del self._reply_ends[len(old)]
