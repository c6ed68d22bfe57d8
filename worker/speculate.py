"""Prompt-lookup speculation: guess a job's next tokens from its own history, without a draft model.

Agents re-emit text they were just shown (an edited file, quoted tool output). When the last `n` tokens of a
conversation occurred earlier in it, the tokens that followed that occurrence are a cheap guess of what comes
next. The engine verifies a guess in the same `llama_decode` as the other slots' rows: every guessed token gets
a logits row, the job's own sampler picks a token from each row in turn, and the guess is kept up to the first
token the sampler did not pick (the KV of the rest is removed with `llama_memory_seq_rm`). The sampler sees the
rows it would have seen one token at a time, in the same order and with the same draws, so the output is what it
would have been without speculation, up to the numbers: llama.cpp computes rows verified together with other kernels
than one row alone. Bit for bit the same only in deterministic mode (where guesses take its padding rows); without it,
a job with a seed takes no guesses, so that its tokens do not depend on what was guessed (worker/core.py).

A guess costs a logits row per token (on CPU about as much as a decode row: the output layer dominates), so the
length adapts: it starts at START tokens, doubles while guesses are taken whole and falls back to what was
taken when one is cut short. And a job guesses only while its guesses pay in the step at hand (`StepCost`): a
step of D decode rows that takes T(R) for its R rows gains from a guess of g rows taken at rate r only if
(D + r g) / T(R + g) > D / T(R). On a CPU a guessed row costs about a decode row, so with one slot generating a
guess pays when a third of it is taken, with eight only when most of it is. Each job keeps the share of its guesses
taken (`Drafter.rate`); while its guesses would not pay, they are checked against what it then produces instead of
computed (`shadow`), so the share stays current at no cost.

What other jobs of the same tenant generated lately is a second source (`OutputPool`): where the conversation itself
has no earlier occurrence of the last `n` tokens, a guess follows the latest recent output that has them. An agent
asked for a file again, a retried request, or sub-agents writing the same boilerplate then guess well from the first
token on (llama-server's `--spec-type ngram-mod` keeps such a table across requests too).
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

START = 4  # tokens in a job's first guess
RATE_WEIGHT = 0.25  # of the latest guess in a job's share of guessed tokens taken
START_RATE = 0.5  # a job's share before its first guess: enough for one slot on a CPU, not for a busy batch
PROBE_EVERY = 32  # while a job's guesses are withheld, one in this many is computed all the same (so the cost of a
# step with guesses is measured again: a slow moment of the machine does not keep guessing off for good)
RESYNC = 64  # tokens after the place the output left where a guess looks for it first
RESYNC_BACK = 8  # ... and before it
POOL_TOKENS = 1 << 16  # generated tokens a worker keeps from finished jobs, for guesses in later ones

# what a job's drafter asks the pool: the latest recent output with these n tokens, and where the token after them is
PoolLookup = Callable[[np.ndarray], tuple[np.ndarray, int] | None]


class Drafter:
    """One job's guesser over everything its conversation holds (prompt, then each generated token).

    It follows one place in the history while the output keeps copying it (`_src`: the position of the token it
    expects next), so a line that occurs twice in a file does not send the guess to the wrong copy. When the output
    leaves that place (an edit, or the same text cut into other tokens), it looks for the last `n` tokens again:
    the first occurrence near where it was (RESYNC tokens on), else the latest one, else (`pool`) the latest recent
    output of another job that has them, which it then follows the same way."""

    def __init__(self, history: list[int], capacity: int, n: int, k_max: int, pool: PoolLookup | None = None) -> None:
        self.n = n
        self._pool = pool
        self.k_max = k_max
        self.k = min(START, k_max)
        self._buf = np.zeros(max(capacity, len(history)) + 1, dtype=np.int32)
        self._len = len(history)
        self._buf[: self._len] = history
        self._src = -1  # where the token expected next is in the history (-1: following nothing)
        self._other: np.ndarray | None = None  # the recent output `_src` is in, when not the history (see OutputPool)
        self._lost = -1  # where the output last left the place it followed
        self.rate = START_RATE  # share of guessed tokens taken, recent guesses weighing most
        self._shadow: list[int] = []  # a guess not computed, checked against the tokens that come
        self._shadow_taken = 0
        self.withheld = 0  # guesses withheld in a row

    def push(self, token: int) -> None:
        """A token the job produced (every one, drafted or not)."""
        if self._len == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
        self._buf[self._len] = token
        if self._shadow:
            agrees = token == self._shadow[self._shadow_taken]
            self._shadow_taken += agrees
            if not agrees or self._shadow_taken == len(self._shadow):
                self.verified(len(self._shadow), self._shadow_taken)
                self._shadow, self._shadow_taken = [], 0
        src = self._src
        if src >= 0:
            copied, end = self._copied()
            if src < end and copied[src] == token:
                self._src = src + 1
            else:
                if self._other is None:  # (where it left a recent output says nothing about the history)
                    self._lost = src
                self._src, self._other = -1, None
        self._len += 1

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that follow the place the output copies (see the class), to compute."""
        self._shadow, self._shadow_taken = [], 0  # (a guess not computed is not also checked)
        self.withheld = 0
        return self._guess(limit)

    def shadow(self, limit: int) -> bool:
        """Guess without computing: the tokens that come are checked against the guess as verification would, so
        `rate` and the guess length follow what guessing would take. False when this guess should be computed after
        all (one in PROBE_EVERY)."""
        self.withheld += 1
        if self.withheld % PROBE_EVERY == 0:
            return False
        if not self._shadow:
            self._shadow, self._shadow_taken = self._guess(limit), 0
        return True

    def _guess(self, limit: int) -> list[int]:
        """The guess itself: up to min(k, limit) tokens from the place followed, found again when lost."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        if self._src < 0 or self._src >= self._copied()[1]:
            self._src, self._other = self._find(), None
            if self._src < 0:
                found = self._pool(self._buf[self._len - self.n : self._len]) if self._pool and self._len >= self.n else None
                if found is None:
                    return []
                self._other, self._src = found
        copied, end = self._copied()
        return copied[self._src : min(self._src + k, end)].tolist()

    def _copied(self) -> tuple[np.ndarray, int]:
        """What `_src` points into, and its end: the history, or a recent output of the pool."""
        return (self._buf, self._len) if self._other is None else (self._other, len(self._other))

    def _find(self) -> int:
        """Where the token after an earlier occurrence of the output's last `n` tokens is (-1: none): the first one
        near where the output left the place it followed, else the latest."""
        at = _occurrences(self._buf[: self._len], self.n)
        if not at.size:
            return -1
        lost, self._lost = self._lost, -1
        if lost >= 0:
            near = at[(at + 1 >= lost - RESYNC_BACK) & (at + 1 <= lost + RESYNC)]
            if near.size:
                return int(near[0]) + 1
        return int(at[-1]) + 1

    def verified(self, proposed: int, accepted: int) -> None:
        """How the last guess went: a guess taken whole grows the next one, a guess cut short shrinks it."""
        self.k = min(self.k * 2, self.k_max) if accepted == proposed else max(1, min(accepted, self.k_max))
        if proposed:
            self.rate += RATE_WEIGHT * (accepted / proposed - self.rate)


class OutputPool:
    """What finished jobs generated lately, for guesses in later jobs (see the module docstring). Kept per tenant
    (the jobs' cache salt): a guess never changes what a job produces, but it changes how fast, and speed can be
    measured, so one tenant's outputs never guess for another's. Each n-gram maps to its latest occurrence; the
    oldest outputs are dropped beyond `capacity` tokens. Used on the engine's compute thread only."""

    def __init__(self, n: int, capacity: int = POOL_TOKENS) -> None:
        self.n, self.capacity = n, capacity
        self._outputs: OrderedDict[int, tuple[str, np.ndarray]] = OrderedDict()  # id -> (salt, tokens), oldest first
        self._latest: dict[tuple[str, bytes], tuple[int, int]] = {}  # (salt, n-gram) -> (output id, position after)
        self._next = 0
        self.tokens = 0

    def add(self, salt: str, tokens: list[int]) -> None:
        if not self.n < len(tokens) <= self.capacity:
            return
        out = np.asarray(tokens, dtype=np.int32)
        oid, self._next = self._next, self._next + 1
        self._outputs[oid] = (salt, out)
        self.tokens += len(out)
        for key, after in self._ngrams(salt, out):
            self._latest[key] = (oid, after)
        while self.tokens > self.capacity:
            old, (old_salt, old_out) = self._outputs.popitem(last=False)
            self.tokens -= len(old_out)
            for key, _ in self._ngrams(old_salt, old_out):
                if self._latest.get(key, (-1, 0))[0] == old:
                    del self._latest[key]

    def lookup(self, salt: str) -> PoolLookup:
        """The pool as one tenant's drafter sees it."""

        def find(tail: np.ndarray) -> tuple[np.ndarray, int] | None:
            hit = self._latest.get((salt, tail.astype(np.int32).tobytes()))
            return None if hit is None else (self._outputs[hit[0]][1], hit[1])

        return find

    def _ngrams(self, salt: str, out: np.ndarray) -> list[tuple[tuple[str, bytes], int]]:
        """Each n-gram followed by a token, with that token's position."""
        raw = out.tobytes()
        return [((salt, raw[4 * (end - self.n) : 4 * end]), end) for end in range(self.n, len(out))]


class StepCost:
    """What a step costs by its row count, from steps that only decode and verify guesses (every row with logits), and
    whether a guess pays in the step at hand. Not a line: on a CPU the first rows of a step share one pass over the
    weights, later ones each cost about as much as a decode row. Steps are timed on a shared machine, where other
    work only ever adds time, so each row count keeps the lowest time seen lately (it sinks to a faster step at once
    and rises slowly). More rows never cost less, so a noisy floor below a smaller row count's is lifted to it; between
    row counts the cost is interpolated, beyond the largest extended at the steeper of the last slope and the mean
    one (a flat last segment would make guesses look free)."""

    def __init__(self, rise: float = 0.05, kept: int = 64) -> None:
        self.rise, self.kept = rise, kept
        self._floor: dict[int, float] = {}  # rows -> lowest recent step time (insertion order: least recent first)

    def observe(self, rows: int, seconds: float) -> None:
        old = self._floor.pop(rows, None)
        self._floor[rows] = seconds if old is None or seconds < old else old + self.rise * (seconds - old)
        if len(self._floor) > self.kept:
            del self._floor[next(iter(self._floor))]

    def cost(self, rows: int) -> float | None:
        """Seconds a step of `rows` rows takes; None until steps of two row counts were seen."""
        if len(self._floor) < 2:
            return None
        xs = sorted(self._floor)
        ys = list(itertools.accumulate((self._floor[x] for x in xs), max))
        if rows > xs[-1]:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[0]) / (xs[-1] - xs[0]))
            return ys[-1] + slope * (rows - xs[-1])
        k = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)  # the segment xs[k-1]..xs[k] (or the nearest)
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), 0.0)

    def pays(self, rate: float, decode_rows: int, rows: int, guess: int) -> bool:
        """Whether adding a guess of `guess` rows, taken at `rate`, to a step of `rows` rows that yields
        `decode_rows` tokens yields more tokens per second."""
        now, more = self.cost(rows), self.cost(rows + guess)
        if now is None or more is None:
            return True
        return (decode_rows + rate * guess) * now > decode_rows * more


def _occurrences(h: np.ndarray, n: int) -> np.ndarray:
    """Positions where an earlier occurrence of h's last n tokens ends (each followed by a token), in order."""
    end = len(h)
    if end <= n:
        return np.empty(0, dtype=np.int64)
    tail = h[end - n :]
    ends = np.flatnonzero(h[n - 1 : end - 1] == tail[-1]) + (n - 1)
    for back in range(1, n):
        if not ends.size:
            break
        ends = ends[h[ends - back] == tail[-1 - back]]
    return ends
