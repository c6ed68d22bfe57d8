"""Prompt-lookup speculation: guess a job's next tokens from its own history, without a draft model.

Agents re-emit text they were just shown (an edited file, quoted tool output). When the last `n` tokens of a
conversation occurred earlier in it, the tokens that followed that occurrence are a cheap guess of what comes
next. The engine verifies a guess in the same `llama_decode` as the other slots' rows: every guessed token gets
a logits row, the job's own sampler picks a token from each row in turn, and the guess is kept up to the first
token the sampler did not pick (the KV of the rest is removed with `llama_memory_seq_rm`). The sampler sees
exactly the rows it would have seen one token at a time, so the output is what it would have been without
speculation; only the number of `llama_decode` calls changes.

A guess costs a logits row per token (on CPU about as much as a decode row: the output layer dominates), so the
length adapts: it starts at START tokens, doubles while guesses are taken whole and falls back to what was
taken when one is cut short. And a job guesses only while its guesses pay in the step at hand (`StepCost`): a
step of D decode rows that takes T(R) for its R rows gains from a guess of g rows taken at rate r only if
(D + r g) / T(R + g) > D / T(R). On a CPU a guessed row costs about a decode row, so with one slot generating a
guess pays when a third of it is taken, with eight only when most of it is. Each job keeps the share of its guesses
taken (`Drafter.rate`); while its guesses would not pay, they are checked against what it then produces instead of
computed (`shadow`), so the share stays current at no cost.
"""

from __future__ import annotations

import bisect

import numpy as np

START = 4  # tokens in a job's first guess
RATE_WEIGHT = 0.25  # of the latest guess in a job's share of guessed tokens taken
START_RATE = 0.5  # a job's share before its first guess: enough for one slot on a CPU, not for a busy batch
PROBE_EVERY = 32  # while a job's guesses are withheld, one in this many is computed all the same (so the cost of a
# step with guesses is measured again: a slow moment of the machine does not keep guessing off for good)
RESYNC = 64  # tokens after the place the output left where a guess looks for it first
RESYNC_BACK = 8  # ... and before it


class Drafter:
    """One job's guesser over everything its conversation holds (prompt, then each generated token).

    It follows one place in the history while the output keeps copying it (`_src`: the position of the token it
    expects next), so a line that occurs twice in a file does not send the guess to the wrong copy. When the output
    leaves that place (an edit, or the same text cut into other tokens), it looks for the last `n` tokens again:
    the first occurrence near where it was (RESYNC tokens on), else the latest one."""

    def __init__(self, history: list[int], capacity: int, n: int, k_max: int) -> None:
        self.n = n
        self.k_max = k_max
        self.k = min(START, k_max)
        self._buf = np.zeros(max(capacity, len(history)) + 1, dtype=np.int32)
        self._len = len(history)
        self._buf[: self._len] = history
        self._src = -1  # where the token expected next is in the history (-1: following nothing)
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
            if src < self._len and self._buf[src] == token:
                self._src = src + 1
            else:
                self._src, self._lost = -1, src
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
        if self._src < 0 or self._src >= self._len:
            self._src = self._find()
            if self._src < 0:
                return []
        return self._buf[self._src : min(self._src + k, self._len)].tolist()

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


class StepCost:
    """What a step costs by its row count, from steps that only decode and verify guesses (every row with logits), and
    whether a guess pays in the step at hand. Not a line: on a CPU the first rows of a step share one pass over the
    weights, later ones each cost about as much as a decode row. Steps are timed on a shared machine, where other
    work only ever adds time, so each row count keeps the lowest time seen lately (it sinks to a faster step at once
    and rises slowly); between row counts the cost is interpolated, beyond them extended along the last slope."""

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
        k = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)  # the segment xs[k-1]..xs[k] (or the nearest)
        x0, x1 = xs[k - 1], xs[k]
        y0, y1 = self._floor[x0], self._floor[x1]
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
