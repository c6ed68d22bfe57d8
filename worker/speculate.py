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
taken when one is cut short.
"""

from __future__ import annotations

import numpy as np

START = 4  # tokens in a job's first guess
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

    def push(self, token: int) -> None:
        """A token the job produced (every one, drafted or not)."""
        if self._len == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
        self._buf[self._len] = token
        src = self._src
        if src >= 0:
            if src < self._len and self._buf[src] == token:
                self._src = src + 1
            else:
                self._src, self._lost = -1, src
        self._len += 1

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that follow the place the output copies (see the class)."""
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
